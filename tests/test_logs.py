"""kvcompose's structured logs: JSON or console, trace ids inside spans, vLLM's logging untouched."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kvcompose.config import LoggingSection
from kvcompose.logs import ROOT_LOGGER, configure_logging, get_logger
from kvcompose.tracing.attributes import CONNECTOR_NAME


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


def test_json_line_inside_a_child_span_carries_trace_ids_and_child(captured: io.StringIO) -> None:
    configure_logging(LoggingSection(format="json", level="INFO"))
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("kvcompose.lookup", attributes={CONNECTOR_NAME: "hot"}) as span:
        get_logger("test").warning("child call failed", error_type="OSError", request_id="r1")

    line = json.loads(captured.getvalue())
    context = span.get_span_context()
    assert line["event"] == "child call failed"
    assert line["level"] == "warning"
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")
    assert line["connector"] == "hot"
    assert line["request_id"] == "r1"


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
