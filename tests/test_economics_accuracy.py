"""The sampler's hit-ratio curve against libCacheSim's exact LRU on the same block-reference stream.

The stream is what the sampler models: each request's block keys, tail first (vLLM's own caches keep a
request's root the most recent). libCacheSim replays it as an oracleGeneral trace of unit-size objects.
"""

from __future__ import annotations

from pathlib import Path

import libcachesim
import numpy as np
import pytest

from kvcompose.economics.shards import ReuseDistanceSampler
from kvcompose.economics.sizes import size_grid, tier_reaches
from kvcompose.economics.streams import StreamShape, requests

MAX_MEAN_ABSOLUTE_ERROR = 0.02
SHAPES = {
    "zipf-shared-prefixes": StreamShape(),
    "shifting-working-set": StreamShape(shifting=True),
    "many-documents": StreamShape(documents_per_prompt=2000, zipf_exponent=0.8),
}
# (GPU cache, one tier below it) in blocks, for each stream length: the curve is read around them.
CACHES = {10**4: (300, 2000), 10**6: (3000, 20000)}
_TRACE_RECORD = np.dtype([("time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access", "<i8")])


def exact_lru_hit_ratios(stream: list[np.ndarray], sizes: list[int], directory: Path) -> list[float]:
    """libCacheSim's LRU over the requests' blocks, tail first, at each size."""
    keys = np.concatenate([request[::-1] for request in stream])
    trace = np.zeros(keys.size, dtype=_TRACE_RECORD)
    trace["time"], trace["obj_id"], trace["obj_size"], trace["next_access"] = np.arange(keys.size), keys, 1, -1
    path = directory / "stream.oracleGeneral.bin"
    trace.tofile(path)
    reader = libcachesim.TraceReader(str(path), libcachesim.TraceType.ORACLE_GENERAL_TRACE)
    return [1.0 - libcachesim.LRU(cache_size=size).process_trace(reader)[0] for size in sizes]


@pytest.mark.parametrize("references", sorted(CACHES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_curve_matches_exact_lru(references: int, shape: str, tmp_path: Path) -> None:
    stream = list(requests(references, SHAPES[shape], seed=1))
    gpu, tier = CACHES[references]
    sizes = size_grid([gpu, tier, gpu + tier])
    sampler = ReuseDistanceSampler(sizes[-1], half_life_s=None)  # default sampling, no window
    for request in stream:
        sampler.record(request)
    estimated = np.array(sampler.hit_ratio(sizes))
    exact = np.array(exact_lru_hit_ratios(stream, sizes, tmp_path))

    assert np.mean(np.abs(estimated - exact)) <= MAX_MEAN_ABSOLUTE_ERROR, list(zip(sizes, estimated, exact))
    if references >= 10**6:
        assert sampler.rate < 0.1  # sampled, not replayed in full
    # What the tier adds below the GPU cache, as the docs read the curve: hit(G + T) - hit(G).
    reach = tier_reaches(gpu, [tier])[0]
    assert reach is not None
    added = {name: curve[sizes.index(reach.end)] - curve[sizes.index(reach.start)]
             for name, curve in (("estimated", estimated), ("exact", exact))}
    assert added["estimated"] == pytest.approx(added["exact"], abs=2 * MAX_MEAN_ABSOLUTE_ERROR)
    assert added["exact"] > 0.05  # the tier matters on these streams, so the comparison says something
