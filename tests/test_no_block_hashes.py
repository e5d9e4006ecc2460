"""No block hash leaves kvcompose: not in its logs, its spans or its metrics.

vLLM hands every connector a request's chained block hashes (``Request.block_hashes``: the hash of a block
stands for its whole prefix), and kvcompose's economics sampler reads them. On a real in-process engine with
metrics (so the sampler) and tracing on, every request traced at step granularity, and kvcompose's logs at
DEBUG, a child records the hashes vLLM gave it; the test then looks for each hash, written in any form a
hash could take, in every log line, span and Prometheus sample kvcompose produced.
"""

from __future__ import annotations

import base64
import logging
import time
from logging.handlers import BufferingHandler
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import LoggingSection
from kvcompose.logs import ROOT_LOGGER, configure_logging
from kvcompose.testing import recording
from kvcompose.testing.recording import RecordingConnector
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import generate, in_process_llm

pytestmark = pytest.mark.engine

LOG = "block-hashes"
PROMPTS = [prompt_words(seed=90 + index, length=300) for index in range(3)]  # two full blocks each


class HashRecordingConnector(RecordingConnector):
    """A RecordingConnector that also logs the block hashes of every request it is asked about."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.log.append(("block_hashes", list(request.block_hashes)))
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def written_forms(block_hash: bytes) -> set[str]:
    """The ways a hash, or the 64-bit key the sampler reads from its first eight bytes, could be written:
    hex, decimal (either byte order, and the key as a signed 64-bit integer), repr, base64."""
    key = int.from_bytes(block_hash[:8], "big")
    forms = {block_hash[:8].hex(), format(key, "x"), repr(block_hash[:8])[2:-1],
             base64.b64encode(block_hash).decode()[:12]}
    forms |= {str(value) for value in (key, key - (1 << 64), int.from_bytes(block_hash[:8], "little"),
                                       int.from_bytes(block_hash, "big"), int.from_bytes(block_hash, "little"))}
    return forms


@pytest.fixture(scope="module")
def emitted(tiny_model: Path) -> Iterator[tuple[list[bytes], dict[str, str]]]:
    """The hashes vLLM gave the recording child, and what kvcompose emitted: logs, spans, /metrics."""
    from prometheus_client import REGISTRY, generate_latest

    recording.CALL_LOGS.pop(LOG, None)
    pipeline = {
        "version": 1, "name": "hashes", "logging": {"level": "DEBUG", "format": "json"},
        "tracing": {"enabled": True, "granularity": "step", "sample_ratio": 1.0},
        # The offload tier first: a loader of unknown size (the recorder) before it would leave its reach, and
        # so its write waste, unknown. The recorder is asked every request's first lookup, when the tier
        # holds nothing of it yet.
        "children": [
            {"name": "offload", "connector": "OffloadingConnector", "config": {
                "spec_name": "CPUEngineOffloadingSpec", "spec_module_path": "kvcompose.offload.spec",
                "cpu_bytes_to_use": 64 << 20}},
            {"name": "recorder", "connector": "HashRecordingConnector", "module_path": __name__,
             "config": {"log": LOG}},
        ]}
    lines = BufferingHandler(capacity=1 << 20)  # keeps every record kvcompose logs
    logging.getLogger(ROOT_LOGGER).addHandler(lines)
    try:
        with in_process_llm(tiny_model, pipeline) as (llm, spans):
            for _ in range(2):  # saved to the offload tier, then loaded from it
                generate(llm, PROMPTS)
                time.sleep(1.0)  # the stores end after the requests' steps
            # The curve reaches the front-end with the stats of a step at least a second after the last report.
            deadline = time.monotonic() + 30
            while b"kvcompose_write_waste_ratio{" not in generate_latest(REGISTRY):
                assert time.monotonic() < deadline, "the economics never reached /metrics"
                time.sleep(1.2)
                generate(llm, [PROMPTS[0]])
            outputs = {"logs": "\n".join(record.getMessage() for record in lines.buffer),
                       "metrics": generate_latest(REGISTRY).decode(),
                       "spans": "\n".join(span.to_json() for span in spans.get_finished_spans())}
    finally:
        logging.getLogger(ROOT_LOGGER).removeHandler(lines)
        configure_logging(LoggingSection())
    hashes = [block_hash for entry in recording.CALL_LOGS.pop(LOG) if entry[0] == "block_hashes"
              for block_hash in entry[1]]
    yield hashes, outputs


def test_no_block_hash_appears_in_any_log_span_or_metric(emitted: tuple[list[bytes], dict[str, str]]) -> None:
    hashes, outputs = emitted
    assert len(set(hashes)) >= 2 * len(PROMPTS) and all(isinstance(h, bytes) for h in hashes)
    # What was searched holds what it should: DEBUG lines, the requests' spans, the economics series.
    assert '"event": "offload copy"' in outputs["logs"]
    assert "kvcompose.request" in outputs["spans"] and '"kvcompose.connector.name": "recorder"' in outputs["spans"]
    assert "kvcompose_cache_size_hit_ratio{" in outputs["metrics"]
    assert 'kvcompose_prefill_seconds_saved_total{' in outputs["metrics"]
    found = [(where, form) for block_hash in set(hashes) for form in written_forms(block_hash)
             for where, text in outputs.items() if form.lower() in text.lower()]
    assert not found, found


def test_the_search_finds_a_hash_where_one_is_written() -> None:
    """The forms the test looks for match a hash written by the usual means."""
    block_hash = bytes(range(200, 232))
    for written in (block_hash.hex(), str(block_hash), repr(list([block_hash])),
                    str(int.from_bytes(block_hash[:8], "big")), hex(int.from_bytes(block_hash[:8], "big")),
                    base64.b64encode(block_hash).decode()):
        assert any(form.lower() in written.lower() for form in written_forms(block_hash)), written
