"""Which requests are traced, decided once per request in the engine.

The decision follows OpenTelemetry's samplers without building SDK objects:
a request that carries a W3C ``traceparent`` follows its caller's sampled flag
(parent-based); one without is sampled by its trace id against a ratio, so
every process of an engine agrees on the same request.

Which setting wins: the pipeline's ``tracing.sample_ratio`` when it is set;
otherwise ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``; otherwise
every request is traced (``parentbased_always_on``, the SDK's default).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from kvcompose.logs import get_logger

logger = get_logger("tracing")

_TRACE_ID_LOW_BITS = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    parent_based: bool  # a request's caller decides when it sent a traceparent
    root_ratio: float  # share of the other requests that are traced
    # TraceIdRatioBased's rule: a root is sampled when the low 64 bits of its trace id are under
    # ratio * 2^64; kept as an int, as comparing an int with a float costs more.
    _bound: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bound", math.ceil(self.root_ratio * (1 << 64)))

    def sampled(self, trace_id: int, parent_sampled: bool | None) -> bool:
        """``parent_sampled``: the caller's flag, or None when the request has no traceparent."""
        if self.parent_based and parent_sampled is not None:
            return parent_sampled
        return (trace_id & _TRACE_ID_LOW_BITS) < self._bound


_ENV_SAMPLERS = {
    "always_on": (False, None),
    "always_off": (False, 0.0),
    "traceidratio": (False, "arg"),
    "parentbased_always_on": (True, None),
    "parentbased_always_off": (True, 0.0),
    "parentbased_traceidratio": (True, "arg"),
}


def sampling_for(sample_ratio: float | None, environ: dict[str, str] | None = None) -> Sampling:
    """The pipeline's ratio (parent-based) if set, else the standard OTEL_TRACES_SAMPLER variables."""
    if sample_ratio is not None:
        return Sampling(parent_based=True, root_ratio=sample_ratio)
    env = os.environ if environ is None else environ
    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if name not in _ENV_SAMPLERS:
        logger.warning("unsupported OTEL_TRACES_SAMPLER; tracing every request", sampler=name[:40],
                       supported=sorted(_ENV_SAMPLERS))
        return Sampling(parent_based=True, root_ratio=1.0)
    parent_based, ratio = _ENV_SAMPLERS[name]
    if ratio == "arg":
        ratio = _ratio_arg(env.get("OTEL_TRACES_SAMPLER_ARG"))
    return Sampling(parent_based=parent_based, root_ratio=1.0 if ratio is None else ratio)


def _ratio_arg(value: str | None) -> float:
    try:
        ratio = float(value) if value is not None else 1.0
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        logger.warning("OTEL_TRACES_SAMPLER_ARG is not a ratio in [0, 1]; using 1.0", value=str(value)[:40])
        return 1.0
    return ratio
