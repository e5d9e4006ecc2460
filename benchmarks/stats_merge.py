"""Cost of the stats' way from the workers to Prometheus, and the size of what crosses processes.

Each worker's payload comes from a real 16-child KVComposeConnector (no-op
children, ``metrics.per_layer`` on and every call timed: the largest payload) after one step, as
vLLM reads it after every step; the connector is told the engine has 64
workers, so it ships its table as a worker of such an engine does (dense). vLLM's KVOutputAggregator folds the workers'
stats into one with ``aggregate``; the merged stats reach the front-end as a
plain dict encoded with vLLM's msgpack encoder, whose size is measured here,
and the front-end hands each engine step's dict to ``observe`` of kvcompose's
Prometheus metrics (timed here for one worker's step).
"""

from __future__ import annotations

from typing import Any

from benchmarks.connectors import kvcompose_connector, pipeline
from benchmarks.timing import per_call_ns
from kvcompose.testing.steps import forward_step

WORKERS = 64
CHILDREN = 16
LAYERS = 2  # the tiny model's


def _stats_after(worker: Any, steps: int) -> Any:
    from kvcompose.wire.metadata import KVComposeMetadata

    for step in range(steps):  # the last step's stats carry the tables, as an engine's do once a second
        worker.bind_connector_metadata(KVComposeMetadata(per_child=(None,) * len(worker.children),
                                                         report_stats=step == steps - 1))
        forward_step(worker, LAYERS)
        worker.clear_connector_metadata()
    return worker.get_kv_connector_stats()


def merge(stats: list[Any]) -> Any:
    """Fold the workers' stats as vLLM's KVOutputAggregator does."""
    from kvcompose.wire.stats import KVComposeStats

    merged = KVComposeStats()
    for worker_stats in stats:
        merged = merged.aggregate(worker_stats)
    return merged


def wire_bytes(stats: Any) -> int:
    """Size of the stats' dict as vLLM sends it from the engine to the front-end."""
    from vllm.v1.serial_utils import MsgpackEncoder

    return sum(len(buffer) for buffer in MsgpackEncoder().encode(stats.to_dict()))


def bound_bytes(children: list[str], buckets: int) -> int:
    """Size of the largest payload a pipeline of ``children`` can send: every cell used, every number long."""
    from kvcompose.wire.calls import COUNTERS, OPS, CallTable
    from kvcompose.wire.stats import KVComposeStats

    cells = {cell: [2**62, 1 / 3] for cell in range(len(children) * len(OPS) * buckets)}
    table = CallTable(children, buckets, cells, [2**62] * (len(children) * len(COUNTERS)))
    return wire_bytes(KVComposeStats(data={"calls": table}))


def prometheus_metrics(bench_pipeline: dict[str, Any]) -> Any:
    """kvcompose's Prometheus metrics as vLLM's front-end builds them (one engine)."""
    from prometheus_client import Counter, Gauge, Histogram

    from benchmarks.connectors import kvcompose_vllm_config
    from kvcompose.connectors import KVComposeConnector

    return KVComposeConnector.build_prom_metrics(
        kvcompose_vllm_config(bench_pipeline), {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"], {0: ["bench", "0"]},
    )


def measure(workers: int = WORKERS, children: int = CHILDREN, heavy_steps: int = 1000, rounds: int = 5,
            calls: int | None = None) -> dict[str, Any]:
    bench_pipeline = pipeline(children, per_layer=True)
    worker = kvcompose_connector(bench_pipeline, "worker", workers=workers)
    payloads = [_stats_after(worker, 1) for _ in range(workers)]
    # Timed with to_dict: vLLM turns the merged stats into a dict right after, and that is where a merge
    # of dense arrays goes back to sparse cells.
    ns = per_call_ns("merge(payloads).to_dict()", {"merge": {"merge": merge, "payloads": payloads}}, rounds=rounds,
                     calls=calls)["merge"]
    observe_ns = per_call_ns("metrics.observe(step)", {"observe": {
        "metrics": prometheus_metrics(bench_pipeline), "step": payloads[0].to_dict()}}, rounds=rounds,
        calls=calls)["observe"]
    one_step, many_steps = wire_bytes(payloads[0]), wire_bytes(_stats_after(worker, heavy_steps))
    bound = bound_bytes(list(payloads[0].calls.children), payloads[0].calls.buckets)
    return {
        "workers": workers,
        "children": children,
        "merge_ms": ns / 1e6,
        "observe_step_us": observe_ns / 1e3,
        "worker_payload_bytes": {"1_step": one_step, f"{heavy_steps}_steps": many_steps},
        "payload_growth": many_steps / one_step,
        "payload_bound_bytes": bound,
        "merged_payload_bytes": wire_bytes(merge(payloads)),
    }


def table(result: dict[str, Any]) -> str:
    sizes = result["worker_payload_bytes"]
    (one_label, one), (many_label, many) = sizes.items()
    return "\n".join([
        "| measure | value |",
        "| --- | --- |",
        f"| merge {result['workers']} worker payloads of {result['children']} children (and to_dict) | "
        f"{result['merge_ms']:.3f} ms |",
        f"| Prometheus observe of one worker's step ({result['children']} children) | "
        f"{result['observe_step_us']:.0f} us |",
        f"| one worker's payload after {one_label.replace('_', ' ')} / {many_label.replace('_', ' ')} | "
        f"{one} B / {many} B ({result['payload_growth']:.2f}x) |",
        f"| largest payload this pipeline can send (every cell used) | {result['payload_bound_bytes']} B |",
        f"| merged payload ({result['workers']} workers) | {result['merged_payload_bytes']} B |",
    ])


if __name__ == "__main__":
    print(table(measure()))
