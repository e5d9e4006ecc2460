"""Per-call cost of the calls vLLM makes on its hot path, through each kind of connector.

Subjects, all over no-op children (see ``benchmarks/connectors.py``):

- ``direct``: one child called directly (the floor is ``children`` such calls);
- ``multi``: vLLM's MultiConnector;
- ``multi_twin``: a second, identical MultiConnector: its ratio to ``multi`` is
  how far two identical subjects read apart in this row of this run, so a
  kvcompose ratio that close to 1.0 is within the run's noise;
- ``kvc_bare``: KVComposeConnector, metrics and tracing off;
- ``kvc_off``: KVComposeConnector as shipped: metrics on (every call timed),
  tracing off;
- ``kvc_request`` / ``kvc_step`` / ``kvc_layer``: metrics on, tracing at that
  granularity. Spans are recorded with exporter ``none``, so the figures are
  the cost of making them; exporting is measured end to end.

Worker-side calls run inside a bound step built by the scheduler-side composite
from a real vLLM ``SchedulerOutput``, of two kinds:

- a decode step (a request already running): what nearly every step is; its
  calls are plain unless the step is one sampled for timing;
- the first step of one sampled request, loaded by the first child
  (``... moving KV``): a step that moves KV is observed call by call (each
  call timed: engine wait, copy time), and makes spans at every granularity.
  Its rows are reported, with no target: they are what a step that moves KV
  pays per call, against copies that take milliseconds.

Scheduler side, ``get_num_new_matched_tokens`` repeats the lookup of one open
request (its request span is started by the first lookup, as vLLM asks again
while a request waits), and ``lookup+request_finished`` is a request's whole
scheduler-side life in the composite: request span started, lookups, finished.
"""

from __future__ import annotations

from typing import Any

from benchmarks.connectors import kvcompose_connector, multi_connector, pipeline
from benchmarks.timing import per_call_ns

CHILD_COUNTS = (2, 8)
# name -> (metrics, tracing granularity or None)
KVCOMPOSE_SUBJECTS: dict[str, tuple[bool, str | None]] = {
    "kvc_bare": (False, None),
    "kvc_off": (True, None),
    "kvc_request": (True, "request"),
    "kvc_step": (True, "step"),
    "kvc_layer": (True, "layer"),
}
SUBJECTS = ("direct", "multi", "multi_twin", *KVCOMPOSE_SUBJECTS)
# operation -> (side, statement); ``c`` is the subject, ``request`` a real vLLM Request
WORKER_CALLS = {
    "start_load_kv": "c.start_load_kv(None)",
    "wait_for_layer_load": "c.wait_for_layer_load('model.layers.0')",
    "save_kv_layer": "c.save_kv_layer('model.layers.0', None, None)",
    "wait_for_save": "c.wait_for_save()",
}
MOVING = ", moving KV"  # the rows of the step that moves KV
OPERATIONS: dict[str, tuple[str, str]] = {
    **{name: ("worker", statement) for name, statement in WORKER_CALLS.items()},
    **{name + MOVING: ("worker_moving", statement) for name, statement in WORKER_CALLS.items()},
    "get_num_new_matched_tokens": ("scheduler", "c.get_num_new_matched_tokens(request, 0)"),
    "lookup+request_finished": (
        "scheduler", "c.get_num_new_matched_tokens(request, 0); c.request_finished(request, [])"
    ),
}


def _bind_first_step(scheduler: Any, worker: Any) -> None:
    """Schedule one request the first child loads and bind its first step, as vLLM orders the calls."""
    from tests.connector_support import make_blocks, make_request, scheduler_output

    request = make_request("bench-step")
    tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, make_blocks(1, 2), tokens)
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(new=[request])))


def _bind_decode_step(scheduler: Any, worker: Any) -> None:
    """Bind a step that decodes an admitted request: it moves no KV (after the first step, which is timed)."""
    from tests.connector_support import scheduler_output

    for _ in range(2):
        worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(cached=["bench-decode"])))
        worker.clear_connector_metadata()
    worker.bind_connector_metadata(scheduler.build_connector_meta(scheduler_output(cached=["bench-decode"])))


def build_subjects(children: int) -> dict[str, dict[str, Any]]:
    """side -> subject name -> connector, every kvcompose worker of a side bound to the same kind of step."""
    sides: dict[str, dict[str, Any]] = {}
    for side, role in (("scheduler", "scheduler"), ("worker", "worker"), ("worker_moving", "worker")):
        multi, twin = multi_connector(children, role), multi_connector(children, role)
        sides[side] = {"direct": multi.sub_connectors[0], "multi": multi, "multi_twin": twin}
    for name, (metrics, tracing) in KVCOMPOSE_SUBJECTS.items():
        bench_pipeline = pipeline(children, metrics=metrics, tracing=tracing)
        scheduler = sides["scheduler"][name] = kvcompose_connector(bench_pipeline, "scheduler")
        worker = sides["worker"][name] = kvcompose_connector(bench_pipeline, "worker")
        _bind_decode_step(scheduler, worker)
        moving = sides["worker_moving"][name] = kvcompose_connector(bench_pipeline, "worker")
        _bind_first_step(kvcompose_connector(bench_pipeline, "scheduler"), moving)
    return sides


def measure(rounds: int = 5, sample_s: float = 0.05, calls: int | None = None) -> list[dict[str, Any]]:
    """One row per (operation, children): ns per call of every subject and the ratios to MultiConnector."""
    from tests.connector_support import make_request

    rows = []
    for children in CHILD_COUNTS:
        sides = build_subjects(children)
        for operation, (side, statement) in OPERATIONS.items():
            request = make_request(f"bench-{operation}")
            subjects = {name: {"c": connector, "request": request} for name, connector in sides[side].items()}
            ns = per_call_ns(statement, subjects, rounds=rounds, sample_s=sample_s, calls=calls)
            rows.append({
                "op": operation,
                "children": children,
                "ns": ns,
                "vs_multi": {name: ns[name] / ns["multi"] for name in SUBJECTS if name != "multi"},
                "off_vs_floor": ns["kvc_off"] / (children * ns["direct"]),
            })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: ns per call, and each kvcompose figure as a ratio to MultiConnector."""
    header = ["op", "children", "direct", "multi", "multi twin",
              *(name.removeprefix("kvc_") for name in KVCOMPOSE_SUBJECTS), "off / floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        ns, ratio = row["ns"], row["vs_multi"]
        cells = [row["op"], str(row["children"]), f"{ns['direct']:.0f}", f"{ns['multi']:.0f}",
                 *(f"{ns[name]:.0f} ({ratio[name]:.2f}x)" for name in ("multi_twin", *KVCOMPOSE_SUBJECTS)),
                 f"{row['off_vs_floor']:.1f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure()))
