"""A collector stand-in for the benchmarks: accepts OTLP/HTTP exports on loopback and discards them.

It only reads each body and answers 200, so the benchmark charges kvcompose
for making and exporting spans, not for decoding them (a real collector runs
elsewhere). It counts exports and bytes to show that spans did leave.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpSink:
    def __init__(self) -> None:
        sink = self
        self.exports = 0
        self.bytes = 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                size = len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with sink._lock:
                    sink.exports += 1
                    sink.bytes += size
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1/traces"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    """Serve in a process of its own: print the endpoint, run until stdin closes, then print the counts."""
    import sys

    sink = OtlpSink()
    print(sink.endpoint, flush=True)
    sys.stdin.read()
    sink.stop()
    print(f"{sink.exports} {sink.bytes}", flush=True)


if __name__ == "__main__":
    main()
