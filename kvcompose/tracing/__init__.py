"""OpenTelemetry spans around the composite's calls into its children."""

from kvcompose.tracing.pipeline import NoTracing, PipelineTracer, TracedRequest, pipeline_tracer
from kvcompose.tracing.provider import set_tracer_provider

__all__ = ["NoTracing", "PipelineTracer", "TracedRequest", "pipeline_tracer", "set_tracer_provider"]
