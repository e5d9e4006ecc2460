"""Spans around the composite's calls into its children, recorded cheaply and exported out of the engine."""

from kvcompose.tracing.pipeline import NoTracing, PipelineTracer, TracedRequest, pipeline_tracer
from kvcompose.tracing.shipping import set_span_exporter

__all__ = ["NoTracing", "PipelineTracer", "TracedRequest", "pipeline_tracer", "set_span_exporter"]
