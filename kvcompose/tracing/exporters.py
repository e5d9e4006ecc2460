"""The span exporter a pipeline's ``tracing:`` section asks for: OTLP/HTTP or console.

Both are opentelemetry-python's own exporters, used through their public
``SpanExporter`` interface only.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

EXPORT_TIMEOUT_S = 5.0
OTLP_TRACES_PATH = "/v1/traces"


def span_exporter(kind: str, endpoint: str | None) -> SpanExporter:
    if kind == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # Without an endpoint the exporter reads the standard OTEL_EXPORTER_OTLP_* variables.
    return OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None, timeout=EXPORT_TIMEOUT_S)


def traces_url(endpoint: str) -> str:
    """Accept a collector's base URL (``http://jaeger:4318``) or its full traces URL."""
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH
