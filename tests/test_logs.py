"""kvcompose's structured logs: JSON or console, trace ids inside spans, vLLM's logging untouched."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kvcompose.config import LoggingSection
from kvcompose.logs import CURRENT_CALL, ROOT_LOGGER, configure_logging, get_logger


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    get_logger("test")  # installs kvcompose's own handler
    root = logging.getLogger(ROOT_LOGGER)
    (handler,) = [h for h in root.handlers if type(h) is logging.StreamHandler]
    sink = io.StringIO()
    previous = handler.setStream(sink)
    yield sink
    handler.setStream(previous)
    configure_logging(LoggingSection())


def test_json_line_inside_a_traced_child_call_carries_trace_ids_and_child(captured: io.StringIO) -> None:
    configure_logging(LoggingSection(format="json", level="INFO"))
    CURRENT_CALL.ids = (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, "hot")
    try:
        get_logger("test").warning("child call failed", error_type="OSError", request_id="r1")
    finally:
        CURRENT_CALL.ids = None

    line = json.loads(captured.getvalue())
    assert line["event"] == "child call failed"
    assert line["level"] == "warning"
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert line["span_id"] == "00f067aa0ba902b7"
    assert line["connector"] == "hot"
    assert line["request_id"] == "r1"


def test_inside_an_embedders_span_its_ids(captured: io.StringIO) -> None:
    configure_logging(LoggingSection(format="json", level="INFO"))
    with TracerProvider().get_tracer("test").start_as_current_span("embedder") as span:
        get_logger("test").warning("child call failed")

    line = json.loads(captured.getvalue())
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_outside_a_span_no_ids_and_the_level_filters(captured: io.StringIO) -> None:
    configure_logging(LoggingSection(format="json", level="WARNING"))
    logger = get_logger("test")
    logger.info("dropped")
    logger.warning("kept", children=2)

    (line,) = [json.loads(text) for text in captured.getvalue().splitlines()]
    assert line["event"] == "kept"
    assert "trace_id" not in line


def test_console_format_and_vllm_logging_left_alone(captured: io.StringIO) -> None:
    vllm_logger = logging.getLogger("vllm")
    before = (list(logging.getLogger().handlers), list(vllm_logger.handlers), vllm_logger.level)
    configure_logging(LoggingSection(format="console", level="INFO"))
    get_logger("test").info("pipeline started", pipeline="p")

    assert "pipeline started" in captured.getvalue() and "pipeline=p" in captured.getvalue()
    assert (list(logging.getLogger().handlers), list(vllm_logger.handlers), vllm_logger.level) == before
    assert logging.getLogger(ROOT_LOGGER).propagate is False
