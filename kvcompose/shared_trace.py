"""One trace per request under ``kvcompose serve --trace``, whether the caller sent a traceparent or not.

vLLM roots its ``llm_request`` span in the trace a request's W3C
``traceparent`` header names, and hands the header to the engine, where
kvcompose's spans join the same trace. A request that arrives without one
makes two unrelated traces: vLLM starts one in the API server when the request
ends, kvcompose another in the engine when the request is first looked up.

:class:`SharedTraceMiddleware`, an ASGI middleware that ``kvcompose serve
--trace`` gives vLLM's server (``--middleware``), adds a traceparent to a
request that has none: a new trace id, sampled by kvcompose's own rule for
requests without a caller (the pipeline's ``tracing.sample_ratio``, else the
``OTEL_TRACES_SAMPLER`` variables), so that vLLM and kvcompose trace the same
requests. Both sides' root spans then name as parent a span nobody exported
(the caller this header stands for); trace viewers show them as the trace's
roots.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvcompose.tracing.records import IDS
from kvcompose.tracing.sampling import sampling_for

# Set by kvcompose serve from the pipeline's tracing.sample_ratio, for the API server process to read.
ROOT_SAMPLE_RATIO_ENV = "KVCOMPOSE_ROOT_SAMPLE_RATIO"
TRACEPARENT = b"traceparent"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class SharedTraceMiddleware:
    """Adds a sampled (or not) ``traceparent`` to HTTP requests that carry none; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        ratio = os.environ.get(ROOT_SAMPLE_RATIO_ENV)
        self._sampling = sampling_for(float(ratio) if ratio else None)

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http" and not any(name == TRACEPARENT for name, _ in scope["headers"]):
            scope = {**scope, "headers": [*scope["headers"], (TRACEPARENT, self.traceparent())]}
        await self.app(scope, receive, send)

    def traceparent(self) -> bytes:
        """A new trace's W3C traceparent, its sampled flag set as kvcompose samples a request without a caller."""
        trace_id = IDS.trace_id()
        flags = "01" if self._sampling.sampled(trace_id, None) else "00"
        return f"00-{trace_id:032x}-{IDS.span_id():016x}-{flags}".encode()
