"""Tenants under the OpenAI server, against vLLM's own per-request counts.

One disk tier (ExampleConnector); prefix caching is off (as for every test server), so a repeated prompt's
``usage.prompt_tokens_details.cached_tokens`` (vLLM's count, with ``--enable-prompt-tokens-details``) is
exactly what the tier loaded for it. Three tenants: one named by kvcompose serve's header, one in
``kv_transfer_params``, one by the LoRA adapter it asks for (a rank-8 adapter of random weights, written
here). Each tenant's loaded and prompt tokens must equal the sums of vLLM's counts over its requests; hostile
tenant values (a KB-long string, control characters) change no answer and add no series past top_k + 3.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.exposition import read
from kvcompose.testing.tiny_model import prompt_words
from kvcompose.wire.tenants import INVALID, MAX_TENANT_CHARS, NONE, OTHER

from .server_support import Server, start_server

pytestmark = pytest.mark.engine

TOP_K = 4
LORA = "adapter-t3"


def write_lora_adapter(model: Path, directory: Path, rank: int = 8) -> Path:
    """A PEFT LoRA adapter of random weights on the tiny model's q_proj and v_proj."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(3)
    weights = {}
    for layer in range(layers):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.1
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.1
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(outputs),
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": str(model), "task_type": "CAUSAL_LM"}))
    return directory


@pytest.fixture(scope="module")
def tenants_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tenants-serve")
    adapter = write_lora_adapter(tiny_model, root / "adapter")
    pipeline = {"version": 1, "name": "tenants", "tenants": {"top_k": TOP_K}, "children": [
        {"name": "disk", "connector": "ExampleConnector", "config": {"shared_storage_path": str(root / "disk")}}]}
    config = {"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
              "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}}
    server = start_server(tiny_model, json.dumps(config), root / "server.log", extra_args=[
        "--enable-prompt-tokens-details", "--middleware", "kvcompose.prediction_header.PredictionHeaderMiddleware",
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"{LORA}={adapter}"])
    yield server
    server.stop()


def _complete(server: Server, prompt: str, model: str | None = None, params: Any = None,
              headers: dict[str, str] | None = None) -> dict[str, Any]:
    fields = {"model": model} if model is not None else {}
    if params is not None:
        fields["kv_transfer_params"] = params
    return server.complete(prompt, max_tokens=6, headers=headers, **fields)


def _by_tenant(server: Server, name: str, **labels: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for sample in read(server.metrics()).series(name, **labels):
        found[sample.labels["tenant"]] = found.get(sample.labels["tenant"], 0.0) + sample.value
    return found


def _settled(server: Server, name: str, expected: dict[str, float], **labels: str) -> dict[str, float]:
    """The series by tenant once they reached ``expected`` (stats reach the front-end a step or so after the
    request), or as they are after 120 looks."""
    for _ in range(120):
        now = _by_tenant(server, name, **labels)
        if all(now.get(tenant, 0) >= value for tenant, value in expected.items()):
            return now
        time.sleep(0.5)
    return now


def test_each_tenants_tokens_equal_vllms_counts_of_its_requests(tenants_server: Server) -> None:
    server = tenants_server
    senders = {  # tenant -> how its requests name it
        "t1": {"headers": {"x-kvcompose-tenant": "t1"}},
        "t2": {"params": {"kvcompose": {"tenant": "t2"}}},
        LORA: {"model": LORA},
    }
    prompt_tokens: dict[str, int] = {}
    cached_tokens: dict[str, int] = {}
    for index, (tenant, how) in enumerate(senders.items()):
        prompt = prompt_words(seed=60 + index, length=200 + 60 * index)
        for _ in range(2):  # cold, then loaded from the tier
            response = _complete(server, prompt, **how)
            usage = response["usage"]
            prompt_tokens[tenant] = prompt_tokens.get(tenant, 0) + usage["prompt_tokens"]
            cached_tokens[tenant] = cached_tokens.get(tenant, 0) + usage["prompt_tokens_details"]["cached_tokens"]
    assert all(cached_tokens[tenant] > 0 for tenant in senders)

    loaded = _settled(server, "kvcompose_tenant_loaded_tokens_total", cached_tokens, connector="disk")
    for tenant in senders:
        assert loaded[tenant] == cached_tokens[tenant]
    prompts = _settled(server, "kvcompose_tenant_prompt_tokens_total", prompt_tokens)
    for tenant in senders:
        assert prompts[tenant] == prompt_tokens[tenant]
    metrics = read(server.metrics())
    assert sum(loaded.values()) == metrics.total("kvcompose_loaded_tokens_total", connector="disk")
    assert sum(prompts.values()) == read(server.metrics(), ("vllm:",)).total("vllm:prompt_tokens_total")
    saved = _by_tenant(server, "kvcompose_tenant_prefill_seconds_saved_total", connector="disk")
    assert sum(saved.values()) == pytest.approx(
        metrics.total("kvcompose_prefill_seconds_saved_total", connector="disk"), rel=1e-9)


def test_hostile_tenant_values_change_no_answer_and_add_no_series(tenants_server: Server) -> None:
    server = tenants_server
    prompt = prompt_words(seed=70, length=150)
    plain = _complete(server, prompt)["choices"][0]["text"]
    hostile = [*({"headers": {"x-kvcompose-tenant": "k" * 1024}} for _ in range(2)),
               {"params": {"kvcompose": {"tenant": "bad\x00\x1b[31mname"}}},
               {"params": {"kvcompose": {"tenant": {"nested": ["x"] * 100}}}},
               *({"headers": {"x-kvcompose-tenant": f"many-{index}"}} for index in range(12))]
    for how in hostile:
        assert _complete(server, prompt, **how)["choices"][0]["text"] == plain
    prompts = _settled(server, "kvcompose_tenant_prompt_tokens_total", {INVALID: 1})
    assert prompts[INVALID] > 0 and prompts[NONE] > 0
    labels = set(prompts) | set(_by_tenant(server, "kvcompose_tenant_loaded_tokens_total"))
    assert len(labels) <= TOP_K + 3 and OTHER in labels
    # The KB-long value, cut: the fourth heaviest tenant (two requests; each of the many, one), labelled.
    assert "k" * MAX_TENANT_CHARS in labels
    assert not any(len(label) > MAX_TENANT_CHARS or "\x00" in label for label in labels)
