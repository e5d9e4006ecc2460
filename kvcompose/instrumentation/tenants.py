"""The scheduler's books by tenant: who each admitted request is for, and which tenants get a label of their own.

At a request's first admission its tenant (kvcompose.wire.tenants) is
labelled, and its prompt tokens and the tokens a child was chosen to load for
it are counted under that label, where the pipeline-wide counters count them.
So, summed over the labels, each tenant series equals the pipeline-wide one.

Bounded cardinality. A Space-Saving sketch (kvcompose.heavy_hitters) of
:data:`SKETCH_PER_LABEL` counters per label weighs tenants by prompt tokens
over a decaying window (``tenants.half_life_s``). The ``tenants.top_k``
heaviest keep a label of their own; every other tenant counts as ``other``
(``none`` and ``invalid`` always show as themselves). The top is taken again
with every report (at most every :data:`REPORT_EVERY_S`, and as the engine
goes idle): a tenant that fell out is folded into ``other``, in the
reuse-distance sampler too; while fewer than K tenants are labelled, a new
one gets a label at once.
"""

from __future__ import annotations

from time import monotonic
from typing import TYPE_CHECKING

from kvcompose.heavy_hitters import HeavyHitters
from kvcompose.wire.tenants import (
    OTHER,
    RESERVED,
    TenantReport,
    tenant_label,
    tenant_value,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvcompose.config import TenantsSection
    from kvcompose.instrumentation.economics import StreamSampler

REPORT_EVERY_S = 5.0
# Space-Saving's counters per label: with 16 K counters any tenant with over 1/(16 K) of the window's prompt
# tokens holds one, so the K-th heaviest stands well clear of the smallest counter on a skewed stream.
SKETCH_PER_LABEL = 16
MIN_SKETCH = 256


def lora_name(request: Request) -> str | None:
    """The name of the request's LoRA adapter, if it has one."""
    lora = getattr(request, "lora_request", None)
    return getattr(lora, "lora_name", None) if lora is not None else None


class TenantBooks:
    """See the module docstring. ``stream``: the reuse-distance sampler that attributes references to tenants
    (None: no curves)."""

    def __init__(self, settings: TenantsSection, stream: StreamSampler | None) -> None:
        self.top_k = settings.top_k
        self._sketch = HeavyHitters(max(SKETCH_PER_LABEL * self.top_k, MIN_SKETCH), settings.half_life_s)
        self._stream = stream
        self._labelled: set[str] = set()
        self._labels_changed = True  # the front-end learns the labelled set with the first report
        self._report = TenantReport()
        self._ranked_at = -REPORT_EVERY_S

    def admitted(self, request: Request) -> str:
        """A request's first admission: count its prompt; the label it counts under."""
        label = tenant_label(tenant_value(request.kv_transfer_params, lora_name(request)))
        prompt_tokens = request.num_prompt_tokens
        if label not in RESERVED:
            self._sketch.add(label, prompt_tokens)
            if label not in self._labelled:
                if len(self._labelled) < self.top_k:
                    self._labelled.add(label)
                    self._labels_changed = True
                else:
                    label = OTHER
        self._report.admitted(label, prompt_tokens)
        return label

    def loaded(self, tenant: str, child: str, tokens: int) -> None:
        """``child`` was chosen to load ``tokens`` tokens for a request of ``tenant`` (its label)."""
        self._report.loaded(tenant, child, tokens)

    @property
    def labelled(self) -> frozenset[str]:
        return frozenset(self._labelled)

    def report(self, now: bool = False) -> TenantReport | None:
        """The counts since the last report; the labelled set when it changed; the curves (and a new top) at
        most every :data:`REPORT_EVERY_S` unless ``now``. None: nothing to report."""
        report = self._report
        if now or (at := monotonic()) - self._ranked_at >= REPORT_EVERY_S:
            self._ranked_at = monotonic() if now else at
            self._rank()
            if self._stream is not None and (curves := self._stream.tenant_curves()):
                report.curves = curves
        if self._labels_changed:
            report.labelled, self._labels_changed = sorted(self._labelled), False
        if report.is_empty():
            return None
        self._report = TenantReport()
        return report

    def _rank(self) -> None:
        """Take the top K again: tenants that fell out count as ``other`` from now on."""
        top = {str(tenant) for tenant in self._sketch.top(self.top_k)}
        if top == self._labelled:
            return
        if self._stream is not None:
            for gone in self._labelled - top:
                self._stream.merge_tenant(gone, OTHER)
        self._labelled, self._labels_changed = top, True
