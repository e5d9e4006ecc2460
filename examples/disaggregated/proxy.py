"""A minimal prefill/decode proxy for two vLLM OpenAI servers.

For each ``POST /v1/completions``: send the request to the prefill server with
``max_tokens: 1`` and ``do_remote_decode``, then send the original request to
the decode server with the ``kv_transfer_params`` the prefill server returned,
and answer the caller with the decode server's response. The caller's W3C
trace context (``traceparent``, ``tracestate``) goes to both servers, so their
spans join the caller's trace.

Standard library only; one thread per request; no streaming. A sketch of the
protocol for tests and demos, not a production router.

    python proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TRACE_HEADERS = ("traceparent", "tracestate")
UPSTREAM_TIMEOUT_S = 300

# What a prefill request asks of the prefill server's NIXL connector: keep the
# prompt's KV for a remote decode instead of decoding here.
REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class UpstreamError(Exception):
    """An upstream server answered with an error; relayed to the caller as is."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


def post_json(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=UPSTREAM_TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        raise UpstreamError(error.code, error.read()) from error


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill server: one token, KV kept for the decode server."""
    return {**body, "max_tokens": 1, "min_tokens": 0, "stream": False,
            "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)}


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The caller's request, plus where the decode server pulls the prompt's KV from."""
    params = prefill_response.get("kv_transfer_params")
    if not params:
        raise UpstreamError(
            HTTPStatus.BAD_GATEWAY,
            b'{"error": "the prefill server returned no kv_transfer_params: '
            b'does it run a NIXL connector (kvcompose prefill.yaml)?"}',
        )
    return {**body, "kv_transfer_params": params}


class ProxyHandler(BaseHTTPRequestHandler):
    prefill_url: str
    decode_url: str

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(HTTPStatus.OK, b"{}")
        else:
            self._reply(HTTPStatus.NOT_FOUND, b'{"error": "only POST /v1/completions and GET /health"}')

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._reply(HTTPStatus.NOT_FOUND, b'{"error": "only POST /v1/completions and GET /health"}')
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if body.get("stream"):
            self._reply(HTTPStatus.BAD_REQUEST, b'{"error": "this proxy does not stream; send stream: false"}')
            return
        trace = {name: value for name in TRACE_HEADERS if (value := self.headers.get(name))}
        try:
            prefilled = post_json(f"{self.prefill_url}/v1/completions", prefill_request(body), trace)
            decoded = post_json(f"{self.decode_url}/v1/completions", decode_request(body, prefilled), trace)
        except UpstreamError as error:
            self._reply(error.status, error.body)
            return
        except OSError as error:
            self._reply(HTTPStatus.BAD_GATEWAY, json.dumps({"error": f"upstream unreachable: {error}"}).encode())
            return
        self._reply(HTTPStatus.OK, json.dumps(decoded).encode())

    def _reply(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Quiet: no line per request (and no prompt content) on stderr."""


def make_proxy(prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    handler = type("Handler", (ProxyHandler,), {"prefill_url": prefill_url.rstrip("/"),
                                                 "decode_url": decode_url.rstrip("/")})
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="base URL of the prefill server")
    parser.add_argument("--decode", required=True, help="base URL of the decode server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    proxy = make_proxy(args.prefill, args.decode, args.host, args.port)
    print(f"proxy on http://{args.host}:{args.port} -> prefill {args.prefill}, decode {args.decode}", flush=True)
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
