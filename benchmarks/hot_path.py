"""A worker step's calls, and a request's scheduler-side calls, in the composite against MultiConnector.

Subjects, side by side in one run over the same no-op children:

- ``multi``: vLLM's MultiConnector;
- ``multi_twin``: a second, identical MultiConnector: how far two identical
  subjects read apart in this row of this run;
- ``kvc_bare``: KVComposeConnector, metrics and tracing off;
- ``kvc_off``: KVComposeConnector as shipped: metrics on (every call timed),
  tracing off;
- ``kvc_request`` / ``kvc_step``: metrics on, tracing at that granularity.
  Spans are recorded with exporter ``none``, so the figures are the cost of
  making them; exporting is measured end to end (benchmarks.batch_scaling).

``worker step``: the calls vLLM makes into the connector in one decode step
of a model of ``layers`` layers (bind, start_load_kv, per layer
wait_for_layer_load and save_kv_layer, wait_for_save, get_finished, the load
errors, the worker metadata, the stats, clear), the metadata built once by the
subject's own scheduler side: a step between two reports, whose stats carry the
children's own only (kvcompose's tables go out at one step a second; their cost
is measured end to end). ``request``: a request's scheduler-side life in the
composite (lookup, allocation, finish).

What a user feels is judged end to end (benchmarks.batch_scaling); these rows
say where a step's or a request's extra microseconds go.
"""

from __future__ import annotations

from typing import Any

from benchmarks.connectors import kvcompose_connector, multi_connector, pipeline
from benchmarks.timing import per_call_ns

# (children, layers) of the worker-step rows; the request rows are per child count.
SHAPES = ((2, 2), (2, 32), (8, 2))
# name -> (metrics, tracing granularity or None)
KVCOMPOSE_SUBJECTS: dict[str, tuple[bool, str | None]] = {
    "kvc_bare": (False, None),
    "kvc_off": (True, None),
    "kvc_request": (True, "request"),
    "kvc_step": (True, "step"),
}
SUBJECTS = ("multi", "multi_twin", *KVCOMPOSE_SUBJECTS)
WORKER_STEP = """\
c.bind_connector_metadata(metadata)
c.start_load_kv(None)
for layer in layers:
    c.wait_for_layer_load(layer)
    c.save_kv_layer(layer, None, None)
c.wait_for_save()
c.get_finished(finished)
c.get_block_ids_with_load_errors()
c.build_connector_worker_meta()
c.get_kv_connector_stats()
c.clear_connector_metadata()
"""
REQUEST = """\
c.get_num_new_matched_tokens(request, 0)
c.update_state_after_alloc(request, blocks, 0)
c.request_finished(request, [])
"""


def _pair(name: str, children: int) -> tuple[Any, Any]:
    """The subject's scheduler side and worker side."""
    if name.startswith("multi"):
        return multi_connector(children, "scheduler"), multi_connector(children, "worker")
    metrics, tracing = KVCOMPOSE_SUBJECTS[name]
    bench_pipeline = pipeline(children, metrics=metrics, tracing=tracing)
    return kvcompose_connector(bench_pipeline, "scheduler"), kvcompose_connector(bench_pipeline, "worker")


def _decode_metadata(scheduler: Any) -> Any:
    """A decode step's metadata (one admitted request, no KV moving), as the scheduler side builds it."""
    from tests.connector_support import make_blocks, make_request, scheduler_output

    request = make_request("bench-decode")
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), 0)
    scheduler.build_connector_meta(scheduler_output(new=[request], blocks=[1, 2]))
    return scheduler.build_connector_meta(scheduler_output(cached=["bench-decode"]))


def measure(rounds: int = 5, sample_s: float = 0.05, calls: int | None = None) -> list[dict[str, Any]]:
    """One row per worker-step shape and per request child count: us per step (or request) of every subject,
    and each one's extra over MultiConnector."""
    from tests.connector_support import make_blocks, make_request

    rows = []
    for children, layers in SHAPES:
        subjects = {}
        for name in SUBJECTS:
            scheduler, worker = _pair(name, children)
            subjects[name] = {"c": worker, "metadata": _decode_metadata(scheduler), "finished": set(),
                              "layers": [f"model.layers.{index}" for index in range(layers)]}
        rows.append(_row("worker step", children, layers, per_call_ns(WORKER_STEP, subjects, rounds, sample_s, calls)))
    for children in sorted({children for children, _ in SHAPES}):
        subjects = {name: {"c": _pair(name, children)[0], "request": make_request(f"bench-{name}"),
                           "blocks": make_blocks(1, 2)} for name in SUBJECTS}
        rows.append(_row("request", children, None, per_call_ns(REQUEST, subjects, rounds, sample_s, calls)))
    return rows


def _row(what: str, children: int, layers: int | None, ns: dict[str, float]) -> dict[str, Any]:
    return {"what": what, "children": children, "layers": layers, "us": {name: ns[name] / 1e3 for name in ns},
            "extra_us": {name: (ns[name] - ns["multi"]) / 1e3 for name in SUBJECTS if name != "multi"}}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: us per step (or request), and each subject's extra over MultiConnector."""
    header = ["calls", "children", "layers", "multi", *(name.removeprefix("kvc_") for name in SUBJECTS[1:])]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        us, extra = row["us"], row["extra_us"]
        cells = [row["what"], str(row["children"]), "-" if row["layers"] is None else str(row["layers"]),
                 f"{us['multi']:.2f}", *(f"{us[name]:.2f} ({extra[name]:+.2f})" for name in SUBJECTS[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure()))
