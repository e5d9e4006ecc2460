"""What the miss-ratio-curve sampler costs, against vLLM's own hashing of the same requests, and its memory.

vLLM hashes every full block of every request on the scheduler side (``Request.block_hashes``, filled by
``get_request_block_hasher`` with the engine's ``prefix_caching_hash_algo``, SHA-256 by default). The sampler
adds ``ReuseDistanceSampler.record_hashes`` once per admitted request (or ``block_keys``, a vectorised view
of the hashes as integers, then ``record``: both are timed).
Both are timed here on real ``vllm.v1.request.Request`` objects, in rotating rounds, best round kept:

- Prompts of 100, 1,000 and 10,000 blocks share Zipf-popular prefixes, so the sampler sees reuse.
- The sampler is timed settled (after the rate has fallen to ``sample_rate``, the default 1/64); the fall
  itself, once per engine, is timed apart on a synthetic stream.
- Memory: ``memory_bytes`` and the tracked keys after 10^4, 10^5 and 10^6 requests of 100 new blocks each
  (every key new: the traffic that grows a key table fastest).

``python -m benchmarks.economics`` prints the tables; ``--json`` the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from kvcompose.economics.shards import DEFAULT_SAMPLE_RATE, ReuseDistanceSampler, block_keys
from kvcompose.economics.sizes import Reach, size_grid
from kvcompose.economics.streams import StreamShape, requests

from benchmarks.targets import SAMPLER_MAX_PERCENT_OF_HASHING

PROMPT_BLOCKS = (100, 1000, 10000)
BLOCK_TOKENS = 16
# A GPU cache of 2^16 blocks and a tier of 2^18 below it: the curve is read up to 8x the largest.
GPU_BLOCKS, TIER_BLOCKS = 1 << 16, 1 << 18
MEMORY_CHECKPOINTS = (10_000, 100_000, 1_000_000)


def _sampler() -> ReuseDistanceSampler:
    grid = size_grid([GPU_BLOCKS, TIER_BLOCKS, GPU_BLOCKS + TIER_BLOCKS])
    return ReuseDistanceSampler(grid[-1], reaches=[Reach(GPU_BLOCKS, GPU_BLOCKS + TIER_BLOCKS)])


def _prompts(blocks: int, count: int, seed: int) -> list[list[int]]:
    """Token ids: a shared system prompt (a quarter), one of a few documents (half), a unique rest."""
    rng = np.random.default_rng(seed)
    tokens = blocks * BLOCK_TOKENS
    system = rng.integers(0, 32000, tokens // 4).tolist()
    documents = [rng.integers(0, 32000, tokens // 2).tolist() for _ in range(8)]
    return [system + documents[index % len(documents)] + rng.integers(0, 32000, tokens - tokens // 4 - tokens // 2
                                                                      ).tolist() for index in range(count)]


def _vllm_requests(blocks: int, count: int) -> tuple[list[Any], Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_TOKENS, hash_fn)
    params = SamplingParams(max_tokens=1)
    made = [Request(f"r{blocks}-{index}", prompt, params, None)
            for index, prompt in enumerate(_prompts(blocks, count, seed=blocks))]
    return made, hasher


def _time_hashing(made: list[Any], hasher: Any) -> float:
    """Seconds per request for vLLM's hasher over each request's blocks, from none hashed."""
    for request in made:
        request.block_hashes = []  # the hasher starts after the blocks already hashed
    start = time.perf_counter()
    for request in made:
        request.block_hashes = hasher(request)
    return (time.perf_counter() - start) / len(made)


def _time_sampling(sampler: ReuseDistanceSampler, made: list[Any], order: np.ndarray, via_keys: bool) -> float:
    """Seconds per request for the sampler's share: ``record_hashes``, or ``block_keys`` then ``record``."""
    hashes = [made[index].block_hashes for index in order]
    start = time.perf_counter()
    if via_keys:
        for block_hashes in hashes:
            sampler.record(block_keys(block_hashes))
    else:
        for block_hashes in hashes:
            sampler.record_hashes(block_hashes)
    return (time.perf_counter() - start) / len(order)


