"""Starting real vLLM engines on the CPU for end-to-end tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 512,
    "enable_prefix_caching": False,  # repeated prompts must reach the connector
    "seed": 0,
}


def example_tiers(name: str, stores: dict[str, Path]) -> dict[str, Any]:
    """A pipeline of ExampleConnector children, one per named store directory, in order."""
    return {
        "version": 1, "name": name,
        "children": [
            {"name": child, "connector": "ExampleConnector", "config": {"shared_storage_path": str(path)}}
            for child, path in stores.items()
        ],
    }


def start_llm(model: Path, kv_transfer_config: dict[str, Any] | None = None, **overrides: Any) -> Any:
    os.environ.update(ENGINE_ENV)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = {**ENGINE_ARGS, **overrides}
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    return LLM(model=str(model), **args)


@contextmanager
def in_process_llm(model: Path, pipeline: dict[str, Any], env: dict[str, str] | None = None) -> Iterator[Any]:
    """An engine running ``pipeline`` with scheduler and worker in this process (their state readable
    by the test), under ``env``; yields the engine and an in-memory exporter of every pipeline's spans."""
    import vllm.envs
    from kvcompose.config import load_pipeline
    from kvcompose.render import kv_transfer_config
    from kvcompose.tracing import set_span_exporter

    from .span_support import FlushedSpans

    spans = FlushedSpans()
    set_span_exporter(spans)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {**(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
                patch.setenv(name, value)
            vllm.envs.disable_envs_cache()  # an in-process engine caches every VLLM_* variable
            llm = start_llm(model, kv_transfer_config(load_pipeline(pipeline), pipeline), disable_log_stats=False)
            try:
                yield llm, spans
            finally:
                llm.llm_engine.engine_core.shutdown()
    finally:
        set_span_exporter(None)
        vllm.envs.disable_envs_cache()


def greedy(max_tokens: int = 8) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: Any, prompts: list[str], max_tokens: int = 8) -> list[tuple[list[int], int]]:
    """Token ids and the number of prompt tokens served from cache, per prompt; then the engine goes idle
    (:func:`run_to_idle`)."""
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    run_to_idle(llm)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outputs]


def run_to_idle(llm: Any) -> None:
    """Run, and record the stats of, the engine's step after its last requests finished (no forward pass: it
    tells the workers which requests finished, and kvcompose sends the tables it held, up to a second's).
    ``vllm serve``'s front-end reads each step's output as it comes; an offline ``LLM`` only when called, and
    an engine core in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) runs that step only then."""
    engine = llm.llm_engine
    in_process = getattr(engine.engine_core, "engine_core", None)
    if in_process is not None:
        if in_process.scheduler.has_requests():
            engine.step()
    elif engine.log_stats:  # the idle step's output carries its stats (none are sent without log_stats)
        engine.step()


def in_process_connectors(llm: Any) -> tuple[Any, Any]:
    """The scheduler's and the worker's KV connector of an engine running in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group()
