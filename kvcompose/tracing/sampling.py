"""Which requests are traced, decided once per request in the engine.

OpenTelemetry's own samplers decide, through their public ``should_sample``:
a request that carries a W3C ``traceparent`` follows its caller's sampled flag
(``ParentBased``); one without is sampled by its trace id against a ratio
(``TraceIdRatioBased``), so every process of an engine, and vLLM's own
tracer with the same settings, agree on the same request.

Which setting wins: the pipeline's ``tracing.sample_ratio`` when it is set;
otherwise ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``; otherwise
every request is traced (``parentbased_always_on``, the SDK's default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvcompose.logs import get_logger

logger = get_logger("tracing")

SPAN_NAME = "kvcompose.request"  # the span the decision is for


def _caller(sampled: bool) -> Context:
    """A remote caller's span as ``ParentBased`` reads it: only its sampled flag enters the decision, not its
    ids (placeholders here)."""
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return trace.set_span_in_context(NonRecordingSpan(SpanContext(1, 1, is_remote=True, trace_flags=flags)))


_CALLERS = {True: _caller(True), False: _caller(False)}
# A request without a caller is a root, whatever span is current on the thread that decides (``None`` would make
# ParentBased follow the thread's current span: vLLM's own, or a caller's of another request).
_ROOT = Context()


@dataclass(frozen=True)
class Sampling:
    parent_based: bool  # a request's caller decides when it sent a traceparent
    root_ratio: float  # share of the other requests that are traced
    _sampler: Sampler = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ratio = TraceIdRatioBased(self.root_ratio)
        object.__setattr__(self, "_sampler", ParentBased(ratio) if self.parent_based else ratio)

    def sampled(self, trace_id: int, parent_sampled: bool | None) -> bool:
        """``parent_sampled``: the caller's flag, or None when the request has no traceparent."""
        caller = _ROOT if parent_sampled is None else _CALLERS[parent_sampled]
        return self._sampler.should_sample(caller, trace_id, SPAN_NAME).decision.is_sampled()


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
