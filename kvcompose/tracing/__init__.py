"""Spans around the composite's calls into its children, recorded cheaply and exported out of the engine.

The names below load on first use, so the exporter process (which needs only
records, the ring and the exporters) starts without the connector's imports.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PipelineTracer": "kvcompose.tracing.pipeline",
    "TracedRequest": "kvcompose.tracing.pipeline",
    "force_flush": "kvcompose.tracing.outbox",
    "pipeline_tracer": "kvcompose.tracing.pipeline",
    "set_span_exporter": "kvcompose.tracing.shipping",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvcompose.tracing' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
