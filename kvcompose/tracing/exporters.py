"""The span exporter a pipeline's ``tracing:`` section asks for (OTLP/HTTP, console, or none)."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

EXPORT_TIMEOUT_S = 5.0
OTLP_TRACES_PATH = "/v1/traces"


def span_exporter(kind: str, endpoint: str | None) -> SpanExporter | None:
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "none":
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # Without an endpoint the exporter reads the standard OTEL_EXPORTER_OTLP_* variables.
    return OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None, timeout=EXPORT_TIMEOUT_S)


def traces_url(endpoint: str) -> str:
    """Accept a collector's base URL (``http://jaeger:4318``) or its full traces URL."""
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


def protobuf_transport(exporter: SpanExporter) -> Callable[[bytes], bool] | None:
    """Send an already encoded OTLP request through ``exporter``'s own HTTP client, or None.

    Recent releases of opentelemetry-python's OTLP/HTTP exporter (kvcompose is
    tested with 1.45) keep its transport (endpoint, headers, TLS, compression
    and retries, configured from its arguments and the ``OTEL_EXPORTER_OTLP_*``
    variables) in a private client whose ``export`` takes the request's bytes.
    Handing it the bytes that :mod:`kvcompose.tracing.otlp` encodes keeps every
    one of those settings and skips the SDK's encoder. Any other exporter, or a
    release without that client, is given SDK spans instead (None here);
    ``test_otlp`` fails if the installed release lost it.
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    send = getattr(getattr(exporter, "_client", None), "export", None)
    if not isinstance(exporter, OTLPSpanExporter) or not callable(send):
        return None
    return lambda body: bool(getattr(send(body), "success", False))
