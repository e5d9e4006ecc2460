"""kvcompose's structured logs (structlog), correlated with the current span.

kvcompose logs through its own ``kvcompose`` stdlib logger with its own
handler, so vLLM's logging configuration is neither used nor changed. Every
line inside a recording span carries ``trace_id``, ``span_id`` and, inside a
child call, the child's ``connector`` name. Use :func:`get_logger`; the
pipeline's ``logging:`` section picks the format and level
(:func:`configure_logging`). Log ids, counts and timings, never prompt content.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace

from kvcompose.config import LoggingSection

ROOT_LOGGER = "kvcompose"



class CurrentCall:
    """The traced child call running now, set by kvcompose's tracer: (trace id, span id, child name).

    A plain attribute, not a ContextVar: vLLM calls a connector from one thread
    per process.
    """

    __slots__ = ("ids",)

    def __init__(self) -> None:
        self.ids: tuple[int, int, str] | None = None


CURRENT_CALL = CurrentCall()


def add_trace_context(logger: Any, method_name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the ids of the traced call running now (else of an embedder's current
    OpenTelemetry span) and the child's name."""
    if (call := CURRENT_CALL.ids) is not None:
        trace_id, span_id, connector = call
        event.setdefault("trace_id", trace.format_trace_id(trace_id))
        event.setdefault("span_id", trace.format_span_id(span_id))
        event.setdefault("connector", connector)
        return event
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", trace.format_trace_id(context.trace_id))
        event.setdefault("span_id", trace.format_span_id(context.span_id))
    return event


class _Renderer:
    """The last processor; :func:`configure_logging` swaps what it renders with."""

    def __init__(self) -> None:
        self.render: Any = structlog.dev.ConsoleRenderer(colors=False)

    def __call__(self, logger: Any, method_name: str, event: MutableMapping[str, Any]) -> str:
        return self.render(logger, method_name, event)


_RENDERER = _Renderer()
_PROCESSORS = [
    structlog.stdlib.filter_by_level,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    add_trace_context,
    structlog.processors.format_exc_info,
    _RENDERER,
]


def _root() -> logging.Logger:
    root = logging.getLogger(ROOT_LOGGER)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # rendered already; vLLM's handlers would print it twice
    return root


def get_logger(name: str) -> Any:
    """A structlog logger writing through ``kvcompose.<name>``."""
    _root()
    return structlog.wrap_logger(
        logging.getLogger(f"{ROOT_LOGGER}.{name}"), processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def configure_logging(section: LoggingSection) -> None:
    """Apply a pipeline's ``logging:`` section to this process's kvcompose logs."""
    _root().setLevel(section.level)
    _RENDERER.render = (
        structlog.processors.JSONRenderer() if section.format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
