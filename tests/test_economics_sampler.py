"""The reuse-distance sampler: keys from vLLM's block hashes, write waste, the window, bounded memory."""

from __future__ import annotations

import math
import os
import tracemalloc
from collections import OrderedDict

import numpy as np
import pytest

from kvcompose.economics.shards import DEFAULT_SAMPLE_RATE, ReuseDistanceSampler, block_keys
from kvcompose.economics.sizes import Reach, size_grid, tier_reaches
from kvcompose.economics.streams import StreamShape, requests

MIB = 1 << 20


def exact_sampler(max_size_blocks: int, reaches: tuple[Reach, ...] = ()) -> ReuseDistanceSampler:
    """A sampler that samples every reference (rate 1 throughout) and keeps every reference (no window)."""
    return ReuseDistanceSampler(max_size_blocks, reaches=reaches, max_tracked_keys=1 << 20,
                                full_sample_references=1 << 40, half_life_s=None)


def tail_first(stream: list[np.ndarray]) -> list[int]:
    return [key for request in stream for key in request[::-1].tolist()]


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_block_keys_are_the_first_eight_bytes_of_vllms_own_block_hashes(algorithm: str) -> None:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algorithm)
    init_none_hash(hash_fn)
    prompt = np.random.default_rng(0).integers(0, 32000, 16 * 40 + 5).tolist()
    request = Request("r", prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(16, hash_fn))

    assert len(request.block_hashes) == 40  # full blocks only
    keys = block_keys(request.block_hashes)
    assert keys.dtype == np.uint64
    assert keys.tolist() == [int.from_bytes(block_hash[:8], "big") for block_hash in request.block_hashes]


def test_block_keys_take_any_hash_width_and_refuse_mixed_ones() -> None:
    hashes = [os.urandom(16) for _ in range(50)]  # xxHash's width
    assert block_keys(hashes).tolist() == [int.from_bytes(h[:8], "big") for h in hashes]
    assert block_keys([]).size == 0
    with pytest.raises(ValueError):
        block_keys([os.urandom(16), os.urandom(32)])
    with pytest.raises(ValueError):
        block_keys([b"short"])


@pytest.mark.parametrize("blocks", [100, 2000])  # either side of the switch to the vectorised comparison
def test_hashes_and_keys_record_the_same_stream(blocks: int) -> None:
    rng = np.random.default_rng(blocks)
    pool = [os.urandom(32) for _ in range(3 * blocks)]
    by_hashes, by_keys = (ReuseDistanceSampler(1 << 16, full_sample_references=0, half_life_s=None)
                          for _ in range(2))
    for _ in range(300):
        start = int(rng.integers(0, 2 * blocks))
        hashes = pool[start:start + blocks]
        by_hashes.record_hashes(hashes)
        by_keys.record(block_keys(hashes))

    sizes = [256, 1024, 4096]
    assert by_hashes.rate == DEFAULT_SAMPLE_RATE  # so both paths really filtered
    assert by_hashes.tracked_keys == by_keys.tracked_keys > 0
    assert by_hashes.hit_ratio(sizes) == by_keys.hit_ratio(sizes)


def test_an_lru_cache_fed_tail_first_keeps_prefixes_whole() -> None:
    """The reading behind the curve: with each request's root the most recent, a cached block's parent is
    always cached too, so block-level hits are prefix hits."""
    stream = list(requests(20_000, StreamShape(), seed=4))
    parent = {child: root for request in stream for root, child in zip(request[:-1].tolist(), request[1:].tolist())}
    for size in (256, 1024):
        cache: OrderedDict[int, None] = OrderedDict()
        for request in stream:
            for key in request[::-1].tolist():
                cache[key] = None
                cache.move_to_end(key)
                if len(cache) > size:
                    cache.popitem(last=False)
            assert all(parent[key] in cache for key in cache if key in parent)


