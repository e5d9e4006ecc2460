"""`vllm serve` with vLLM's tracing and kvcompose's on: one caller's trace shows every child call."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest

from kvcompose.testing.otlp_receiver import ReceivedSpan
from kvcompose.testing.tiny_model import prompt_words

pytestmark = pytest.mark.engine

KVCOMPOSE_KEYS = ("kvcompose.", "gen_ai.request.id", "error.type")


def _wait_for(receiver: Any, trace_id: str, done: Any, seconds: float = 90) -> list[ReceivedSpan]:
    deadline = time.monotonic() + seconds
    while True:
        spans = [span for span in receiver.spans() if span.trace_id == trace_id]
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def _calls(spans: list[ReceivedSpan], name: str) -> list[str]:
    return sorted(span.attributes["kvcompose.connector.name"] for span in spans if span.name == name)


def test_completion_with_traceparent_yields_kvcompose_spans_in_that_trace(
    served_pipeline: Any, otlp_receiver: Any
) -> None:
    trace_id = secrets.token_hex(16)
    prompt = prompt_words(seed=11, length=96)
    for _ in range(2):  # the first is saved to both tiers, the repeat is loaded from "hot"
        served_pipeline.complete(prompt, headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = [span.name for span in spans]
        return ("llm_request" in names and names.count("kvcompose.request") == 2
                and names.count("kvcompose.transfer load hot") == 1
                and names.count("kvcompose.transfer save hot") == names.count("kvcompose.transfer save cold") == 2)

    spans = _wait_for(otlp_receiver, trace_id, complete)
    kvcompose = [span for span in spans if span.name.startswith("kvcompose.")]
    assert complete(spans), sorted((span.service, span.name) for span in spans)

    # MultiConnector's rule asks every child, and loads from the first that has tokens.
    assert _calls(kvcompose, "kvcompose.lookup") == ["cold", "cold", "hot", "hot"]
    requests = [span for span in kvcompose if span.name == "kvcompose.request"]
    (loaded,) = [r for r in requests if r.attributes.get("kvcompose.load.connector") == "hot"]
    assert loaded.attributes["kvcompose.tokens.loaded"] > 0
    assert loaded.attributes["kvcompose.tier.hot.load_bytes"] > 0  # the worker's summary reached the scheduler

    # Worker-side spans hang under the scheduler's request spans; those under the caller's spans.
    request_ids = {span.span_id for span in requests}
    transfers = [span for span in kvcompose if span.name.startswith("kvcompose.transfer ")]
    assert {span.parent_span_id for span in transfers} <= request_ids
    assert all(span.parent_span_id not in ("", *request_ids) for span in requests)
    assert {span.service for span in kvcompose} == {"kvcompose"}
    assert len({span.span_id for span in spans}) == len(spans)

    # Ids, counts and timings only: no attribute outside kvcompose's keys, no prompt word in any value.
    for span in kvcompose:
        assert all(key.startswith(KVCOMPOSE_KEYS) for key in span.attributes), span.attributes
        assert not any(str(value) in prompt.split() for value in span.attributes.values()), span.attributes
