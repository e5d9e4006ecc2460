"""Shared fixtures: the tiny local model and base vLLM configs, built once."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# tests/lmcache needs the optional LMCache venv: only `make test-lmcache` (which sets this) collects it.
collect_ignore = [] if os.environ.get("KVCOMPOSE_TEST_LMCACHE") else ["lmcache"]

# Keep vLLM quiet and off the network in every test process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from kvcompose.testing.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def base_vllm_config(tiny_model: Path) -> Any:
    """A real VllmConfig for the tiny model, with a connector so HMA is off."""
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), dtype="float32", max_model_len=512),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config={}
        ),
    )


@pytest.fixture(scope="session")
def vllm_config_with(base_vllm_config: Any) -> Callable[[dict[str, Any]], Any]:
    """Build a VllmConfig whose kv_transfer_config is the given mapping."""
    from vllm.config import KVTransferConfig

    def build(kv_transfer: dict[str, Any]) -> Any:
        config = copy.copy(base_vllm_config)
        config.kv_transfer_config = KVTransferConfig(**kv_transfer)
        return config

    return build


@pytest.fixture(scope="session")
def plain_llm(tiny_model: Path) -> Any:
    """An engine without any connector: the reference output. Its engine core runs in a process of
    its own whatever the test that first asks for it set: an in-process engine's shutdown tears down
    vLLM's parallel state in this process, which an in-process reference engine would need."""
    import vllm.envs

    from .engine_support import start_llm

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        vllm.envs.disable_envs_cache()
        llm = start_llm(tiny_model)
    vllm.envs.disable_envs_cache()
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def tables_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Composites send kvcompose's tables in every step's stats (an engine's send them once a second, and as it
    goes idle): for tests that read the stats a step at a time."""
    from kvcompose.instrumentation import scheduler

    monkeypatch.setattr(scheduler, "TABLES_EVERY_S", 0.0)


@pytest.fixture
def exporter() -> Any:
    """Every pipeline's spans in this process, exported in-process to memory for the test."""
    from kvcompose.tracing import set_span_exporter

    from .span_support import FlushedSpans

    exporter = FlushedSpans()
    set_span_exporter(exporter)
    yield exporter
    set_span_exporter(None)


@pytest.fixture(scope="session")
def otlp_receiver() -> Any:
    """Receives the OTLP/HTTP spans of every server the tests start."""
    from kvcompose.testing.otlp_receiver import SpanReceiver

    receiver = SpanReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def served_pipeline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, otlp_receiver: Any) -> Any:
    """`vllm serve` with examples/observability/pipeline.yaml (examples/pipeline.yaml
    with tracing on), its two stores under a temp dir, vLLM's and kvcompose's
    spans sent to ``otlp_receiver``.

    The --kv-transfer-config is exactly what `kvcompose render` prints.
    """
    import subprocess
    import sys

    from .server_support import start_server

    root = tmp_path_factory.mktemp("served")
    env = {"KVCOMPOSE_HOT": str(root / "hot"), "KVCOMPOSE_COLD": str(root / "cold"),
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_receiver.endpoint,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    pipeline = Path(__file__).resolve().parents[1] / "examples" / "observability" / "pipeline.yaml"
    rendered = subprocess.run([sys.executable, "-m", "kvcompose", "render", str(pipeline)],
                              capture_output=True, text=True, check=True).stdout.strip()
    server = start_server(tiny_model, rendered, root / "server.log", env=env,
                          extra_args=["--otlp-traces-endpoint", otlp_receiver.endpoint])
    server.stores = {"hot": root / "hot", "cold": root / "cold"}  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prometheus(served_pipeline: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The URL of one real Prometheus server scraping ``served_pipeline`` every second, for the session."""
    from .prometheus_support import start_prometheus

    server = start_prometheus(served_pipeline.url, tmp_path_factory.mktemp("prometheus"))
    yield server.url
    server.stop()