def exact_distances(keys: list[int]) -> list[float]:
    """Each reference's LRU reuse distance (distinct keys used since its last reference; inf the first time),
    from a plain list kept most recent first."""
    stack: list[int] = []
    distances = []
    for key in keys:
        try:
            depth = stack.index(key)
        except ValueError:
            distances.append(math.inf)
        else:
            distances.append(float(depth))
            del stack[depth]
        stack.insert(0, key)
    return distances


def test_write_waste_and_curve_equal_an_exact_count_when_every_reference_is_sampled() -> None:
    stream = list(requests(20_000, StreamShape(), seed=5))
    keys = tail_first(stream)
    distances = exact_distances(keys)
    reaches = tuple(reach for reach in tier_reaches(300, [1200, 4000]) if reach is not None)
    sampler = exact_sampler(8192, reaches)
    for request in stream:
        sampler.record(request)

    for reach in reaches:
        written = read = 0
        last_written: dict[int, bool] = {}
        for key, distance in zip(keys, distances):
            if last_written.get(key) and reach.start <= distance < reach.end:
                read += 1
            last_written[key] = distance >= reach.end
            written += last_written[key]
        assert 0 < read < written
        assert sampler.write_waste(reach) == pytest.approx((written - read) / written, rel=1e-9)
    # Sizes on the histogram's bin edges (powers of two) are exact; others are interpolated within a bin.
    sizes = [256, 1024, 4096]
    exact = [sum(d < size for d in distances) / len(distances) for size in sizes]
    assert sampler.hit_ratio(sizes) == pytest.approx(exact, rel=1e-9)
    assert sampler.hit_ratio([1500]) == pytest.approx([sum(d < 1500 for d in distances) / len(distances)],
                                                      abs=0.002)


def test_the_curve_follows_new_traffic_within_a_few_half_lives() -> None:
    old = list(requests(200_000, StreamShape(documents_per_prompt=20), seed=6))  # few documents: hits early
    new = list(requests(200_000, StreamShape(documents_per_prompt=2000, zipf_exponent=0.7), seed=7))
    half_life_s = 60.0
    windowed, everything, new_only = (ReuseDistanceSampler(1 << 15, half_life_s=window, max_tracked_keys=1 << 20,
                                                           full_sample_references=1 << 40)
                                      for window in (half_life_s, None, half_life_s))
    for phase, stream in enumerate((old, new)):
        # Each phase lasts 10 half-lives, its requests evenly spread over them.
        for index, request in enumerate(stream):
            now = (phase + index / len(stream)) * 10 * half_life_s
            windowed.record(request, now=now)
            everything.record(request, now=now)
            if phase:
                new_only.record(request, now=now)

    sizes = size_grid([4096])
    target = np.array(new_only.hit_ratio(sizes))
    assert np.max(np.abs(np.array(windowed.hit_ratio(sizes)) - target)) < 0.005
    assert np.max(np.abs(np.array(everything.hit_ratio(sizes)) - target)) > 0.1  # the window is what follows


def test_a_quiet_hour_leaves_the_curve_as_it_was() -> None:
    stream = list(requests(50_000, StreamShape(), seed=8))
    sampler = ReuseDistanceSampler(1 << 14, half_life_s=600.0)
    for index, request in enumerate(stream):
        sampler.record(request, now=index * 0.01)
    sizes = [256, 1024, 4096]
    before = sampler.hit_ratio(sizes)
    sampler.record(np.empty(0, dtype=np.uint64), now=len(stream) * 0.01 + 3600)
    assert sampler.hit_ratio(sizes) == pytest.approx(before, rel=1e-9)


def test_memory_stays_flat_over_a_million_requests_of_new_blocks() -> None:
    sampler = ReuseDistanceSampler(size_grid([1 << 18])[-1])
    rng = np.random.default_rng(9)
    footprints = []
    for done in range(1, 1001):
        batch = rng.integers(0, np.iinfo(np.uint64).max, size=(1000, 100), dtype=np.uint64, endpoint=True)
        for keys in batch:
            sampler.record(keys)
        assert sampler.tracked_keys <= sampler.max_tracked_keys
        if done in (100, 1000):
            footprints.append(sampler.memory_bytes())
    assert sampler.stream_references == 10**8
    assert sampler.rate < DEFAULT_SAMPLE_RATE  # the key limit, not the settled rate, holds it down
    assert footprints[1] < 4 * MIB
    assert footprints[1] == pytest.approx(footprints[0], rel=0.15)


