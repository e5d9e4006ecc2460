"""vLLM's LMCacheConnectorV1 as a kvcompose child on the CPU engine (`make test-lmcache` only).

Needs the optional LMCache venv (scripts/ensure-lmcache-venv.sh) and the
test-only CPU copy shim in this directory: stock LMCache 0.5.6 has no CPU
connector and would never cache here. One in-process engine (scheduler and
worker in this process, so LMCache's hashes agree and the spans and metrics
are readable here) runs ``[lmcache, disk]``; a repeated ~300-word prompt is
served from LMCache with a plain engine's tokens.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvcompose.metrics.summary import summarize
from kvcompose.testing.tiny_model import prompt_words
from kvcompose import names as attr

from ..engine_support import generate, in_process_llm
from .cpu_copy_connector import install_on_import

pytestmark = pytest.mark.engine

LMCACHE_ENV = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "64", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5"}
PROMPT = prompt_words(seed=41, length=300)


class LMCacheEngine:
    def __init__(self, llm: Any, disk: Path, spans: InMemorySpanExporter) -> None:
        self.llm, self.disk, self.spans = llm, disk, spans

    def transfers(self) -> list[tuple[str, str, str]]:
        """(child, direction, outcome) of each transfer span, named ``kvcompose.transfer <direction> <child>``."""
        spans = [span for span in self.spans.get_finished_spans() if span.name.startswith(f"{attr.TRANSFER_SPAN} ")]
        for span in spans:
            assert span.name == f"{attr.TRANSFER_SPAN} {span.attributes[attr.TRANSFER_DIRECTION]} " \
                                f"{span.attributes[attr.CONNECTOR_NAME]}"
        return sorted((span.attributes[attr.CONNECTOR_NAME], span.attributes[attr.TRANSFER_DIRECTION],
                       span.attributes[attr.TRANSFER_OUTCOME]) for span in spans)

    def lookups(self) -> dict[str, dict[str, float]]:
        from prometheus_client import generate_latest

        return {child: dict(row.lookups) for child, row in summarize(generate_latest().decode()).items()}


@pytest.fixture(scope="session")
def lmcache_installed() -> None:
    """Fails before any engine starts; finds LMCache without importing it (that must wait for LLM(), see the shim)."""
    if importlib.util.find_spec("lmcache") is None:
        pytest.fail("lmcache is not installed: run this test through `make test-lmcache`")


@pytest.fixture(scope="module")
def lmcache_engine(lmcache_installed: None, tiny_model: Path, plain_llm: Any,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheEngine]:
    """``[lmcache, disk]`` under one in-process engine; started after ``plain_llm`` so no engine inherits LMCache."""
    disk = tmp_path_factory.mktemp("lmcache") / "disk"
    pipeline = {"version": 1, "name": "lmcache-then-disk", "tracing": {"enabled": True}, "children": [
        {"name": "lmcache", "connector": "LMCacheConnectorV1"},
        {"name": "disk", "connector": "ExampleConnector", "config": {"shared_storage_path": str(disk)}},
    ]}
    install_on_import()
    try:
        with in_process_llm(tiny_model, pipeline, LMCACHE_ENV) as (llm, spans):
            yield LMCacheEngine(llm, disk, spans)
    finally:
        _destroy_lmcache_engine()


def _destroy_lmcache_engine() -> None:
    """vLLM 0.32's LMCacheConnectorV1 has no shutdown(); LMCache's event-loop thread would keep pytest alive."""
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(ENGINE_NAME)


def test_a_repeated_prompt_is_served_from_lmcache_with_the_plain_tokens(lmcache_engine: LMCacheEngine,
                                                                        plain_llm: Any) -> None:
    baseline = generate(plain_llm, [PROMPT])[0][0]
    num_tokens = len(lmcache_engine.llm.get_tokenizer().encode(PROMPT))

    tokens, cached = generate(lmcache_engine.llm, [PROMPT])[0]
    assert tokens == baseline and cached == 0
    assert any(lmcache_engine.disk.rglob("*.safetensors"))  # the disk child saved too

    tokens, cached = generate(lmcache_engine.llm, [PROMPT])[0]
    assert tokens == baseline
    assert 0 < cached < num_tokens

    lookups = lmcache_engine.lookups()
    assert lookups["lmcache"]["hit"] == 1 and lookups["lmcache"]["miss"] == 1
    assert lookups["disk"]["hit"] == 1  # asked too (MultiConnector asks every child), not chosen to load

    transfers = lmcache_engine.transfers()
    assert ("lmcache", "load", "ok") in transfers
    assert ("lmcache", "save", "ok") in transfers
    assert not [t for t in transfers if t[0] == "disk" and t[1] == "load"]  # first match: lmcache loaded
