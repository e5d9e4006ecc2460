"""An OTLP/HTTP trace receiver on loopback: a server's spans, decoded, where no collector runs.

``make demo`` points ``kvcompose serve --trace`` (kvcompose's spans and
vLLM's own) at one, then draws a trace from what arrived; the tests read
the spans of real servers from one. It accepts the
protobuf body opentelemetry-python's ``OTLPSpanExporter`` posts (gzipped or
not) on any path, answers 200, and keeps every span in memory.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int  # Unix time
    end_ns: int
    attributes: dict[str, Any]
    status_code: int = 0  # OTLP's: 0 unset, 1 ok, 2 error
    status_message: str = ""
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id)
    events: tuple[tuple[str, int, tuple[tuple[str, Any], ...]], ...] = ()  # (name, Unix time ns, attributes)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def seconds(self) -> float:
        return self.duration_ns / 1e9


class SpanReceiver:
    """Receives on 127.0.0.1, on a port of its own, from construction until :meth:`stop`."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._add(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a line per export would drown the output of whoever runs the receiver

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        """The base URL exporters are given; OTLP's ``/v1/traces`` (or any path) works under it."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def endpoint(self) -> str:
        """The OTLP/HTTP traces endpoint, for exporters given a full URL."""
        return f"{self.url}/v1/traces"

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        """The spans received so far, in arrival order; only those of ``trace_id`` if given."""
        with self._lock:
            return [span for span in self._spans if trace_id is None or span.trace_id == trace_id]

    def _add(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans = []
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            resource = {item.key: _value(item.value) for item in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        str(resource.get("service.name", "")), span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), span.start_time_unix_nano, span.end_time_unix_nano,
                        {item.key: _value(item.value) for item in span.attributes}, span.status.code,
                        span.status.message, tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        tuple((event.name, event.time_unix_nano,
                               tuple((item.key, _value(item.value)) for item in event.attributes))
                              for event in span.events)))
        with self._lock:
            self._spans.extend(spans)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(any_value: Any) -> Any:
    """An OTLP ``AnyValue`` as Python: whichever of string, bool, int, double, ... it holds."""
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None
