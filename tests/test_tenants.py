"""Tenants: the label rule, the heavy-hitter sketch, and an exact simulation through the real composite.

The simulation drives the scheduler side of a real KVComposeConnector (one RecordingConnector tier that
loads what its script says) with real vLLM requests of 200 tenants, Zipf-distributed, over prompts that
share system prefixes and each tenant's own documents; its stats go through the front-end's real
``build_prom_metrics``. The oracle is an exact LRU stack over the same block stream, written here, each
hit attributed to the tenant that referenced the block.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcompose.heavy_hitters import HeavyHitters
from kvcompose.testing import recording
from kvcompose.wire.tenants import (
    INVALID,
    MAX_TENANT_CHARS,
    NONE,
    OTHER,
    TenantReport,
    tenant_label,
    tenant_value,
)

from .connector_support import COMPOSITE, RECORDING, make_blocks, scheduler_output

TENANTS = 200
TOP_K = 20
REQUESTS = 12_000
GPU_BLOCKS = 400
MAX_MEAN_ABSOLUTE_ERROR = 0.03


@pytest.mark.parametrize(("value", "label"), [
    ("acme", "acme"), ("  team-7/prod@eu  ", "team-7/prod@eu"), ("ünï cödé", "_n__c_d_"), (None, NONE),
    ("x" * 1024, "x" * MAX_TENANT_CHARS), ("a\x00b", INVALID), ("line\nbreak", INVALID), ("\x9b", INVALID),
    ("", INVALID), ("   ", INVALID), (42, INVALID), (["a"], INVALID), ("other", INVALID), ("none", INVALID),
])
def test_a_tenant_value_becomes_a_label_by_one_rule(value: Any, label: str) -> None:
    assert tenant_label(value) == label


def test_the_tenant_comes_from_kv_transfer_params_else_the_lora_name_and_never_the_salt() -> None:
    assert tenant_value({"kvcompose": {"tenant": "acme"}}, "adapter") == "acme"
    assert tenant_value({"kvcompose": {"predicted_cached_tokens": 3}}, "adapter") == "adapter"
    assert tenant_value({"kvcompose": "junk"}, None) is None
    assert tenant_value({"kvcompose": {"tenant": 7}}, "adapter") == 7  # there, but invalid: not the adapter
    assert tenant_value({"cache_salt": "secret"}, None) is None


def test_the_sketch_finds_the_heavy_tenants_among_100000_one_off_ones_in_bounded_memory() -> None:
    sketch = HeavyHitters(capacity=320, half_life_s=None)
    rng = np.random.default_rng(5)
    # Prompt tokens per request, by tenant: each heavy tenant has over 1% of the stream, a one-off 0.0003%.
    heavy = {f"heavy-{i}": 1000 - 30 * i for i in range(TOP_K)}
    names = list(heavy)
    totals = dict.fromkeys(names, 0)
    for one_off in range(100_000):
        sketch.add(f"one-off-{one_off}", int(rng.integers(50, 500)))
        if one_off % 5 == 0:
            name = names[one_off // 5 % TOP_K]
            sketch.add(name, heavy[name])
            totals[name] += heavy[name]
        assert len(sketch) <= 320
    assert sketch.top(TOP_K) == sorted(totals, key=totals.get, reverse=True)
    for name in names:  # a counter never under-states, and over-states by at most its error
        count, error = sketch.weight(name)
        assert count - error <= totals[name] <= count


def test_a_growing_tenant_enters_the_top_and_a_fading_one_leaves_within_a_few_half_lives() -> None:
    clock = [0.0]
    sketch = HeavyHitters(capacity=16, half_life_s=60.0, clock=lambda: clock[0])
    for second in range(600):
        clock[0] = float(second)
        sketch.add("old", 100 if second < 300 else 1)
        sketch.add("steady", 30)
        sketch.add("new", 1 if second < 300 else 100)
        if second == 299:
            assert sketch.top(2) == ["old", "steady"]
    assert sketch.top(2) == ["new", "steady"]


def test_merged_tenant_reports_add_counts_and_keep_the_latest_levels() -> None:
    first = TenantReport(prompt_tokens={"a": 10}, loaded_tokens={"a": {"disk": 4}}, labelled=["a"])
    later = TenantReport(prompt_tokens={"a": 5, OTHER: 1}, loaded_tokens={"a": {"disk": 1}}, labelled=["a", "b"],
                         curves={"a": [[16, 0.5]]})
    first.add(later)
    assert first.to_dict() == {"prompt_tokens": {"a": 15, OTHER: 1}, "loaded_tokens": {"a": {"disk": 5}},
                               "labelled": ["a", "b"], "curves": {"a": [[16, 0.5]]}}
    assert TenantReport.from_payload(first.to_dict()) == first


# ---- the exact simulation ----------------------------------------------------------------------------------


def _workload(block: int, seed: int = 7) -> list[tuple[str, list[int]]]:
    """(tenant, prompt tokens) per request: Zipf over tenants; a prompt is one of 8 shared system prefixes
    (Zipf), one of its tenant's 3 documents (Zipf) and a question of its own."""
    rng = np.random.default_rng(seed)
    fresh = iter(range(1, 1 << 30))

    def tokens(blocks: int) -> list[int]:
        return [next(fresh) for _ in range(blocks * block)]

    systems = [tokens(4) for _ in range(8)]
    documents = [[tokens(int(rng.integers(2, 6))) for _ in range(3)] for _ in range(TENANTS)]
    tenant_weights = 1.0 / np.arange(1, TENANTS + 1) ** 1.1
    tenant_of = rng.choice(TENANTS, size=REQUESTS, p=tenant_weights / tenant_weights.sum())
    system_weights = 1.0 / np.arange(1, 9)
    system_of = rng.choice(8, size=REQUESTS, p=system_weights / system_weights.sum())
    document_of = rng.choice(3, size=REQUESTS, p=[0.6, 0.3, 0.1])
    return [(f"tenant-{tenant:03d}", systems[system] + documents[tenant][document] + tokens(1) + [0] * 7)
            for tenant, system, document in zip(tenant_of, system_of, document_of, strict=True)]


