"""kvcompose's request headers, moved into the request under ``kvcompose serve``: a router's prediction, a tenant.

A prefix-aware router may send its prediction of the prompt tokens the engine
holds as the header ``x-kvcompose-predicted-cached-tokens: N`` rather than in
the body, and a gateway the request's tenant as ``x-kvcompose-tenant: NAME``.
:class:`PredictionHeaderMiddleware`, an ASGI middleware that ``kvcompose
serve`` gives vLLM's server (``--middleware``), moves them into the JSON body
as ``kv_transfer_params: {"kvcompose": {"predicted_cached_tokens": N,
"tenant": NAME}}``, where the engine reads them
(kvcompose.instrumentation.receipts, kvcompose.instrumentation.tenants). A
value already in the body wins; a body that is not a JSON object, or whose
``kv_transfer_params`` is not one, is passed on unchanged. A prediction that
is not a decimal integer is passed as the string it is, so the engine counts
it invalid; a tenant is passed as the string it is (cut to
:data:`MAX_HEADER_VALUE` characters), for the engine's label rule
(kvcompose.wire.tenants). Requests without either header are not touched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvcompose.wire.routing import PARAMS_KEY, PREDICTED_HEADER, PREDICTED_KEY
from kvcompose.wire.tenants import TENANT_HEADER, TENANT_KEY

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

_INTEGER = re.compile(r"-?[0-9]{1,18}")
MAX_HEADER_VALUE = 256  # characters of a value passed on (an invalid one is counted, not read)


def predicted_value(header: bytes) -> int | str:
    """The header's value as the prediction: an int where it is a decimal integer, else the (cut) string."""
    text = header.decode("latin-1").strip()
    return int(text) if _INTEGER.fullmatch(text) else text[:MAX_HEADER_VALUE]


def tenant_header_value(header: bytes) -> str:
    """The header's value as the tenant: the (cut) string; the engine makes it a label or counts it invalid."""
    return header.decode("latin-1")[:MAX_HEADER_VALUE]


# Each header moved: the kvcompose entry's key it goes to, and how its value is read.
HEADERS: dict[bytes, tuple[str, Callable[[bytes], int | str]]] = {
    PREDICTED_HEADER.encode(): (PREDICTED_KEY, predicted_value),
    TENANT_HEADER.encode(): (TENANT_KEY, tenant_header_value),
}


def with_entries(body: bytes, values: dict[str, int | str]) -> bytes | None:
    """``body`` with ``values`` in its kv_transfer_params' kvcompose entry, where the body has none of its own;
    None where it stays as it is."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    params = document.get("kv_transfer_params")
    if params is None:
        document["kv_transfer_params"] = {PARAMS_KEY: dict(values)}
    elif not isinstance(params, dict):
        return None
    elif (entry := params.get(PARAMS_KEY)) is None:
        params[PARAMS_KEY] = dict(values)
    elif isinstance(entry, dict) and (missing := {key: value for key, value in values.items() if key not in entry}):
        entry.update(missing)
    else:  # the body's own values (or junk there) win
        return None
    try:
        return json.dumps(document).encode()
    except (ValueError, RecursionError):
        return None


class PredictionHeaderMiddleware:
    """Moves ``x-kvcompose-predicted-cached-tokens`` and ``x-kvcompose-tenant`` into the request's
    kv_transfer_params; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        values: dict[str, int | str] = {}
        if scope["type"] == "http" and scope.get("method") == "POST":
            for name, value in scope["headers"]:
                if (moved := HEADERS.get(name)) is not None:
                    key, read = moved
                    values.setdefault(key, read(value))
        if not values:
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
        rewritten = with_entries(body, values) if message is None else None
        if rewritten is not None:
            body = rewritten
            headers = [(name, value) for name, value in scope["headers"]
                       if name != b"content-length" and name not in HEADERS]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        pending = [{"type": "http.request", "body": body, "more_body": False}] if message is None else [
            {"type": "http.request", "body": body, "more_body": True}, message]

        async def replay() -> Any:
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay, send)
