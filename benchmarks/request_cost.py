"""Engine-process CPU per request, tracing every request: what production request rates cost.

A scheduler-side connector is driven through whole request lives (lookup,
allocation, ``build_connector_meta`` with the request new, ``request_finished``),
over no-op children. Subjects: vLLM's MultiConnector, kvcompose with metrics on
and tracing off, and kvcompose tracing every request at request granularity,
exporting over OTLP/HTTP to a collector stand-in in another process. The figure
is this process's CPU time (``time.process_time``: every thread, the span
pipe included; the exporter process and the collector are other processes),
per request, less MultiConnector's, measured side by side in rotating rounds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from benchmarks.connectors import kvcompose_connector, multi_connector, pipeline

CHILD_COUNTS = (2, 8)
SUBJECTS = ("multi", "kvc_off", "kvc_traced")


def _sink() -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.otlp_sink"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def _subjects(children: int, endpoint: str) -> dict[str, Any]:
    traced = pipeline(children, tracing="request")
    traced["tracing"].update(exporter="otlp", endpoint=endpoint)
    return {"multi": multi_connector(children, "scheduler"),
            "kvc_off": kvcompose_connector(pipeline(children), "scheduler"),
            "kvc_traced": kvcompose_connector(traced, "scheduler")}


def _serve(connector: Any, requests: int, prefix: str) -> float:
    """CPU seconds of this process for ``requests`` whole request lives."""
    from tests.connector_support import make_blocks, make_request, scheduler_output

    blocks = make_blocks(1, 2, 3)
    start = time.process_time()
    for index in range(requests):
        request = make_request(f"{prefix}-{index}")
        tokens, _ = connector.get_num_new_matched_tokens(request, 0)
        connector.update_state_after_alloc(request, blocks, tokens or 0)
        connector.build_connector_meta(scheduler_output(new=[request], blocks=[1, 2, 3]))
        connector.request_finished(request, [1, 2, 3])
    return time.process_time() - start


def measure(rounds: int = 7, requests: int = 400) -> list[dict[str, Any]]:
    sink, endpoint = _sink()
    rows = []
    try:
        for children in CHILD_COUNTS:
            subjects = _subjects(children, endpoint)
            best = dict.fromkeys(SUBJECTS, float("inf"))
            for round_index in range(rounds):
                shift = round_index % len(SUBJECTS)
                for name in SUBJECTS[shift:] + SUBJECTS[:shift]:
                    seconds = _serve(subjects[name], requests, f"{name}-{children}-{round_index}")
                    best[name] = min(best[name], seconds / requests * 1e6)
            subjects["kvc_traced"].shutdown()  # the exporter process flushes and exits
            rows.append({"children": children, "us_per_request": best,
                         "extra_us": {name: best[name] - best["multi"] for name in SUBJECTS[1:]}})
    finally:
        assert sink.stdin is not None and sink.stdout is not None
        sink.stdin.close()
        exports, exported_bytes = (int(value) for value in sink.stdout.readline().split())
        sink.wait(5)
    for row in rows:
        row["sink_exports"], row["sink_bytes"] = exports, exported_bytes
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| children | MultiConnector us/request | kvcompose off: extra us | tracing every request: extra us |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {row['children']} | {row['us_per_request']['multi']:.1f} | {row['extra_us']['kvc_off']:+.1f} | "
              f"{row['extra_us']['kvc_traced']:+.1f} |" for row in rows]
    exports = rows[0]["sink_exports"] if rows else 0
    return "\n".join(lines) + f"\n\nThe collector stand-in received {exports} exports."
