"""The engine's fleet endpoint: a small HTTP server in the engine core that ``kvcompose fleet`` pulls from.

The samples are taken where the scheduler sees the requests, in the engine
core, so they are served from there, on a port of the pipeline's (``fleet.port``
plus the engine's data-parallel rank). This works under a plain ``vllm serve
--kv-transfer-config`` as under ``kvcompose serve``: no middleware, no change
to vLLM's front-end, and nothing travels through vLLM's stats.

- ``GET /kvcompose/fleet/samples?after=N``: a :class:`~kvcompose.wire.fleet.FleetBatch`
  of the sampled requests past sequence number ``N``, as JSON.
- ``GET /metrics``: the endpoint's own counters, so a Prometheus server can
  scrape it as a target and ``kvcompose fleet --prometheus`` find it there.

The server's threads are daemons: an engine that exits does not wait for them.
"""

from __future__ import annotations

import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvcompose.economics.fleet_samples import FleetSampler
from kvcompose.wire.fleet import SAMPLES_PATH

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class FleetEndpoint:
    """Serves one :class:`FleetSampler` on ``host:port`` from a daemon thread; binding fails at construction."""

    def __init__(self, sampler: FleetSampler, host: str, port: int) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint._answer(self)

            def log_message(self, format: str, *args: object) -> None:
                pass  # pulls every few seconds are not news

        self.sampler = sampler
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvcompose-fleet-endpoint",
                                        daemon=True)
        self._thread.start()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        address = urllib.parse.urlsplit(handler.path)
        if address.path == SAMPLES_PATH:
            after = urllib.parse.parse_qs(address.query).get("after", ["0"])[0]
            if not after.isdigit() or len(after) > 19:
                self._send(handler, 400, b"after: not a sequence number\n", "text/plain")
                return
            self._send(handler, 200, self.sampler.batch(int(after)).to_json(), "application/json")
        elif address.path == "/metrics":
            self._send(handler, 200, self._metrics().encode(), PROMETHEUS_TEXT)
        else:
            self._send(handler, 404, b"not found\n", "text/plain")

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _metrics(self) -> str:
        sampler = self.sampler
        return "".join([
            "# HELP kvcompose_fleet_engine_buffered_requests Sampled requests held for kvcompose fleet's next pull.\n",
            "# TYPE kvcompose_fleet_engine_buffered_requests gauge\n",
            f"kvcompose_fleet_engine_buffered_requests {sampler.buffered}\n",
            ("# HELP kvcompose_fleet_engine_dropped_requests_total Sampled requests dropped from the full buffer "
             "before any pull took them.\n"),
            "# TYPE kvcompose_fleet_engine_dropped_requests_total counter\n",
            f"kvcompose_fleet_engine_dropped_requests_total {sampler.dropped}\n",
            "# HELP kvcompose_fleet_engine_references_total Block references the engine's sampler has seen.\n",
            "# TYPE kvcompose_fleet_engine_references_total counter\n",
            f"kvcompose_fleet_engine_references_total {sampler.references}\n",
        ])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
