"""Load policies: which loader loads a request, given every loader's lookup answer.

The composite asks the loaders in pipeline order (``get_num_new_matched_tokens``),
as MultiConnector does, and hands their ``(tokens, load_async)`` answers to the
pipeline's policy, which returns the position of the loader chosen, or None
when no loader has tokens. (A loader still looking, ``None`` tokens, ends the
round before a policy is asked.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

LookupAnswer = tuple[int, bool]  # (tokens the loader can load, whether it loads them asynchronously)


def first_match(answers: Sequence[LookupAnswer]) -> int | None:
    """The first loader with tokens loads: MultiConnector's rule."""
    for position, (tokens, _) in enumerate(answers):
        if tokens > 0:
            return position
    return None


def longest_match(answers: Sequence[LookupAnswer]) -> int | None:
    """The loader with the most tokens loads; ties go to the earlier loader.

    Pays off when a later tier (a big disk or remote store) holds more of a
    prefix than an earlier, faster one that evicted part of it: loading the
    longer prefix saves more recompute than the faster tier saves in transfer.
    """
    chosen, most = None, 0
    for position, (tokens, _) in enumerate(answers):
        if tokens > most:
            chosen, most = position, tokens
    return chosen


LoadPolicy = Callable[[Sequence[LookupAnswer]], "int | None"]
POLICIES: dict[Literal["first_match", "longest_match"], LoadPolicy] = {
    "first_match": first_match,
    "longest_match": longest_match,
}