def _zipf_order(count: int, length: int, seed: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** 1.1
    return np.random.default_rng(seed).choice(count, size=length, p=weights / weights.sum())


def _settle(sampler: ReuseDistanceSampler, made: list[Any]) -> None:
    order = _zipf_order(len(made), 4 * len(made), seed=1)
    while sampler.rate > sampler.sample_rate:
        for index in order:
            sampler.record_hashes(made[index].block_hashes)


def measure_cost(rounds: int = 7) -> list[dict[str, Any]]:
    rows = []
    for blocks in PROMPT_BLOCKS:
        count = max(8, 20000 // blocks)
        made, hasher = _vllm_requests(blocks, count)
        _time_hashing(made, hasher)
        sampler = _sampler()
        _settle(sampler, made)
        order = _zipf_order(count, 4 * count, seed=2)
        hashing, hashes, keys = [], [], []
        for _ in range(rounds):
            hashing.append(_time_hashing(made, hasher))
            hashes.append(_time_sampling(sampler, made, order, via_keys=False))
            keys.append(_time_sampling(sampler, made, order, via_keys=True))
        rows.append({"prompt_blocks": blocks, "vllm_hashing_us": min(hashing) * 1e6,
                     "sampler_us": min(hashes) * 1e6, "percent": 100 * min(hashes) / min(hashing),
                     "via_keys_us": min(keys) * 1e6, "via_keys_percent": 100 * min(keys) / min(hashing),
                     "rate": sampler.rate, "tracked_keys": sampler.tracked_keys})
    return rows


def measure_settling() -> dict[str, Any]:
    """CPU seconds the default sampler spends before its rate settles, on a synthetic stream."""
    sampler = _sampler()
    stream = list(requests(1 << 20, StreamShape(), seed=5))
    spent, references = 0.0, 0
    while sampler.rate > sampler.sample_rate:
        start = time.process_time()
        for keys in stream:
            sampler.record(keys)
        spent += time.process_time() - start
        references += sum(keys.size for keys in stream)
    return {"cpu_s": spent, "block_references": references, "rate": sampler.rate}


def measure_memory(blocks_per_request: int = 100) -> list[dict[str, Any]]:
    sampler = _sampler()
    rng = np.random.default_rng(7)
    rows, done, batch = [], 0, 1000
    for checkpoint in MEMORY_CHECKPOINTS:
        while done < checkpoint:
            keys = rng.integers(0, np.iinfo(np.uint64).max, size=(batch, blocks_per_request), dtype=np.uint64,
                                endpoint=True)
            for row in keys:
                sampler.record(row)
            done += batch
        rows.append({"requests": done, "memory_bytes": sampler.memory_bytes(), "tracked_keys": sampler.tracked_keys,
                     "rate": sampler.rate})
    return rows


def measure() -> dict[str, Any]:
    return {"cost": measure_cost(), "settling": measure_settling(), "memory": measure_memory(),
            "sample_rate": DEFAULT_SAMPLE_RATE, "target_percent": SAMPLER_MAX_PERCENT_OF_HASHING}


def table(result: dict[str, Any]) -> str:
    lines = [("| prompt blocks | vLLM hashing us/request | record_hashes us/request | / hashing | "
              "block_keys + record us/request | / hashing | rate |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {row['prompt_blocks']} | {row['vllm_hashing_us']:.0f} | {row['sampler_us']:.2f} | "
              f"{row['percent']:.2f}% {'ok' if row['percent'] <= result['target_percent'] else 'OVER'} | "
              f"{row['via_keys_us']:.2f} | {row['via_keys_percent']:.2f}% | 1/{1 / row['rate']:.0f} |"
              for row in result["cost"]]
    settling = result["settling"]
    lines += ["", (f"Settling from rate 1 to 1/{1 / settling['rate']:.0f}: {settling['cpu_s']:.2f} CPU s over "
                   f"{settling['block_references']:,} block references (once per engine)."), "",
              "| requests (100 new blocks each) | sampler memory MiB | tracked keys | rate |", "| --- | --- | --- | --- |"]
    lines += [f"| {row['requests']:,} | {row['memory_bytes'] / 2**20:.2f} | {row['tracked_keys']} | "
              f"{row['rate']:.2e} |" for row in result["memory"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.economics", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    result = measure()
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
