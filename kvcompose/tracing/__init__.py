"""Spans around the composite's calls into its children, recorded cheaply and exported out of the engine.

The names below load on first use, so the exporter process (which needs only
records, the hand-over and the exporters) starts without the connector's imports.
"""

from __future__ import annotations

from kvcompose.lazy import lazy_attributes

_EXPORTS = {
    "PipelineTracer": "kvcompose.tracing.pipeline",
    "force_flush": "kvcompose.tracing.outbox",
    "pipeline_tracer": "kvcompose.tracing.pipeline",
    "set_span_exporter": "kvcompose.tracing.shipping",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
