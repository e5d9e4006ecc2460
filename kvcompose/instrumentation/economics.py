"""Tier economics, measured where the engine works: the prefix-block stream and the cost of prefill.

Scheduler side (:class:`StreamSampler`): each admitted request's block hashes
(``Request.block_hashes``, computed by vLLM already) go to a SHARDS sampler
(kvcompose.economics.shards) once, at the request's first admission. Every
:data:`REPORT_EVERY_S` while blocks are referenced, and as the engine goes
idle after blocks were referenced (an idle engine takes no stats, so what is
not reported then would wait for the next request), the scheduler reports
the estimated hit ratio of
an LRU cache at each size of a grid (powers of two, the GPU cache's size and
each tier's), and each tier's write waste; its first report adds the
capacities (the GPU cache's blocks, and a tier's where its config says:
vLLM's OffloadingConnector and kvcompose's CPU spec), each loading tier's
reach (kvcompose.economics.sizes) and the bytes of a block. With vLLM's
prefix caching off the GPU cache serves no prefix hits: its capacity is
reported as 0 blocks, and the tiers' reaches start at 0.

Where children name a tier the engine shares with others (``shared``), the
same block hashes also go to a :class:`~kvcompose.economics.fleet_samples.FleetSampler`
at the fleet's fixed rate, served to ``kvcompose fleet`` by the engine's fleet
endpoint (:func:`fleet_sampling`).

Worker side (:class:`PrefillCost`): the engine's marginal cost of prefilling
a token, fitted to the steps that prefill (a step that only decodes says
nothing of the prefill slope, and where requests come one at a time it would
make the prefill and decode counts move together, so that no slope could be
told). A step's forward pass, from binding its metadata to clearing it, less
its children's blocking calls, is modelled as a fixed cost plus a cost per
prefill token plus a cost per decode token (the scheduler counts both into the
metadata), by least squares over the steps, exponentially weighted so the fit
follows the engine's load. A load saves its tokens' compute, not the step's
fixed cost (scheduling, sampling, launching the model): the prefill slope is
what a loaded token is worth. Seconds over tokens would charge the fixed cost
to the tokens, and on a small model, where the fixed cost is most of a step,
would price a load at many times what it saves. A step far off the fit (the
host was busy, a pause) is left out, so the fit follows the typical step. Until the steps' prefill
sizes vary enough to tell the slope from the fixed cost, there is no estimate; nor while the slope is
not above zero: a bigger prefill never costs less, so such a slope is the steps' timing noise (on a
busy host a stall of milliseconds beside a small model's microseconds a token), not a price. A cost of
0 would price every load at nothing for good (the front-end prices a load at the cost it knows then),
where no estimate leaves the loads to be priced once there is one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any, NamedTuple

from kvcompose.economics.fleet_endpoint import FleetEndpoint
from kvcompose.economics.fleet_samples import FleetSampler
from kvcompose.economics.shards import ReuseDistanceSampler
from kvcompose.economics.sizes import bytes_to_blocks, size_grid, tier_reaches
from kvcompose.logs import get_logger
from kvcompose.wire.economics import GPU, EconomicsReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from kvcompose.child_spec import ChildSpec
    from kvcompose.config import FleetSection

_log = get_logger("economics")

REPORT_EVERY_S = 5.0
# The prefill cost's fit: a step's weight halves over this many later steps. It needs this many steps'
# weight, and the steps' prefill sizes to spread (a standard deviation the decodes do not explain) by this
# many tokens and this share of their mean.
HALF_LIFE_STEPS = 500
STEP_DECAY = 0.5 ** (1 / HALF_LIFE_STEPS)
MIN_STEPS = 8
MIN_PREFILL_SPREAD_TOKENS = 16
MIN_PREFILL_SPREAD = 0.1
# A step further off the fit than this many times the steps' mean deviation from it, and than this share of
# its fitted time, is left out.
OUTLIER_DEVIATIONS = 3.0
OUTLIER_MIN_SHARE = 0.05


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


class FleetSampling(NamedTuple):
    """An engine's samples for its shared tiers, and the endpoint serving them."""

    sampler: FleetSampler
    endpoint: FleetEndpoint


