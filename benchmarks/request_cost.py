"""Engine-process CPU per request, tracing every request: what production request rates cost.

The subjects of ``benchmarks/request_life.py`` (vLLM's MultiConnector, kvcompose
with tracing off, and kvcompose tracing every request at request granularity,
exporting over OTLP/HTTP to a collector stand-in in another process) are driven
through whole request lives back to back. The figure is this process's CPU time
(``time.process_time``: every thread; the exporter process and the collector
are other processes), per request, less MultiConnector's, measured side by side
in rotating rounds (the best of each).
The exporter process's own CPU per traced request is reported apart (it runs on
another core; on a 2-vCPU machine a busy neighbour still slows this process).
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.request_life import SUBJECTS, Collector, caught_up_exporter_cpu_s, live, rotated, subjects, warm_up
from kvcompose.tracing import force_flush

CHILD_COUNTS = (2, 8)


def _serve(connector: Any, requests: int, prefix: str) -> float:
    """CPU seconds of this process for ``requests`` whole request lives, their spans shipped (the outboxes'
    thread would ship them within 0.1 s, maybe in another subject's turn)."""
    start = time.process_time()
    for index in range(requests):
        live(connector, f"{prefix}-{index}")
    force_flush()
    return time.process_time() - start


def measure(rounds: int = 7, requests: int = 400) -> list[dict[str, Any]]:
    rows = []
    with Collector() as sink:
        for children in CHILD_COUNTS:
            served = subjects(children, sink.endpoint)
            best = dict.fromkeys(SUBJECTS, float("inf"))
            exporter = warm_up(served, f"{children}")
            for round_index in range(rounds):
                for name in rotated(round_index):
                    seconds = _serve(served[name], requests, f"{name}-{children}-{round_index}")
                    best[name] = min(best[name], seconds / requests * 1e6)
            exporter_us = (caught_up_exporter_cpu_s() - exporter) / (rounds * requests) * 1e6
            served["kvc_traced"].shutdown()  # the exporter process flushes and exits
            rows.append({"children": children, "us_per_request": best,
                         "extra_us": {name: best[name] - best["multi"] for name in SUBJECTS[1:]},
                         "exporter_us_per_request": exporter_us})
    for row in rows:
        row["sink_exports"], row["sink_bytes"] = sink.exports, sink.bytes
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| children | MultiConnector us/request | kvcompose off: extra us | tracing every request: extra us | "
             "exporter process: us per traced request |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {row['children']} | {row['us_per_request']['multi']:.1f} | {row['extra_us']['kvc_off']:+.1f} | "
              f"{row['extra_us']['kvc_traced']:+.1f} | {row['exporter_us_per_request']:.0f} |" for row in rows]
    exports = rows[0]["sink_exports"] if rows else 0
    return "\n".join(lines) + f"\n\nThe collector stand-in received {exports} exports."
