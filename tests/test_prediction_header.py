"""kvcompose serve's prediction-header middleware, on ASGI messages as Starlette passes them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvcompose.prediction_header import PredictionHeaderMiddleware

HEADER = b"x-kvcompose-predicted-cached-tokens"


def _through(headers: list[tuple[bytes, bytes]], chunks: list[bytes], method: str = "POST") -> tuple[Any, bytes]:
    """The headers and body the app behind the middleware sees for a request sent in ``chunks``."""
    seen: dict[str, Any] = {}
    sent = [{"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
            for index, chunk in enumerate(chunks)]

    async def receive() -> Any:
        return sent.pop(0)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["headers"], seen["body"] = scope["headers"], body

    scope = {"type": "http", "method": method, "headers": headers}
    asyncio.run(PredictionHeaderMiddleware(app)(scope, receive, None))  # type: ignore[arg-type]
    return seen["headers"], seen["body"]


def test_the_header_moves_into_kv_transfer_params() -> None:
    body = json.dumps({"model": "m", "prompt": "w1 w2", "kv_transfer_params": {"other": 1}}).encode()
    headers, seen = _through([(b"content-type", b"application/json"), (b"content-length", b"1"),
                              (HEADER, b" 384 ")], [body[:10], body[10:]])
    assert json.loads(seen) == {"model": "m", "prompt": "w1 w2",
                                "kv_transfer_params": {"other": 1, "kvcompose": {"predicted_cached_tokens": 384}}}
    assert dict(headers)[b"content-length"] == str(len(seen)).encode()
    assert HEADER not in dict(headers)


@pytest.mark.parametrize(("value", "expected"), [(b"-5", -5), (b"12.5", "12.5"), (b"x" * 4096, "x" * 256)])
def test_a_value_that_is_not_a_count_is_passed_for_the_engine_to_count_invalid(value: bytes, expected: Any) -> None:
    _, seen = _through([(HEADER, value)], [b'{"prompt": "w1"}'])
    assert json.loads(seen)["kv_transfer_params"] == {"kvcompose": {"predicted_cached_tokens": expected}}


@pytest.mark.parametrize("body", [
    b'{"kv_transfer_params": {"kvcompose": {"predicted_cached_tokens": 7}}}',  # the body's prediction wins
    b'{"kv_transfer_params": "junk"}', b'[1, 2]', b'not json', b'{"kv_transfer_params": {"kvcompose": [1]}}',
    b'[' * 100_000 + b']' * 100_000,  # nesting past the recursion limit
])
def test_a_body_it_cannot_or_need_not_change_passes_unchanged(body: bytes) -> None:
    headers, seen = _through([(HEADER, b"3"), (b"content-length", str(len(body)).encode())], [body])
    assert seen == body and (HEADER, b"3") in headers


def test_requests_without_the_header_and_other_methods_are_untouched() -> None:
    body = b'{"prompt": "w1"}'
    assert _through([(b"content-length", b"16")], [body]) == ([(b"content-length", b"16")], body)
    assert _through([(HEADER, b"3")], [body], method="GET")[1] == body
