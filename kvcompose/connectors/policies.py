"""Load policies: which child loads a request, given every loader's lookup.

A policy asks the loaders in pipeline order (``get_num_new_matched_tokens``)
and returns the :class:`LoadChoice`. A lookup that answers ``None`` tokens means
"still looking": the policy stops asking and the whole answer is ``None``, as
vLLM's MultiConnector does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvcompose.connectors.children import Child

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True, slots=True)
class LoadChoice:
    num_tokens: int | None  # None: a child is still looking; ask again later
    load_async: bool = False
    child_index: int | None = None  # the chosen child; None when nothing loads


STILL_LOOKING = LoadChoice(None)
NOTHING_TO_LOAD = LoadChoice(0)


def first_match(loaders: Sequence[Child], request: Request, num_computed_tokens: int) -> LoadChoice:
    """The first child with tokens loads. Every loader is still asked (as
    MultiConnector does), so each sees the request's lookup."""
    choice = NOTHING_TO_LOAD
    for child in loaders:
        num_tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
        if num_tokens is None:
            return STILL_LOOKING
        if choice.child_index is None and num_tokens > 0:
            choice = LoadChoice(num_tokens, load_async, child.index)
    return choice


def longest_match(loaders: Sequence[Child], request: Request, num_computed_tokens: int) -> LoadChoice:
    """The child with the most tokens loads; ties go to the earlier child.

    Pays off when a later tier (a big disk or remote store) holds more of a
    prefix than an earlier, faster one that evicted part of it: loading the
    longer prefix saves more recompute than the faster tier saves in transfer.
    """
    choice = NOTHING_TO_LOAD
    for child in loaders:
        num_tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
        if num_tokens is None:
            return STILL_LOOKING
        if num_tokens > (choice.num_tokens or 0):
            choice = LoadChoice(num_tokens, load_async, child.index)
    return choice


LoadPolicy = Callable[[Sequence[Child], "Request", int], LoadChoice]
POLICIES: dict[Literal["first_match", "longest_match"], LoadPolicy] = {
    "first_match": first_match,
    "longest_match": longest_match,
}
