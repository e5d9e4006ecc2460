"""The one reader of a Prometheus exposition (``/metrics``), in the classic text format or OpenMetrics.

``kvcompose top`` reads a live server's, ``kvcompose advise`` a saved one, and
the tests the ones their engines serve. Only the families asked for are
parsed: the OpenMetrics parser refuses a whole exposition for one family it
finds fault with, such as a vLLM counter whose name ends in ``_total``
(``vllm:kv_offload_total_bytes_total``). prometheus_client's parsers are
imported when an exposition is read, so the commands that read none never
load them. This module imports nothing of kvcompose's: any part can use it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

OPENMETRICS = "application/openmetrics-text"  # the content type of OpenMetrics, the format that carries exemplars
OURS = ("kvcompose_",)
_EOF = "# EOF"  # OpenMetrics' last line


class ExpositionError(ValueError):
    """The text is not a Prometheus exposition; the message is one line."""


@dataclass(frozen=True)
class Exposition:
    """The samples read from one exposition, by sample name (a histogram's ``_bucket``, ``_count``, ...)."""

    samples: dict[str, list[Sample]]

    def series(self, name: str, **labels: str) -> list[Sample]:
        """The samples called ``name`` whose labels include ``labels``."""
        return [s for s in self.samples.get(name, ()) if all(s.labels.get(k) == v for k, v in labels.items())]

    def total(self, name: str, **labels: str) -> float:
        """The sum of :meth:`series`: over the engines, models and other labels not given."""
        return sum(sample.value for sample in self.series(name, **labels))


def read(text: str, prefixes: tuple[str, ...] = OURS, *, untyped: tuple[str, ...] = (),
         openmetrics: bool | None = None) -> Exposition:
    """The samples of the families in ``text`` whose names start with one of ``prefixes``.

    ``untyped``: names of samples read without their family's TYPE, HELP and
    UNIT lines, for a family the parser refuses with them: in OpenMetrics,
    vLLM's prompt token counter keeps the colon of ``vllm:prompt_tokens`` in
    its TYPE line and writes ``vllm_prompt_tokens_total`` in its samples.
    ``openmetrics``: whether ``text`` is OpenMetrics (a server's content type
    says); by default, whether it ends with OpenMetrics' ``# EOF``.
    """
    lines = text.splitlines()
    if openmetrics is None:
        openmetrics = any(line.strip() == _EOF for line in lines[-3:])
    comments = tuple(f"# {kind} {prefix}" for kind in ("HELP", "TYPE", "UNIT") for prefix in prefixes)
    wanted = [line for line in lines if line.startswith(prefixes + untyped) or line.startswith(comments)]
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families  # type: ignore[assignment]
    samples: dict[str, list[Sample]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families("\n".join([*wanted, _EOF] if openmetrics else wanted) + "\n"):
            for sample in family.samples:
                samples[sample.name].append(sample)
    except ValueError as error:
        raise ExpositionError(f"not a Prometheus exposition: {str(error)[:120]}") from None
    return Exposition(dict(samples))


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram's cumulative ``(upper bound, count)`` buckets, as Prometheus'
    histogram_quantile computes it: linear inside the bucket that holds it, the highest finite bound when it
    falls in the +Inf bucket; None when the histogram counted nothing."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