def fleet_sampling(section: FleetSection, specs: list[ChildSpec], vllm_config: VllmConfig, engine_id: str,
                   block_bytes: int) -> FleetSampling | None:
    """The engine's fleet sampler and endpoint when a child names a shared tier; None (and a warning saying
    why) when none does, or when the fleet's secret is not set or the endpoint cannot listen: generation goes
    on either way."""
    tiers = {spec.config.shared: spec.name for spec in specs if spec.config.shared is not None}
    if not tiers:
        return None
    secret = os.environ.get(section.secret_env, "")
    if not secret:
        _log.warning("fleet_sampling_off", reason=f"${section.secret_env} is not set: without the fleet's secret "
                     "no digest of a block may leave the engine", tiers=sorted(tiers))
        return None
    capacities = {tier: blocks for spec in specs if (tier := spec.config.shared) is not None
                  and (blocks := tier_capacity_blocks(spec, block_bytes)) is not None}
    sampler = FleetSampler(tiers, section.sample_rate, secret.encode(), section.buffer_samples, engine_id,
                           capacities, hash_configuration(vllm_config))
    port = section.port + vllm_config.parallel_config.data_parallel_rank if section.port else 0
    try:
        endpoint = FleetEndpoint(sampler, section.host, port)
    except OSError as error:
        _log.warning("fleet_sampling_off", reason=f"the fleet endpoint cannot listen on {section.host}:{port}: "
                     f"{error.strerror or error}", tiers=sorted(tiers))
        return None
    _log.info("fleet_endpoint_listening", host=section.host, port=endpoint.port, tiers=sorted(tiers))
    return FleetSampling(sampler, endpoint)


def hash_configuration(vllm_config: VllmConfig) -> Callable[[], bytes | None]:
    """What makes two engines' block hashes agree, as bytes, once vLLM has set its root parent hash: the hash
    algorithm, the block size, and ``NONE_HASH`` (derived from PYTHONHASHSEED, or from a fixed seed for a
    cryptographic algorithm, or from a random one per process for xxHash)."""
    cache = vllm_config.cache_config
    algorithm = str(getattr(cache, "prefix_caching_hash_algo", ""))

    def material() -> bytes | None:
        from vllm.v1.core import kv_cache_utils

        root = getattr(kv_cache_utils, "NONE_HASH", None)
        return None if root is None else f"{algorithm}\x00{cache.block_size}\x00".encode() + bytes(root)

    return material


class StreamSampler:
    """The scheduler's sampler of the prefix-block stream, and what it reports; see the module docstring."""

    def __init__(self, specs: list[ChildSpec], loaders: tuple[int, ...], prefix_cache_blocks: int,
                 block_bytes: int, fleet: FleetSampling | None = None) -> None:
        """``loaders``: the indices of the children that load, in the order they are asked;
        ``prefix_cache_blocks``: the GPU cache's blocks, or 0 when it serves no prefix hits (prefix caching off);
        ``fleet``: the samples for the tiers shared with other engines, if any."""
        self.fleet = fleet
        self._capacities = {spec.name: blocks for spec in specs
                            if (blocks := tier_capacity_blocks(spec, block_bytes)) is not None}
        reaches = tier_reaches(prefix_cache_blocks, [self._capacities.get(specs[index].name) for index in loaders])
        self._reaches = {specs[index].name: reach for index, reach in zip(loaders, reaches, strict=True)
                         if reach is not None}
        self._grid = size_grid([prefix_cache_blocks, *self._capacities.values(),
                                *(reach.end for reach in self._reaches.values())])
        self._sampler = ReuseDistanceSampler(self._grid[-1], reaches=list(self._reaches.values()))
        self._static: dict[str, Any] | None = {
            "capacities": {**self._capacities, GPU: prefix_cache_blocks}, "block_bytes": block_bytes,
            "reaches": {name: [reach.start, reach.end] for name, reach in self._reaches.items()}}
        self._reported_at = -math.inf
        self._reported_references = 0

    def admitted(self, request: Request, tenant: str | None = None) -> None:
        """A request's first admission: its blocks are referenced (by ``tenant``, where tenants are counted)."""
        if block_hashes := getattr(request, "block_hashes", None):
            self._sampler.record_hashes(block_hashes, tenant=tenant)
            if self.fleet is not None:
                self.fleet.sampler.record(block_hashes)

    def tenant_curves(self) -> dict[str, list[list[float]]]:
        """Each tenant's estimated hit ratio at each size of the grid, in the cache all tenants share (tenants
        with references in the window)."""
        curves = {}
        for tenant in self._sampler.tenants:
            ratios = self._sampler.hit_ratio(self._grid, tenant=tenant)
            if not math.isnan(ratios[0]):
                curves[str(tenant)] = [[size, ratio] for size, ratio in zip(self._grid, ratios, strict=True)]
        return curves

    def merge_tenant(self, tenant: str, into: str) -> None:
        """Count ``tenant``'s references as ``into``'s (it lost its label)."""
        self._sampler.merge_tenant(tenant, into)

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.endpoint.close()

    def report(self, now: bool = False) -> EconomicsReport | None:
        """What to report: None when no block was referenced since the last report, or (unless ``now``, as the
        engine goes idle) until :data:`REPORT_EVERY_S` passed since it."""
        references = self._sampler.stream_references
        at = monotonic()
        if (self._static is None and references == self._reported_references) or (
                not now and at - self._reported_at < REPORT_EVERY_S):
            return None
        self._reported_at, self._reported_references = at, references
        report = EconomicsReport(**(self._static or {}))
        self._static = None
        if self._sampler.references > 0:
            report.curve = [[size, ratio] for size, ratio in zip(self._grid, self._sampler.hit_ratio(self._grid),
                                                                  strict=True)]
            waste = {name: self._sampler.write_waste(reach) for name, reach in self._reaches.items()}
            report.write_waste = {name: share for name, share in waste.items() if not math.isnan(share)} or None
        return None if report.is_empty() else report


