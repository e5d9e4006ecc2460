"""Tier economics between the engine and the front-end: what the scheduler and workers report, and the series.

The sampler's accuracy is tests/test_economics_shards.py's; a real server's
curve and saved seconds, tests/test_economics_serve.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.instrumentation.economics import PrefillCost, tier_capacity_blocks
from kvcompose.metrics.economics import EconomicsSeries
from kvcompose.wire.economics import EconomicsReport
from kvcompose.wire.stats import ECONOMICS_KEY, KVComposeStats


def _series() -> tuple[EconomicsSeries, Callable[[str], dict[tuple[tuple[str, str], ...], float]]]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest

    from kvcompose import exposition

    registry = CollectorRegistry()
    types: dict[type, Any] = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    series = EconomicsSeries(types, ["model_name", "engine"], {0: ["m", "0"]}, ["offload", "disk"])

    def read(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))):
                sample.value
                for sample in exposition.read(generate_latest(registry).decode()).series(name)}

    return series, read


def test_loads_are_priced_at_the_engines_prefill_cost_once_it_is_known() -> None:
    series, read = _series()
    series.loaded(0, "offload", 1000)  # before the workers measured a cost: kept
    assert read("kvcompose_prefill_seconds_saved_total")[(("connector", "offload"),)] == 0
    series.observe(EconomicsReport(prefill_seconds_per_token=2e-5), 0)
    assert read("kvcompose_prefill_seconds_saved_total")[(("connector", "offload"),)] == pytest.approx(0.02)
    series.observe(EconomicsReport(prefill_seconds_per_token=1e-5), 0)  # the cost moved: later loads at the new one
    series.loaded(0, "offload", 500)
    series.loaded(0, "disk", 100)
    saved = read("kvcompose_prefill_seconds_saved_total")
    assert saved[(("connector", "offload"),)] == pytest.approx(0.025)
    assert saved[(("connector", "disk"),)] == pytest.approx(0.001)
    assert read("kvcompose_prefill_seconds_per_token")[()] == 1e-5


def test_the_curve_capacities_and_waste_become_gauges_and_a_moved_grid_leaves_no_stale_size() -> None:
    series, read = _series()
    series.observe(EconomicsReport(curve=[[256, 0.1], [512, 0.4]], capacities={"offload": 100, "gpu": 300},
                                   reaches={"offload": [300, 400]}, block_bytes=4096, write_waste={"offload": 0.25}),
                   0)
    assert read("kvcompose_tier_reach_blocks") == {(("connector", "offload"), ("edge", "end")): 400,
                                                   (("connector", "offload"), ("edge", "start")): 300}
    assert read("kvcompose_cache_size_hit_ratio") == {(("size_blocks", "256"),): 0.1, (("size_blocks", "512"),): 0.4}
    assert read("kvcompose_tier_capacity_blocks") == {(("connector", "gpu"),): 300, (("connector", "offload"),): 100}
    assert read("kvcompose_kv_block_bytes") == {(): 4096} and read("kvcompose_write_waste_ratio") == {
        (("connector", "offload"),): 0.25}
    series.observe(EconomicsReport(curve=[[512, 0.5], [1024, 0.7]]), 0)
    assert read("kvcompose_cache_size_hit_ratio") == {(("size_blocks", "512"),): 0.5,
                                                      (("size_blocks", "1024"),): 0.7}
    assert read("kvcompose_tier_capacity_blocks")[(("connector", "offload"),)] == 100  # not reported again: kept


def test_merged_reports_keep_the_latest_of_each_figure() -> None:
    scheduler = KVComposeStats(data={ECONOMICS_KEY: EconomicsReport(curve=[[256, 0.1]], block_bytes=4096)})
    worker = KVComposeStats(data={ECONOMICS_KEY: EconomicsReport(prefill_seconds_per_token=3e-5)})
    later = KVComposeStats(data={ECONOMICS_KEY: EconomicsReport(curve=[[256, 0.2]])})
    merged = scheduler.aggregate(worker).aggregate(later)
    assert merged.economics.to_dict() == {"curve": [[256, 0.2]], "capacities": None, "reaches": None,
                                          "block_bytes": 4096, "write_waste": None, "prefill_seconds_per_token": 3e-5}
    assert scheduler.data[ECONOMICS_KEY] is merged.economics  # taken over, then copied before being added to
    assert worker.economics.curve is None and later.economics.block_bytes is None  # inputs unmodified
    assert KVComposeStats.from_payload(merged.to_dict()).economics == merged.economics


def test_the_prefill_cost_is_the_slope_of_step_time_not_seconds_over_tokens() -> None:
    """Steps cost 5 ms fixed, 2 us per prefill token and 50 us per decode, with fewer decodes beside bigger
    prefills (as a token budget makes them): the fit finds 2 us, where seconds over tokens would say ~20 us."""
    fixed, per_prefill, per_decode = 5e-3, 2e-6, 5e-5
    cost = PrefillCost()
    for step in range(4):  # every step alike: the slope cannot be told from the fixed cost
        cost.step_ended(fixed + per_prefill * 400 + per_decode * 8, 400, 8)
    assert cost.seconds_per_token is None and cost.report() is None
    steps = [(prefill, 64 - prefill // 8 + 4 * (prefill % 3)) for prefill in range(0, 512, 16)]
    for prefill, decodes in steps:
        cost.step_ended(fixed + per_prefill * prefill + per_decode * decodes, prefill, decodes)
    assert cost.seconds_per_token == pytest.approx(per_prefill, rel=1e-6)
    assert cost.report() == EconomicsReport(prefill_seconds_per_token=cost.seconds_per_token)
    assert cost.report() is None  # reported at most every few seconds,
    cost.step_ended(fixed + per_prefill * 200 + 1e-4, 200, 0)  # 2% off the fit: in it
    assert cost.report() is None
    assert cost.report(now=True) == EconomicsReport(prefill_seconds_per_token=cost.seconds_per_token)  # or idle
    assert cost.report(now=True) is None  # and only when it changed


def test_without_decodes_the_slope_is_a_plain_least_squares_line() -> None:
    cost = PrefillCost()
    for prefill in (130, 406, 150, 394, 10, 406, 150, 256) * 2:
        cost.step_ended(4e-3 + 1e-6 * prefill, prefill, 0)
    assert cost.seconds_per_token == pytest.approx(1e-6, rel=1e-6)
    cost.step_ended(0.0, 100, 0)  # no time measured: left out
    cost.step_ended(0.01, 0, 0)  # nothing computed: left out
    assert cost.seconds_per_token == pytest.approx(1e-6, rel=1e-6)


def test_steps_the_host_stalled_do_not_move_the_slope() -> None:
    """1 us per token and a fixed 5 ms with a little jitter, and one step in ten stalled 30 ms (a busy host):
    least squares over the raw steps would be pulled by wherever the stalls fell; the fit stays near 1 us."""
    import random

    rng = random.Random(3)
    cost = PrefillCost()
    for step in range(3000):
        prefill = rng.choice((16, 128, 256, 384, 500))
        stall = 0.03 if step % 10 == 7 and prefill < 200 else 0.0  # stalls that fall on the short steps
        cost.step_ended(5e-3 + 1e-6 * prefill + rng.uniform(-2e-4, 2e-4) + stall, prefill, 0)
    assert cost.seconds_per_token == pytest.approx(1e-6, rel=0.1)
    for _ in range(3000):  # the engine got slower per token for good (a bigger batch, a busier host): followed
        prefill = rng.choice((16, 128, 256, 384, 500))
        cost.step_ended(5e-3 + 3e-6 * prefill + rng.uniform(-2e-4, 2e-4), prefill, 0)
    assert cost.seconds_per_token == pytest.approx(3e-6, rel=0.1)


def test_a_slope_at_or_below_zero_is_no_cost_so_loads_wait_to_be_priced() -> None:
    """A tiny model's steps on a busy host are mostly stalls: here (step times a loaded 2-core machine gave
    tests/test_dashboard_live.py) they fell on the short prefills, so the fitted slope is below zero. A bigger
    prefill never costs less: that is noise, not a price. No cost is reported, so a load meanwhile is priced
    at the first cost the steps show, where a cost of 0 would have priced it at nothing for good."""
    cost = PrefillCost()
    series, read = _series()
    for prefill, seconds in ((135, 0.0846), (14, 0.0729), (381, 0.0527), (11, 0.0709), (365, 0.0391),
                             (11, 0.0147), (364, 0.0206), (11, 0.0019), (354, 0.0428)):
        cost.step_ended(seconds, prefill, 0)
    fit = cost.fit()
    assert fit is not None and fit.per_prefill_token < 0, fit
    assert cost.seconds_per_token is None and cost.report(now=True) is None
    series.loaded(0, "offload", 1000)
    for prefill in (16, 400) * 500:  # the host calmed down: the steps, as they outweigh the stalls, show the cost
        cost.step_ended(5e-3 + 2e-6 * prefill, prefill, 0)
    report = cost.report(now=True)
    assert report is not None and report.prefill_seconds_per_token > 0, report
    series.observe(report, 0)
    assert read("kvcompose_prefill_seconds_saved_total")[(("connector", "offload"),)] == pytest.approx(
        1000 * report.prefill_seconds_per_token)


def test_an_offloading_childs_capacity_is_its_host_bytes_in_engine_blocks(vllm_config_with: Callable) -> None:
    from kvcompose.config import load_pipeline
    from kvcompose.connectors.children import child_specs

    pipeline = {"version": 1, "name": "sized", "children": [
        {"name": "offload", "connector": "OffloadingConnector", "config": {"cpu_bytes_to_use": 10 * 4096 + 100}},
        {"name": "disk", "connector": "ExampleConnector", "config": {"shared_storage_path": "/tmp/unused"}}]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    offload, disk = child_specs(config, load_pipeline(pipeline))
    assert tier_capacity_blocks(offload, 4096) == 10  # whole blocks
    assert tier_capacity_blocks(disk, 4096) is None  # a disk tier's size is not in its config


def _admitted(prompt: list[int]) -> Any:
    """A real vLLM request of ``prompt``, its block hashes computed as the engine computes them (16-token blocks)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request("r", prompt, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(16, sha256))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_gpu_cache_serves_prefix_hits_only_with_prefix_caching_on(prefix_caching: bool,
                                                                     vllm_config_with: Callable) -> None:
    """A GPU cache of 300 blocks, an offload tier of 100 behind it, and a save-only tier of 400 first in the
    pipeline. A prompt repeated at once is a hit at a reuse distance under 4 blocks: with prefix caching on
    the GPU cache serves it, and every block the tier was written is waste; with it off the GPU cache serves
    no prefix hit, the tier serves distances [0, 100) and reads back every block it was written."""
    import copy

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvcompose.config import load_pipeline
    from kvcompose.connectors.children import child_specs
    from kvcompose.instrumentation import stream_sampler

    layer = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=300, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], layer)])
    block_bytes = layer.page_size_bytes

    def offload(name: str, blocks: int, load: bool) -> dict[str, Any]:
        return {"name": name, "connector": "OffloadingConnector", "load": load,
                "config": {"cpu_bytes_to_use": blocks * block_bytes}}

    pipeline = {"version": 1, "name": "sized", "children": [offload("backup", 400, False), offload("offload", 100, True)]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    config.cache_config = copy.copy(config.cache_config)
    config.cache_config.enable_prefix_caching = prefix_caching
    sampler = stream_sampler(child_specs(config, load_pipeline(pipeline)), (1,), config, kv_cache_config)
    prompt = list(range(16 * 4))
    sampler.admitted(_admitted(prompt))
    sampler.admitted(_admitted(prompt))
    report = sampler.report(now=True)

    gpu = 300 if prefix_caching else 0
    assert report.capacities == {"backup": 400, "offload": 100, "gpu": gpu}
    assert report.reaches == {"offload": [gpu, gpu + 100]}  # loaders only
    assert report.write_waste == {"offload": 1.0 if prefix_caching else 0.0}
    assert (300 in dict(report.curve)) is prefix_caching  # the GPU cache's size is read only where it serves hits


def test_an_engine_going_idle_reports_its_latest_curve_at_once(vllm_config_with: Callable) -> None:
    """`make demo`'s traffic: a prompt, then the same prompt again, then nothing. An idle engine takes no stats,
    so the curve must go out as it goes idle after the repeat, however soon after the first report that is:
    throttled, the demo's metrics read a hit ratio of 0 at every size for a prompt it had just loaded."""
    from kvcompose.config import load_pipeline
    from kvcompose.connectors.children import child_specs
    from kvcompose.instrumentation import stream_sampler

    pipeline = {"version": 1, "name": "demo", "children": [{"name": "disk", "connector": "ExampleConnector",
                                                           "config": {"shared_storage_path": "/nonexistent"}}]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    config.cache_config.num_gpu_blocks = 300
    sampler = stream_sampler(child_specs(config, load_pipeline(pipeline)), (0,), config, None)
    prompt = list(range(16 * 4))
    sampler.admitted(_admitted(prompt))
    first = sampler.report(now=True)  # idle after the cold prompt: no reuse yet
    assert first is not None and all(ratio == 0 for _, ratio in first.curve)
    sampler.admitted(_admitted(prompt))
    repeat = sampler.report(now=True)  # idle after the repeat, at once
    assert repeat is not None
    assert dict(repeat.curve)[max(size for size, _ in repeat.curve)] == pytest.approx(0.5)  # 4 of 8 blocks hit
    assert sampler.report(now=True) is None  # nothing referenced since: nothing to send
