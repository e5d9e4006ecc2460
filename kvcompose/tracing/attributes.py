"""Span names and attributes: ids, counts and timings only, never prompt content."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcompose.tracing import records

# Attribute keys.
CONNECTOR_NAME = "kvcompose.connector.name"
CONNECTOR_INDEX = "kvcompose.connector.index"
CONNECTOR_CLASS = "kvcompose.connector.class"
ROLE = "kvcompose.role"
PIPELINE = "kvcompose.pipeline"
REQUEST_ID = records.REQUEST_ID
COMPUTED_TOKENS = "kvcompose.tokens.computed"
MATCHED_TOKENS = "kvcompose.tokens.matched"
EXTERNAL_TOKENS = "kvcompose.tokens.external"
LOAD_ASYNC = "kvcompose.load.async"
SAVE_ASYNC = "kvcompose.save.async"
BLOCKS = "kvcompose.blocks"
LOADED_BY = "kvcompose.load.connector"
REQUESTS = "kvcompose.requests"
LAYER = "kvcompose.layer"
FINISHED_SENDING = "kvcompose.finished.sending"
FINISHED_RECVING = "kvcompose.finished.recving"
TRANSFER_DIRECTION = "kvcompose.transfer.direction"  # load | save
TRANSFER_BLOCKS = "kvcompose.transfer.blocks"
TRANSFER_BYTES = "kvcompose.transfer.bytes"
TRANSFER_OUTCOME = "kvcompose.transfer.outcome"  # ok | failed | aborted
ERROR_TYPE = records.ERROR_TYPE

SPAN_PREFIX = "kvcompose."


def span_name(operation: str) -> str:
    return SPAN_PREFIX + operation


def _lookup(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    tokens, load_async = result
    return args[1], bool(load_async), tokens  # tokens None: the child is still looking


def _after_alloc(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return (args[2],)


def _finished(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return len(args[1]), bool(result[0])


def _finished_all_groups(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return sum(len(group) for group in args[1]), bool(result[0])


def _transfer_results(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return len(result.finished_sending), len(result.finished_recving)


def _load_errors(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return (len(result),)


def _layer(args: tuple[Any, ...], result: Any) -> tuple[Any, ...]:
    return (args[0],)


# What a call's arguments and result say, per child operation: span attribute keys, and the
# function giving their values (a None value is left out).
RESULT_ATTRIBUTES: dict[str, tuple[tuple[str, ...], Callable[[tuple[Any, ...], Any], tuple[Any, ...]]]] = {
    "get_num_new_matched_tokens": ((COMPUTED_TOKENS, LOAD_ASYNC, MATCHED_TOKENS), _lookup),
    "update_state_after_alloc": ((EXTERNAL_TOKENS,), _after_alloc),
    "request_finished": ((BLOCKS, SAVE_ASYNC), _finished),
    "request_finished_all_groups": ((BLOCKS, SAVE_ASYNC), _finished_all_groups),
    "get_transfer_results": ((FINISHED_SENDING, FINISHED_RECVING), _transfer_results),
    "get_block_ids_with_load_errors": ((BLOCKS,), _load_errors),
    "save_kv_layer": ((LAYER,), _layer),
    "wait_for_layer_load": ((LAYER,), _layer),
}