class StepCost(NamedTuple):
    """A fitted step: ``fixed + per_prefill_token * prefill tokens + per_decode * decodes`` seconds."""

    fixed: float
    per_prefill_token: float
    per_decode: float

    def of(self, prefill_tokens: int, decode_tokens: int) -> float:
        return self.fixed + self.per_prefill_token * prefill_tokens + self.per_decode * decode_tokens


class PrefillCost:
    """The worker's fit of the engine's prefill cost per token; see the module docstring."""

    def __init__(self) -> None:
        # Exponentially weighted sums over the steps, with p the prefill tokens, d the decode tokens and y the
        # forward seconds: weight, p, d, y, p*p, d*d, p*d, p*y, d*y.
        self._sums = [0.0] * 9
        # The steps' typical distance from the fit (weighted mean of |residual|) and that mean's weight.
        self._deviation = self._deviation_weight = 0.0
        self._reported: float | None = None
        self._next_report = 0.0

    def step_ended(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """A step that computed ``prefill_tokens`` prompt tokens and ``decode_tokens`` decodes took ``seconds``
        of forward pass."""
        if seconds <= 0 or prefill_tokens + decode_tokens <= 0:
            return
        p, d, y = prefill_tokens, decode_tokens, seconds
        if (fit := self.fit()) is not None:
            # A step far off the fit (the host was busy, a pause) is left out of it. It still widens the
            # spread, by as much as a step at its edge, so a lasting change in the engine's cost gets in.
            predicted = fit.of(p, d)
            distance = abs(y - predicted)
            outlier = False
            if self._deviation_weight >= MIN_STEPS:
                edge = max(OUTLIER_DEVIATIONS * self._deviation / self._deviation_weight,
                           OUTLIER_MIN_SHARE * abs(predicted))
                outlier, distance = distance > edge, min(distance, edge)
            self._deviation = self._deviation * STEP_DECAY + distance
            self._deviation_weight = self._deviation_weight * STEP_DECAY + 1.0
            if outlier:
                return
        sums = self._sums
        for index, value in enumerate((1.0, p, d, y, p * p, d * d, p * d, p * y, d * y)):
            sums[index] = sums[index] * STEP_DECAY + value

    def fit(self) -> StepCost | None:
        """The steps' fitted cost; None until their prefill sizes tell its parts apart."""
        weight, p, d, y, pp, dd, pd, py, dy = self._sums
        if weight < MIN_STEPS:
            return None
        mean_p, mean_d, mean_y = p / weight, d / weight, y / weight
        var_p, var_d = pp / weight - mean_p * mean_p, dd / weight - mean_d * mean_d
        cov_pd = pd / weight - mean_p * mean_d
        cov_py, cov_dy = py / weight - mean_p * mean_y, dy / weight - mean_d * mean_y
        if var_d > 0:  # the prefill sizes' spread that the decodes do not explain
            spread, slope_cov = var_p - cov_pd * cov_pd / var_d, cov_py - cov_pd * cov_dy / var_d
        else:
            spread, slope_cov = var_p, cov_py
        if spread < max(MIN_PREFILL_SPREAD_TOKENS, MIN_PREFILL_SPREAD * mean_p) ** 2:
            return None
        per_prefill_token = slope_cov / spread
        per_decode = (cov_dy - per_prefill_token * cov_pd) / var_d if var_d > 0 else 0.0
        return StepCost(mean_y - per_prefill_token * mean_p - per_decode * mean_d, per_prefill_token, per_decode)

    @property
    def seconds_per_token(self) -> float | None:
        """The fitted prefill cost per token; None while the fit has none above zero."""
        fit = self.fit()
        return fit.per_prefill_token if fit is not None and fit.per_prefill_token > 0 else None

    def report(self, now: bool = False) -> EconomicsReport | None:
        """The estimate when it changed, at most every :data:`REPORT_EVERY_S` (unless ``now``)."""
        if (((at := monotonic()) < self._next_report and not now) or (cost := self.seconds_per_token) is None
                or cost == self._reported):
            return None
        self._next_report, self._reported = at + REPORT_EVERY_S, cost
        return EconomicsReport(prefill_seconds_per_token=cost)
