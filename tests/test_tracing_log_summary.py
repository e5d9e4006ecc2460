"""The request span's summary, logged at DEBUG as ``request transfers``, on a real in-process engine.

The log line carries the request span's trace and span ids and the same figures as its attributes: who
loaded it, how many tokens, and per child and direction the lifetime, copy time and bytes of its transfers.
No prompt text, token id or block hash.
"""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest

from kvcompose.config import LoggingSection
from kvcompose.logs import ROOT_LOGGER, configure_logging, get_logger
from kvcompose.testing.tiny_model import prompt_words
from kvcompose import names as attr
from kvcompose.tracing.pipeline import SUMMARY_FIELDS, summary_key

from .engine_support import generate, in_process_llm

pytestmark = pytest.mark.engine

WORD = re.compile(r"\bw\d+\b")  # the tiny model's vocabulary: any prompt word or token text


def test_the_request_summary_is_logged_at_debug_with_the_request_spans_ids_and_figures(
    tiny_model: Path, tmp_path: Path,
) -> None:
    pipeline = {"version": 1, "name": "summarized", "tracing": {"enabled": True, "granularity": "request"},
                "logging": {"level": "DEBUG", "format": "json"}, "children": [
                    {"name": "disk", "connector": "ExampleConnector",
                     "config": {"shared_storage_path": str(tmp_path / "disk")}}]}
    get_logger("test")  # installs kvcompose's own handler
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    logging.getLogger(ROOT_LOGGER).addHandler(handler)
    prompt = prompt_words(seed=81, length=300)
    try:
        with in_process_llm(tiny_model, pipeline) as (llm, spans):
            generate(llm, [prompt])  # stored
            _, cached = generate(llm, [prompt])[0]  # loaded
            assert cached > 0
            request_spans = [span for span in spans.get_finished_spans() if span.name == "kvcompose.request"]
    finally:
        logging.getLogger(ROOT_LOGGER).removeHandler(handler)
        configure_logging(LoggingSection())

    lines = [json.loads(line) for line in sink.getvalue().splitlines() if line.startswith("{")]
    summaries = {line["span_id"]: line for line in lines if line.get("event") == "request transfers"}
    assert len(request_spans) == 2 and len(summaries) == 2
    for span in request_spans:
        line = summaries[format(span.context.span_id, "016x")]
        assert line["trace_id"] == format(span.context.trace_id, "032x") and line["level"] == "debug"
        assert line["loaded_by"] == span.attributes.get(attr.LOADED_BY)
        assert line["loaded_tokens"] == span.attributes.get(attr.LOADED_TOKENS)
        figures = {summary_key(*tier.split("."), name): value
                   for tier, by_name in line["transfers"].items() for name, value in by_name.items()}
        assert set(line["transfers"]["disk.save"]) == set(SUMMARY_FIELDS)
        assert figures == {key: value for key, value in span.attributes.items() if key.startswith("kvcompose.tier.")}
    loaded = [line for line in summaries.values() if line["loaded_by"] == "disk"]
    assert len(loaded) == 1 and loaded[0]["loaded_tokens"] == cached
    assert loaded[0]["transfers"]["disk.load"]["bytes"] > 0 and loaded[0]["transfers"]["disk.load"]["lifetime_s"] > 0
    for line in sink.getvalue().splitlines():  # nothing of the prompt, in any kvcompose line
        assert not WORD.search(line), line
    assert prompt.split()[0] not in sink.getvalue()