def test_memory_bytes_agrees_with_what_the_allocator_traced() -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        sampler = ReuseDistanceSampler(1 << 20)
        for request in requests(500_000, StreamShape(documents_per_prompt=2000), seed=10):
            sampler.record(request)
        grown = tracemalloc.take_snapshot().compare_to(before, "filename")
    finally:
        tracemalloc.stop()
    traced = sum(stat.size_diff for stat in grown if stat.traceback[0].filename.endswith("shards.py"))
    assert sampler.tracked_keys > 1000
    assert sampler.memory_bytes() == pytest.approx(traced, rel=0.25)


def test_the_rate_settles_at_the_configured_one_on_a_long_stream() -> None:
    sampler = ReuseDistanceSampler(1 << 16, sample_rate=1 / 32, full_sample_references=1 << 14)
    assert sampler.rate == pytest.approx(1.0)
    for request in requests(1 << 20, StreamShape(documents_per_prompt=20), seed=11):
        sampler.record(request)
    assert sampler.rate == 1 / 32


def test_readings_before_any_traffic_and_past_the_curve() -> None:
    sampler = ReuseDistanceSampler(1024, reaches=[Reach(100, 500)])
    assert all(math.isnan(ratio) for ratio in sampler.hit_ratio([256, 1024]))
    assert math.isnan(sampler.write_waste(Reach(100, 500)))
    sampler.record(np.arange(10, dtype=np.uint64))
    assert sampler.hit_ratio([256, 1024]) == [0.0, 0.0]  # first references all miss
    assert sampler.write_waste(Reach(100, 500)) == 1.0
    with pytest.raises(ValueError):
        sampler.hit_ratio([2048])


@pytest.mark.parametrize("arguments", [
    {"max_size_blocks": 0}, {"sample_rate": 0.0}, {"sample_rate": 1.5}, {"max_tracked_keys": 8},
    {"half_life_s": 0.0}, {"full_sample_references": -1}, {"reaches": [Reach(0, 1 << 20)]},
])
def test_bad_arguments_are_refused(arguments: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ReuseDistanceSampler(**{"max_size_blocks": 1024, **arguments})


def test_tier_reaches_follow_the_load_order_and_sizes() -> None:
    assert tier_reaches(100, [400, 1000]) == [Reach(100, 500), Reach(500, 1100)]
    # A smaller tier after a larger serves nothing (an empty reach); after one of unknown size, it is unknown.
    assert tier_reaches(100, [1000, 400]) == [Reach(100, 1100), Reach(1100, 1100)]
    assert Reach(1100, 1100).empty and not Reach(100, 1100).empty
    assert tier_reaches(100, [None, 400]) == [None, None]
    assert tier_reaches(0, [400, 1000]) == [Reach(0, 400), Reach(400, 1000)]  # no GPU prefix hits: from 0
    assert size_grid([300, 5000]) == [256, 300, 512, 1024, 2048, 4096, 5000, 8192, 16384, 32768, 65536]


def test_a_tier_with_an_empty_reach_wastes_every_write() -> None:
    """A loader no larger than an earlier one serves no reuse distance: nothing written to it is read from it,
    while the earlier tier reads back the repeats."""
    earlier, empty = Reach(100, 500), Reach(500, 500)
    sampler = exact_sampler(1024, reaches=(earlier, empty))
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, np.iinfo(np.uint64).max, size=200, dtype=np.uint64)
    for _ in range(3):  # each block comes back at a reuse distance of 199, within the earlier tier's reach
        sampler.record(blocks)
    assert sampler.write_waste(earlier) == 0.0  # written once (the first references), read back since
    assert sampler.write_waste(empty) == 1.0
