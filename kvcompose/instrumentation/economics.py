"""Tier economics, measured where the engine works: the prefix-block stream and the cost of prefill.

Scheduler side (:class:`StreamSampler`): each admitted request's block hashes
(``Request.block_hashes``, computed by vLLM already) go to a SHARDS sampler
(kvcompose.economics.shards) once, at the request's first admission. Every
:data:`REPORT_EVERY_S` the scheduler reports the estimated hit ratio of an LRU
cache at each size of a grid (powers of two, the GPU cache's size and each
tier's), and each tier's write waste; its first report adds the capacities
(the GPU cache's blocks, and a tier's where its config says: vLLM's
OffloadingConnector and kvcompose's CPU spec) and the bytes of a block.

Worker side (:class:`PrefillCost`): the engine's cost of prefilling a token,
from what the worker sees of each step: the time from binding a step's
metadata to clearing it (its forward pass) less its children's blocking calls
(engine wait, when the step is observed), over the prompt tokens the step
prefills (the scheduler counts them into the metadata). Steps that prefill
fewer than :data:`MIN_PREFILL_TOKENS` say too little and are left out; the
estimate is an exponential moving average of the others, so it follows the
engine's load. It includes the decode tokens those steps carry, so it reads
a little high when prefills are mixed with many decodes.
"""

from __future__ import annotations

import math
from time import monotonic
from typing import TYPE_CHECKING, Any

from kvcompose.economics.sizes import bytes_to_blocks, size_grid, tier_reaches
from kvcompose.economics.shards import ReuseDistanceSampler
from kvcompose.metrics.economics import GPU, EconomicsReport

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvcompose.connectors.children import ChildSpec

REPORT_EVERY_S = 5.0
MIN_PREFILL_TOKENS = 16
COST_SMOOTHING = 0.1  # weight of a new step in the prefill cost's moving average


def tier_capacity_blocks(spec: ChildSpec, block_bytes: int) -> int | None:
    """The engine blocks a child holds, where its config says (None: unknown): vLLM's OffloadingConnector,
    with vLLM's CPU spec or kvcompose's, holds ``cpu_bytes_to_use`` bytes across the engine's workers."""
    if spec.class_name != "OffloadingConnector" or block_bytes <= 0:
        return None
    cpu_bytes = spec.config.config.get("cpu_bytes_to_use")
    try:
        return bytes_to_blocks(int(cpu_bytes), block_bytes) if cpu_bytes is not None else None
    except (TypeError, ValueError):  # `kvcompose validate` names a malformed value
        return None


class StreamSampler:
    """The scheduler's sampler of the prefix-block stream, and what it reports; see the module docstring."""

    def __init__(self, specs: list[ChildSpec], loaders: tuple[int, ...], gpu_blocks: int, block_bytes: int) -> None:
        self._capacities = {spec.name: blocks for spec in specs
                            if (blocks := tier_capacity_blocks(spec, block_bytes)) is not None}
        reaches = tier_reaches(gpu_blocks, [self._capacities.get(specs[index].name) for index in loaders])
        self._reaches = {specs[index].name: reach for index, reach in zip(loaders, reaches, strict=True)
                         if reach is not None}
        self._grid = size_grid([gpu_blocks, *self._capacities.values(),
                                *(reach.end for reach in self._reaches.values())])
        self._sampler = ReuseDistanceSampler(self._grid[-1], reaches=list(self._reaches.values()))
        self._static: dict[str, Any] | None = {
            "capacities": {**self._capacities, GPU: gpu_blocks}, "block_bytes": block_bytes}
        self._next_report = 0.0

    def admitted(self, request: Request) -> None:
        """A request's first admission: its blocks are referenced."""
        if block_hashes := getattr(request, "block_hashes", None):
            self._sampler.record_hashes(block_hashes)

    def report(self) -> EconomicsReport | None:
        """What to report now: None until :data:`REPORT_EVERY_S` passed since the last report."""
        if (now := monotonic()) < self._next_report:
            return None
        self._next_report = now + REPORT_EVERY_S
        report = EconomicsReport(**(self._static or {}))
        self._static = None
        if self._sampler.references > 0:
            report.curve = [[size, ratio] for size, ratio in zip(self._grid, self._sampler.hit_ratio(self._grid),
                                                                  strict=True)]
            waste = {name: self._sampler.write_waste(reach) for name, reach in self._reaches.items()}
            report.write_waste = {name: share for name, share in waste.items() if not math.isnan(share)} or None
        return None if report.is_empty() else report


class PrefillCost:
    """The worker's estimate of the engine's prefill cost per token; see the module docstring."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None
        self._reported: float | None = None
        self._next_report = 0.0

    def step_ended(self, seconds: float, prefill_tokens: int) -> None:
        """A step that prefilled ``prefill_tokens`` took ``seconds`` of forward pass."""
        if prefill_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        cost = seconds / prefill_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = cost if previous is None else previous + COST_SMOOTHING * (cost - previous)

    def report(self) -> EconomicsReport | None:
        """The estimate, at most every :data:`REPORT_EVERY_S` and when it changed."""
        if self.seconds_per_token is None or self.seconds_per_token == self._reported or (
                now := monotonic()) < self._next_report:
            return None
        self._next_report, self._reported = now + REPORT_EVERY_S, self.seconds_per_token
        return EconomicsReport(prefill_seconds_per_token=self.seconds_per_token)
