"""One OpenTelemetry tracer provider per process, built from the pipeline's ``tracing:`` section.

The scheduler process and every worker process build their own provider the
first time a composite starts in them. Export is batched on a background
thread with a bounded queue: an unreachable collector drops spans once the
queue is full instead of slowing generation or growing memory.
"""

from __future__ import annotations

import secrets
import threading
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from kvcompose.config import TracingSection

# Spans waiting for export; beyond this they are dropped (and counted by the SDK).
MAX_QUEUED_SPANS = 4096
EXPORT_TIMEOUT_S = 5.0
# How long a shutting-down engine waits for queued spans (an unreachable collector would hold it 30 s).
SHUTDOWN_FLUSH_MS = 2000
OTLP_TRACES_PATH = "/v1/traces"

_lock = threading.Lock()
_providers: dict[TracingSection, TracerProvider] = {}
_override: TracerProvider | None = None


def set_tracer_provider(provider: TracerProvider | None) -> None:
    """Use ``provider`` for every pipeline with tracing enabled in this process
    (embedding kvcompose, tests); ``None`` goes back to the pipeline's exporter."""
    global _override
    _override = provider


def provider_for(section: TracingSection) -> TracerProvider:
    """This process's provider for a pipeline's tracing section (built on first use)."""
    if _override is not None:
        return _override
    with _lock:
        if (provider := _providers.get(section)) is None:
            provider = _providers[section] = _build_provider(section)
        return provider


class OsRandomIdGenerator(IdGenerator):
    """Trace and span ids from the OS's randomness.

    The SDK's default draws from Python's ``random``, which vLLM seeds alike in
    every engine and worker process: two servers of a prefill/decode pair
    would then hand out the same span ids inside one trace.
    """

    def generate_span_id(self) -> int:
        return secrets.randbits(64) or 1

    def generate_trace_id(self) -> int:
        return secrets.randbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


def _build_provider(section: TracingSection) -> TracerProvider:
    # shutdown_on_exit (the default) flushes what is queued when the process exits.
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: section.service_name}),
        sampler=ParentBased(TraceIdRatioBased(section.sample_ratio)),
        id_generator=OsRandomIdGenerator(),
    )
    if (exporter := _exporter(section)) is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUED_SPANS))
    return provider


def _exporter(section: TracingSection) -> SpanExporter | None:
    if section.exporter == "console":
        return ConsoleSpanExporter()
    if section.exporter == "none":
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # Without an endpoint the exporter reads the standard OTEL_EXPORTER_OTLP_* variables.
    endpoint = traces_url(section.endpoint) if section.endpoint else None
    return OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)


def traces_url(endpoint: str) -> str:
    """Accept a collector's base URL (``http://jaeger:4318``) or its full traces URL."""
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH
