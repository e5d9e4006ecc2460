"""An OTLP/HTTP trace receiver on 127.0.0.1 (no Jaeger or Collector can be installed here)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    status_code: int
    duration_ns: int = 0
    status_message: str = ""
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id)
    events: tuple[tuple[str, int, tuple[tuple[str, Any], ...]], ...] = ()  # (name, time ns, attributes)


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value")) if any_value.WhichOneof("value") else None


@dataclass
class OtlpReceiver:
    server: ThreadingHTTPServer
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1/traces"

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        decoded = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    decoded.append(ReceivedSpan(
                        service=resource.get("service.name", ""), name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes}, status_code=span.status.code,
                        duration_ns=span.end_time_unix_nano - span.start_time_unix_nano,
                        status_message=span.status.message,
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        events=tuple((event.name, event.time_unix_nano,
                                      tuple((a.key, _value(a.value)) for a in event.attributes))
                                     for event in span.events),
                    ))
        with self.lock:
            self.spans.extend(decoded)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_receiver() -> OtlpReceiver:
    receiver: OtlpReceiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            receiver.add(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    receiver = OtlpReceiver(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver
