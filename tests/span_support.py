"""Spans exported in-process for a test to read, and waiting for what another thread or process ships."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvcompose.tracing import force_flush


class FlushedSpans(InMemorySpanExporter):
    """kvcompose's spans in memory, as they stand when read: the outboxes' thread ships every 0.1 s, so
    reading and clearing first ship what the tracers recorded until then."""

    def get_finished_spans(self) -> Any:
        force_flush()
        return super().get_finished_spans()

    def clear(self) -> None:
        force_flush()
        super().clear()


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0, poll_s: float = 0.001) -> None:
    """Return once ``condition()`` holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s")
        time.sleep(poll_s)
