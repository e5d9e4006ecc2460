"""The shared-trace middleware kvcompose serve --trace gives vLLM's server, on ASGI scopes as Starlette passes them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvcompose.shared_trace import ROOT_SAMPLE_RATIO_ENV, SharedTraceMiddleware
from kvcompose.tracing.records import parse_traceparent
from kvcompose.tracing.sampling import sampling_for


def _through(middleware: SharedTraceMiddleware, headers: list[tuple[bytes, bytes]],
             kind: str = "http") -> list[tuple[bytes, bytes]]:
    """The headers the app behind the middleware sees."""
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["headers"])

    middleware.app = app
    asyncio.run(middleware({"type": kind, "headers": headers}, None, None))  # type: ignore[arg-type]
    return seen[0]


def _traceparent(headers: list[tuple[bytes, bytes]]) -> tuple[int, int, bool]:
    [value] = [value for name, value in headers if name == b"traceparent"]
    parsed = parse_traceparent(value.decode())
    assert parsed is not None, value
    return parsed


def test_a_callers_traceparent_is_kept_and_others_get_a_new_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROOT_SAMPLE_RATIO_ENV, raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    middleware = SharedTraceMiddleware(None)  # type: ignore[arg-type]
    callers = [(b"traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-00"), (b"accept", b"*/*")]
    assert _through(middleware, callers) == callers
    lifespan = [(b"accept", b"*/*")]
    assert _through(middleware, lifespan, kind="lifespan") == lifespan  # only HTTP requests are traced
    traces = {_traceparent(_through(middleware, [(b"accept", b"*/*")])) for _ in range(50)}
    assert len({trace_id for trace_id, _, _ in traces}) == 50  # a trace of its own each
    assert all(sampled for _, _, sampled in traces)  # every request is traced by default, as kvcompose does


@pytest.mark.parametrize("ratio", [0.0, 0.25, 1.0])
def test_the_sampled_flag_is_kvcomposes_own_decision_for_the_trace(monkeypatch: pytest.MonkeyPatch,
                                                                    ratio: float) -> None:
    """vLLM follows the flag; kvcompose, seeing a caller, follows it too, and would have decided alike."""
    monkeypatch.setenv(ROOT_SAMPLE_RATIO_ENV, repr(ratio))
    middleware, engine = SharedTraceMiddleware(None), sampling_for(ratio)  # type: ignore[arg-type]
    traces = [_traceparent(_through(middleware, [])) for _ in range(400)]
    assert all(sampled == engine.sampled(trace_id, None) for trace_id, _, sampled in traces)
    share = sum(sampled for _, _, sampled in traces) / len(traces)
    assert share == pytest.approx(ratio, abs=0.1)