def exact_lru_by_tenant(stream: list[tuple[str, list[int]]], sizes: list[int]) -> dict[str, list[float]]:
    """Each tenant's exact LRU hit ratio at each size over the stream of block keys (each request's tail
    first), from exact reuse distances (distinct keys since the last reference, by a Fenwick tree)."""
    last: dict[int, int] = {}
    total = sum(len(keys) for _, keys in stream)
    tree = [0] * (total + 1)

    def add(position: int, delta: int) -> None:
        position += 1
        while position <= total:
            tree[position] += delta
            position += position & -position

    def prefix(position: int) -> int:  # markers at positions < position
        found = 0
        while position > 0:
            found += tree[position]
            position -= position & -position
        return found

    hits: dict[str, list[int]] = {}
    references: dict[str, int] = {}
    now = 0
    for tenant, keys in stream:
        counts = hits.setdefault(tenant, [0] * len(sizes))
        references[tenant] = references.get(tenant, 0) + len(keys)
        for key in reversed(keys):
            if (previous := last.get(key)) is not None:
                distance = prefix(now) - prefix(previous + 1)
                for index, size in enumerate(sizes):
                    if distance < size:
                        counts[index] += 1
                add(previous, -1)
            add(now, 1)
            last[key] = now
            now += 1
    return {tenant: [hit / references[tenant] for hit in counts] for tenant, counts in hits.items()}


def _prometheus(config: Any) -> tuple[Any, Callable[[], str]]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest

    from kvcompose.connectors import KVComposeConnector

    registry = CollectorRegistry()
    metric_types: dict[type, Any] = {kind: functools.partial(kind, registry=registry)
                                     for kind in (Counter, Gauge, Histogram)}
    prom = KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})
    return prom, lambda: generate_latest(registry).decode()


