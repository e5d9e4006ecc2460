"""Synthetic prefix-block streams with the shape of LLM traffic, for tests and benchmarks.

A request is a system prompt, a document under it (both shared, chosen by
Zipf popularity), then a suffix of its own. Keys are uniform random 64-bit
integers, as the first eight bytes of vLLM's block hashes are: a block's key
stands for its whole prefix, so a document under two system prompts has two
sets of keys. Halfway through a shifting stream, a new set of documents
takes over the popularity ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamShape:
    system_prompts: int = 8
    system_prompt_blocks: tuple[int, ...] = (8, 32)
    documents_per_prompt: int = 200
    document_blocks: tuple[int, ...] = (4, 16, 64)
    suffix_blocks: tuple[int, int] = (1, 8)  # uniform, inclusive
    zipf_exponent: float = 1.1
    shifting: bool = False


def _zipf_choices(rng: np.random.Generator, population: int, exponent: float, count: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, population + 1) ** exponent
    return rng.choice(population, size=count, p=weights / weights.sum())


def _keys(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(0, np.iinfo(np.uint64).max, size=count, dtype=np.uint64, endpoint=True)


def requests(block_references: int, shape: StreamShape = StreamShape(), seed: int = 0) -> Iterator[np.ndarray]:
    """Requests' block keys, root first, until about ``block_references`` blocks have been asked for."""
    rng = np.random.default_rng(seed)
    prompts = [_keys(rng, int(rng.choice(shape.system_prompt_blocks))) for _ in range(shape.system_prompts)]
    generations = 2 if shape.shifting else 1
    documents = [[[_keys(rng, int(rng.choice(shape.document_blocks))) for _ in range(shape.documents_per_prompt)]
                  for _ in prompts] for _ in range(generations)]
    mean_blocks = (np.mean(shape.system_prompt_blocks) + np.mean(shape.document_blocks)
                   + np.mean(shape.suffix_blocks))
    count = int(block_references / mean_blocks * 1.5) + 16
    prompt_of = _zipf_choices(rng, shape.system_prompts, shape.zipf_exponent, count)
    document_of = _zipf_choices(rng, shape.documents_per_prompt, shape.zipf_exponent, count)
    suffix_of = rng.integers(shape.suffix_blocks[0], shape.suffix_blocks[1], size=count, endpoint=True)
    suffixes = _keys(rng, int(suffix_of.sum()))
    emitted, used_suffix = 0, 0
    for index in range(count):
        if emitted >= block_references:
            return
        generation = documents[generations * emitted // (block_references + 1)]
        suffix = suffixes[used_suffix:used_suffix + suffix_of[index]]
        used_suffix += suffix_of[index]
        request = np.concatenate((prompts[prompt_of[index]], generation[prompt_of[index]][document_of[index]],
                                  suffix))
        emitted += request.size
        yield request
