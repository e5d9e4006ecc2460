"""A tier shared by 16 engines: the fleet curve the aggregator merges, against an exact LRU of the interleaved stream.

Each engine is a real :class:`FleetSampler` fed its requests' blocks; the aggregator's real merge code
takes their batches through the JSON wire format, pulled at intervals in a shuffled order as a service
would, with the engines' clocks. libCacheSim's LRU replays the fleet's interleaved stream (each request's
blocks tail first, as the sampler models). Two routers: round robin, and prefix affinity (a user's requests
always go to one engine). Each engine's own curve (the per-engine sampler, on its own stream) is shown to
read differently from the fleet's: it answers another question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvcompose.economics.fleet_merge import FleetMerger
from kvcompose.economics.fleet_samples import FleetSampler
from kvcompose.economics.shards import ReuseDistanceSampler
from kvcompose.economics.sizes import size_grid
from kvcompose.wire.fleet import parse_batch
from tests.test_economics_accuracy import exact_lru_hit_ratios

ENGINES = 16
RATE = 1 / 256  # the pipeline's default fleet.sample_rate
CAPACITY = 16384  # the shared tier's blocks: the grid advise reads runs around it
REQUESTS = 48_000
SECONDS_PER_REQUEST = 0.005  # the fleet's arrival rate: 200 requests/s
PULL_EVERY_S = 15.0
LATENESS_S = 30.0
MAX_MEAN_ABSOLUTE_ERROR = 0.03
SECRET = b"fleet secret of the simulation"


@dataclass(frozen=True)
class Fleet:
    requests: list[np.ndarray]  # block keys, root first, in arrival order
    engine_of: list[int]


def traffic(router: str, seed: int = 7) -> Fleet:
    """Shared system prompts, per-user prefixes (Zipf popular users), unique suffixes."""
    rng = np.random.default_rng(seed)

    def keys(count: int) -> np.ndarray:
        return rng.integers(0, np.iinfo(np.uint64).max, size=count, dtype=np.uint64, endpoint=True)

    prompts = [keys(16) for _ in range(6)]
    users = 3000
    prompt_of_user = rng.integers(0, len(prompts), size=users)
    user_prefixes = [keys(int(rng.integers(8, 48))) for _ in range(users)]
    weights = 1.0 / np.arange(1, users + 1) ** 0.9
    user_of = rng.choice(users, size=REQUESTS, p=weights / weights.sum())
    requests, engine_of = [], []
    for index, user in enumerate(user_of):
        requests.append(np.concatenate((prompts[prompt_of_user[user]], user_prefixes[user],
                                        keys(int(rng.integers(1, 8))))))
        engine_of.append(index % ENGINES if router == "round_robin" else int(user) % ENGINES)
    return Fleet(requests, engine_of)


def merged_fleet(fleet: Fleet, max_size_blocks: int) -> FleetMerger:
    clock = {"now": 0.0}
    samplers = [FleetSampler({"shared-disk": "disk"}, RATE, SECRET, 1 << 16, f"engine-{index}",
                             {"shared-disk": CAPACITY}, lambda: b"the same hash configuration",
                             clock=lambda: clock["now"]) for index in range(ENGINES)]
    merger = FleetMerger(max_size_blocks=max_size_blocks, lateness_s=LATENESS_S, half_life_s=None,
                         clock=lambda: clock["now"])
    order = list(range(ENGINES))
    shuffle = random.Random(3)
    next_pull = PULL_EVERY_S

    def pull_all() -> None:
        shuffle.shuffle(order)
        for index in order:
            target = f"http://engine-{index}"
            merger.add(target, parse_batch(samplers[index].batch(merger.cursor(target)).to_json()))
        merger.merge()

    for index, (request, engine) in enumerate(zip(fleet.requests, fleet.engine_of, strict=True)):
        clock["now"] = index * SECONDS_PER_REQUEST
        if clock["now"] >= next_pull:
            pull_all()
            next_pull += PULL_EVERY_S
        samplers[engine].record([int(key).to_bytes(8, "big") for key in request])
    pull_all()
    merger.merge(float("inf"))
    return merger


def own_curves(fleet: Fleet, sizes: list[int]) -> np.ndarray:
    """Each engine's own curve on its own stream, as its per-engine sampler estimates it."""
    samplers = [ReuseDistanceSampler(sizes[-1], half_life_s=None) for _ in range(ENGINES)]
    for request, engine in zip(fleet.requests, fleet.engine_of, strict=True):
        samplers[engine].record(request)
    return np.array([sampler.hit_ratio(sizes) for sampler in samplers])


@pytest.mark.parametrize("router", ["round_robin", "prefix_affinity"])
def test_the_merged_fleet_curve_matches_an_exact_lru_of_the_interleaved_stream(router: str, tmp_path: Path) -> None:
    fleet = traffic(router)
    merger = merged_fleet(fleet, size_grid([CAPACITY])[-1])
    sizes = merger.sizes("shared-disk")  # what the aggregator exports, and advise reads
    assert sizes[0] == 2048 and CAPACITY in sizes  # from 8 sampled slots at 1/256, to 8 times the capacity
    estimated = [ratio for _, ratio in merger.curve("shared-disk", sizes)]
    exact = np.array(exact_lru_hit_ratios(fleet.requests, sizes, tmp_path))
    error = np.abs(np.array(estimated) - exact)

    assert error.mean() <= MAX_MEAN_ABSOLUTE_ERROR, list(zip(sizes, estimated, exact, strict=True))
    state = merger.tiers["shared-disk"]
    assert state.references == sum(request.size for request in fleet.requests)  # every reference accounted
    assert 0.5 * RATE < state.sampled_references / state.references < 2 * RATE  # sampled, not replayed
    assert len(merger.engines_of("shared-disk")) == ENGINES and merger.late_requests == 0

    # The engines' own curves answer another question: each reads its own stream, not the tier's.
    own = own_curves(fleet, sizes)
    at_capacity = sizes.index(CAPACITY)
    gap = np.abs(own - exact).mean(axis=1)  # per engine, over the grid
    print(f"{router}: fleet MAE {error.mean():.4f} (max {error.max():.4f}); at {CAPACITY} blocks fleet exact "
          f"{exact[at_capacity]:.3f} estimated {estimated[at_capacity]:.3f}, engines' own "
          f"{own[:, at_capacity].min():.3f}..{own[:, at_capacity].max():.3f}; own vs fleet curve, mean abs "
          f"difference over the grid: {gap.min():.3f}..{gap.max():.3f}")
    assert gap.min() > 3 * error.mean()  # each engine's own curve is several times farther than the fleet's error