def _by_label(exposition: Any, name: str, label: str, **labels: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for sample in exposition.series(name, **labels):
        found[sample.labels[label]] = found.get(sample.labels[label], 0.0) + sample.value
    return found


def test_an_exact_simulation_of_200_tenants(vllm_config_with: Callable, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvcompose.cli import main
    from kvcompose.connectors import KVComposeConnector
    from kvcompose.exposition import read

    recording.CALL_LOGS.pop("tenants/tier", None)
    config = vllm_config_with({**COMPOSITE, "kv_connector_extra_config": {"pipeline": {
        "version": 1, "name": "tenants", "tenants": {"top_k": TOP_K, "half_life_s": 1e9},
        "children": [{"name": "tier", **RECORDING, "config": {"log": "tenants/tier", "script": {}}}]}}})
    config.cache_config = copy.copy(config.cache_config)
    config.cache_config.num_gpu_blocks = GPU_BLOCKS
    block = config.cache_config.block_size
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    scheduler = KVComposeConnector(config, KVConnectorRole.SCHEDULER, None)
    tier = scheduler.children[0].connector
    prom, exposition = _prometheus(config)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block, sha256)
    stream = _workload(block)
    tenant_of_request: dict[str, str] = {}
    keys_stream = []
    for index, (tenant, prompt) in enumerate(stream):
        req_id = f"r{index}"
        tenant_of_request[req_id] = tenant
        loads = (index % 5) * block if index % 3 else 0  # what the tier claims for this request
        tier.script = {"matches": {req_id: [[loads, False]]}}
        params = {"kvcompose": {"tenant": tenant}}
        request = Request(req_id, prompt, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                          None, block_hasher=hasher)
        keys_stream.append((tenant, [int.from_bytes(h[:8], "big") for h in request.block_hashes]))
        tokens, _ = scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, make_blocks(*range(len(prompt) // block + 1)), tokens)
        scheduler.build_connector_meta(scheduler_output(new=[request]))
        request.num_computed_tokens = request.num_prompt_tokens
        scheduler.request_finished(request, [])
        if index == REQUESTS // 3:  # the workers' first fit of the prefill cost: loads so far priced then
            prom.observe({"economics": {"prefill_seconds_per_token": 2e-6}}, 0)
        if index % 500 == 0 or index == REQUESTS - 1:
            scheduler.build_connector_meta(scheduler_output())  # an idle step: reports go out now
            if (stats := scheduler.get_kv_connector_stats()) is not None:
                prom.observe(type(stats).from_payload(stats.to_dict()).to_dict(), 0)
    text = exposition()
    metrics = read(text)

    # Exactly the true top 20 by prompt tokens are labelled; labels plus other sum to the totals.
    prompt_totals: dict[str, int] = {}
    for tenant, prompt in stream:
        prompt_totals[tenant] = prompt_totals.get(tenant, 0) + len(prompt)
    true_top = sorted(prompt_totals, key=prompt_totals.get, reverse=True)[:TOP_K]
    prompt_by_label = _by_label(metrics, "kvcompose_tenant_prompt_tokens_total", "tenant")
    assert set(prompt_by_label) == {*true_top, OTHER, NONE, INVALID}
    assert sum(prompt_by_label.values()) == sum(prompt_totals.values())
    for tenant in true_top:  # from when it got its label (its earlier requests count as other's)
        assert prompt_totals[tenant] / 2 < prompt_by_label[tenant] <= prompt_totals[tenant]
    loaded_seen: dict[str, int] = {}
    for call in recording.CALL_LOGS["tenants/tier"]:
        if call[0] == "update_state_after_alloc":
            loaded_seen[tenant_of_request[call[1]]] = loaded_seen.get(tenant_of_request[call[1]], 0) + call[3]
    loaded_by_label = _by_label(metrics, "kvcompose_tenant_loaded_tokens_total", "tenant", connector="tier")
    assert sum(loaded_by_label.values()) == metrics.total("kvcompose_loaded_tokens_total", connector="tier") == sum(
        loaded_seen.values()) > 0
    for tenant in true_top:
        assert loaded_by_label[tenant] <= loaded_seen[tenant]
    saved_by_label = _by_label(metrics, "kvcompose_tenant_prefill_seconds_saved_total", "tenant", connector="tier")
    assert sum(saved_by_label.values()) == pytest.approx(
        metrics.total("kvcompose_prefill_seconds_saved_total", connector="tier"), rel=1e-9)
    assert saved_by_label[true_top[0]] == pytest.approx(loaded_by_label[true_top[0]] * 2e-6, rel=1e-9)
    assert len({sample.labels["tenant"] for name in ("kvcompose_tenant_prompt_tokens_total",
                                                     "kvcompose_tenant_cache_size_hit_ratio")
                for sample in metrics.series(name)}) <= TOP_K + 3

    # Each top tenant's curve against the exact LRU, at the sizes of the grid.
    curves: dict[str, dict[int, float]] = {}
    for sample in metrics.series("kvcompose_tenant_cache_size_hit_ratio"):
        curves.setdefault(sample.labels["tenant"], {})[int(sample.labels["size_blocks"])] = sample.value
    sizes = sorted(curves[true_top[0]])
    assert GPU_BLOCKS in sizes
    exact = exact_lru_by_tenant(keys_stream, sizes)
    errors = {tenant: float(np.mean(np.abs(np.array([curves[tenant][size] for size in sizes]) - exact[tenant])))
              for tenant in true_top}
    assert scheduler._instrumentation._stream._sampler.rate < 1  # sampled, not replayed in full
    assert max(errors.values()) <= MAX_MEAN_ABSOLUTE_ERROR, errors
    assert exact[true_top[0]][sizes.index(GPU_BLOCKS)] > 0.3  # the curves say something
    assert max(exact[t][-1] for t in true_top) - min(exact[t][-1] for t in true_top) > 0.05  # tenants differ

    # kvcompose advise --by-tenant on that exposition: each tenant's figures, and its hit ratio at the GPU size.
    saved = tmp_path / "metrics.txt"
    saved.write_text(text)
    try:
        main(["advise", "--metrics", str(saved), "--by-tenant", "--json"])
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    advice = json.loads(capsys.readouterr().out)
    tenants = {tenant["name"]: tenant for tenant in advice["tenants"]}
    assert set(tenants) == set(prompt_by_label)
    assert [tenant["name"] for tenant in advice["tenants"]][:3] == sorted(
        prompt_by_label, key=prompt_by_label.get, reverse=True)[:3]
    assert sum(tenant["prompt_share"] for tenant in advice["tenants"]) == pytest.approx(1.0)
    for tenant in true_top:
        figures = tenants[tenant]
        assert figures["prompt_tokens"] == prompt_by_label[tenant]
        assert figures["tiers"]["tier"]["tokens"] == loaded_by_label[tenant]
        assert figures["tiers"]["tier"]["prefill_saved_s"] == pytest.approx(saved_by_label[tenant])
        assert figures["hit_ratio_at_gpu"] == pytest.approx(exact[tenant][sizes.index(GPU_BLOCKS)],
                                                            abs=MAX_MEAN_ABSOLUTE_ERROR)
    main(["advise", "--metrics", str(saved), "--by-tenant"])
    text_advice = capsys.readouterr().out
    assert f"{true_top[0]}: {prompt_by_label[true_top[0]]:,.0f} prompt tokens" in text_advice
    main(["advise", "--metrics", str(saved), "--json"])
    assert "tenants" not in json.loads(capsys.readouterr().out)  # only when asked


# ---- the scheduler's books: where the tenant comes from, and hostile tenants ---------------------------------


def _books(top_k: int) -> Any:
    from kvcompose.config import TenantsSection
    from kvcompose.instrumentation.tenants import TenantBooks

    return TenantBooks(TenantsSection(top_k=top_k), None)


def _request(req_id: str, params: Any = None, lora: str | None = None, salt: str | None = None,
             tokens: int = 32) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params is not None else None)
    return Request(req_id, list(range(tokens)), sampling, None, cache_salt=salt,
                   lora_request=LoRARequest(lora, 1, "/nonexistent") if lora is not None else None)


def test_a_real_request_is_labelled_by_its_params_then_its_lora_adapter_never_its_salt() -> None:
    books = _books(top_k=4)
    assert books.admitted(_request("a", lora="adapter-x")) == "adapter-x"
    assert books.admitted(_request("b", {"kvcompose": {"tenant": "acme"}}, lora="adapter-x")) == "acme"
    assert books.admitted(_request("c", salt="s3cret")) == NONE
    assert books.admitted(_request("d", {"kvcompose": {"tenant": "x\x00y"}}, lora="adapter-x")) == INVALID
    report = books.report(now=True)
    assert report.prompt_tokens == {"adapter-x": 32, "acme": 32, NONE: 32, INVALID: 32}
    assert sorted(report.labelled) == ["acme", "adapter-x"]
    assert "s3cret" not in repr(report.to_dict())


def _run(tenants: list[str], top_k: int) -> tuple[Any, Callable[[], Any]]:
    """The requests of ``tenants`` (one each, 32 prompt tokens) through the scheduler's books and the
    front-end's series, reported every 1000 requests as the stats would carry them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest

    from kvcompose.exposition import read
    from kvcompose.metrics.tenants import TenantSeries

    registry = CollectorRegistry()
    types: dict[type, Any] = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    series = TenantSeries(types, ["model_name", "engine"], {0: ["m", "0"]}, ["disk"])
    books = _books(top_k)
    for index, tenant in enumerate(tenants):
        label = books.admitted(_request(f"r{index}", {"kvcompose": {"tenant": tenant}}))
        books.loaded(label, "disk", 16)
        if index % 1000 == 999 or index == len(tenants) - 1:
            series.observe(TenantReport.from_payload(books.report(now=True).to_dict()), 0, 1e-3)
    return books, lambda: read(generate_latest(registry).decode())


def test_100000_distinct_tenants_leave_the_heavy_tenants_figures_unchanged_and_the_series_bounded() -> None:
    heavy = [f"heavy-{index}" for index in range(5)]
    noisy = [*heavy]
    for index in range(100_000):
        noisy.append("k" * 1024 if index % 100 == 0 else f"one-off-{index}")  # a KB-long value, 1000 times
        if index % 50 == 0:
            noisy += heavy
    books, metrics = _run(noisy, top_k=5)
    _, quiet_metrics = _run(heavy * 2001, top_k=5)
    prompts = _by_label(metrics(), "kvcompose_tenant_prompt_tokens_total", "tenant")
    quiet_prompts = _by_label(quiet_metrics(), "kvcompose_tenant_prompt_tokens_total", "tenant")
    assert len(prompts) <= 5 + 3 and len(books._sketch) <= 256
    assert sum(prompts.values()) == 32 * len(noisy)
    for tenant in heavy:
        assert prompts[tenant] == quiet_prompts[tenant] == 32 * 2001
    loaded = _by_label(metrics(), "kvcompose_tenant_loaded_tokens_total", "tenant")
    assert sum(loaded.values()) == 16 * len(noisy) and set(loaded) == set(prompts)
