"""A router's prediction sent as a header, moved into the request under ``kvcompose serve``.

A prefix-aware router may send its prediction of the prompt tokens the engine
holds as the header ``x-kvcompose-predicted-cached-tokens: N`` rather than in
the body. :class:`PredictionHeaderMiddleware`, an ASGI middleware that
``kvcompose serve`` gives vLLM's server (``--middleware``), moves it into the
JSON body as ``kv_transfer_params: {"kvcompose": {"predicted_cached_tokens":
N}}``, where the engine reads it (kvcompose.instrumentation.receipts). A
prediction already in the body wins; a body that is not a JSON object, or
whose ``kv_transfer_params`` is not one, is passed on unchanged. A header
value that is not a decimal integer is passed as the string it is, so the
engine counts it invalid. Requests without the header are not touched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvcompose.wire.routing import PARAMS_KEY, PREDICTED_HEADER, PREDICTED_KEY

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

HEADER = PREDICTED_HEADER.encode()
_INTEGER = re.compile(r"-?[0-9]{1,18}")
MAX_HEADER_VALUE = 256  # characters of a value passed on (an invalid one is counted, not read)


def predicted_value(header: bytes) -> int | str:
    """The header's value as the prediction: an int where it is a decimal integer, else the (cut) string."""
    text = header.decode("latin-1").strip()
    return int(text) if _INTEGER.fullmatch(text) else text[:MAX_HEADER_VALUE]


def with_prediction(body: bytes, value: int | str) -> bytes | None:
    """``body`` with the prediction in its kv_transfer_params; None where it stays as it is."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    params = document.get("kv_transfer_params")
    if params is None:
        document["kv_transfer_params"] = {PARAMS_KEY: {PREDICTED_KEY: value}}
    elif not isinstance(params, dict):
        return None
    elif (entry := params.get(PARAMS_KEY)) is None:
        params[PARAMS_KEY] = {PREDICTED_KEY: value}
    elif isinstance(entry, dict) and PREDICTED_KEY not in entry:
        entry[PREDICTED_KEY] = value
    else:  # the body's own prediction (or junk there) wins
        return None
    try:
        return json.dumps(document).encode()
    except (ValueError, RecursionError):
        return None


class PredictionHeaderMiddleware:
    """Moves ``x-kvcompose-predicted-cached-tokens`` into the request's kv_transfer_params; see the module
    docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        header = None
        if scope["type"] == "http" and scope.get("method") == "POST":
            header = next((value for name, value in scope["headers"] if name == HEADER), None)
        if header is None:
            await self.app(scope, receive, send)
            return
        chunks, message = [], None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing to rewrite
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                message = None
                break
        body = b"".join(chunks)
        rewritten = with_prediction(body, predicted_value(header)) if message is None else None
        if rewritten is not None:
            body = rewritten
            headers = [(name, value) for name, value in scope["headers"] if name not in (b"content-length", HEADER)]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        pending = [{"type": "http.request", "body": body, "more_body": False}] if message is None else [
            {"type": "http.request", "body": body, "more_body": True}, message]

        async def replay() -> Any:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)
