"""Whole request lives through a scheduler-side connector, and the subjects the request benchmarks compare.

A request's life is what the scheduler asks of its connector for a request
admitted and finished at once: lookup, allocation, ``build_connector_meta``
with the request new, ``request_finished``, over no-op children (the first one
matches). Subjects: vLLM's MultiConnector, kvcompose with metrics on and
tracing off, and kvcompose tracing every request at request granularity,
exporting over OTLP/HTTP to a collector stand-in (``benchmarks/otlp_sink.py``)
in another process.
"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import cache
from types import TracebackType
from typing import Any

from benchmarks.connectors import kvcompose_connector, multi_connector, pipeline
from benchmarks.stopwatch import exporter_cpu_s
from kvcompose.config import TracingSection
from tests.connector_support import make_blocks, make_request, scheduler_output

SUBJECTS = ("multi", "kvc_off", "kvc_traced")
BLOCK_IDS = [1, 2, 3]
WARM_UP = 20  # request lives per subject first: first calls import, and the exporter process starts


class Collector:
    """The collector stand-in in a process of its own; ``exports`` and ``bytes`` it received once closed."""

    def __init__(self) -> None:
        self._process = subprocess.Popen([sys.executable, "-m", "benchmarks.otlp_sink"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        self.endpoint = self._process.stdout.readline().strip()
        self.exports = self.bytes = 0

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        assert self._process.stdin is not None and self._process.stdout is not None
        # A traced subject shut down lets its exporter process flush for up to tracing.shutdown_flush_s without
        # waiting for it: the collector stays up that long.
        time.sleep(TracingSection().shutdown_flush_s)
        self._process.stdin.close()
        self.exports, self.bytes = (int(value) for value in self._process.stdout.readline().split())
        self._process.wait(5)


def subjects(children: int, endpoint: str) -> dict[str, Any]:
    """Every subject, scheduler side; ``endpoint``: where the traced one exports."""
    traced = pipeline(children, tracing="request")
    traced["tracing"].update(exporter="otlp", endpoint=endpoint)
    return {"multi": multi_connector(children, "scheduler"),
            "kvc_off": kvcompose_connector(pipeline(children), "scheduler"),
            "kvc_traced": kvcompose_connector(traced, "scheduler")}


def rotated(round_index: int) -> tuple[str, ...]:
    """The subjects in this round's order: each one goes first in turn."""
    shift = round_index % len(SUBJECTS)
    return SUBJECTS[shift:] + SUBJECTS[:shift]


@cache
def _blocks() -> Any:
    return make_blocks(*BLOCK_IDS)


def live(connector: Any, request_id: str) -> None:
    """One request's whole life through ``connector`` (making the vLLM request included)."""
    request = make_request(request_id)
    tokens, _ = connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, _blocks(), tokens or 0)
    connector.build_connector_meta(scheduler_output(new=[request], blocks=BLOCK_IDS))
    connector.request_finished(request, BLOCK_IDS)



def caught_up_exporter_cpu_s(timeout_s: float = 10.0) -> float:
    """The exporter processes' CPU seconds once they have caught up with what they were sent (it stops
    growing): read at once, it would miss the batches still waiting in the pipe."""
    deadline, last = time.monotonic() + timeout_s, exporter_cpu_s()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if (now := exporter_cpu_s()) - last < 0.005:
            return now
        last = now
    return last


def warm_up(served: dict[str, Any], prefix: str) -> float:
    """:data:`WARM_UP` lives through each subject, then wait for the exporter process to have started
    (its imports cost about a second of CPU, not to be charged to the requests measured next);
    returns its CPU seconds so far."""
    for name, connector in served.items():
        for index in range(WARM_UP):
            live(connector, f"{prefix}-{name}-warm-up-{index}")
    return caught_up_exporter_cpu_s()
