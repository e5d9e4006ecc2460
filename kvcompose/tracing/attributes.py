"""Span names and attributes: ids, counts and timings only, never prompt content."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# Attribute keys.
CONNECTOR_NAME = "kvcompose.connector.name"
CONNECTOR_INDEX = "kvcompose.connector.index"
CONNECTOR_CLASS = "kvcompose.connector.class"
ROLE = "kvcompose.role"
PIPELINE = "kvcompose.pipeline"
REQUEST_ID = "gen_ai.request.id"  # the key vLLM's own request spans use
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
ERROR_TYPE = "error.type"  # OpenTelemetry's semantic convention for failures

SPAN_PREFIX = "kvcompose."


def span_name(operation: str) -> str:
    return SPAN_PREFIX + operation


def _lookup(args: tuple[Any, ...], result: Any) -> Mapping[str, Any]:
    tokens, load_async = result
    attributes: dict[str, Any] = {COMPUTED_TOKENS: args[1], LOAD_ASYNC: bool(load_async)}
    if tokens is not None:  # None: the child is still looking
        attributes[MATCHED_TOKENS] = tokens
    return attributes


def _after_alloc(args: tuple[Any, ...], result: Any) -> Mapping[str, Any]:
    return {EXTERNAL_TOKENS: args[2]}


def _finished(args: tuple[Any, ...], result: Any) -> Mapping[str, Any]:
    return {BLOCKS: len(args[1]), SAVE_ASYNC: bool(result[0])}


def _finished_all_groups(args: tuple[Any, ...], result: Any) -> Mapping[str, Any]:
    return {BLOCKS: sum(len(group) for group in args[1]), SAVE_ASYNC: bool(result[0])}


def _transfer_results(args: tuple[Any, ...], result: Any) -> Mapping[str, Any]:
    return {FINISHED_SENDING: len(result.finished_sending), FINISHED_RECVING: len(result.finished_recving)}


def _load_errors(args: tuple[Any, ...], result: Any) -> Mapping[str, Any]:
    return {BLOCKS: len(result)}


def _layer(args: tuple[Any, ...], result: Any) -> Mapping[str, Any]:
    return {LAYER: args[0]}


# What a call's arguments and result say, per child operation, as span attributes.
RESULT_ATTRIBUTES: dict[str, Callable[[tuple[Any, ...], Any], Mapping[str, Any]]] = {
    "get_num_new_matched_tokens": _lookup,
    "update_state_after_alloc": _after_alloc,
    "request_finished": _finished,
    "request_finished_all_groups": _finished_all_groups,
    "get_transfer_results": _transfer_results,
    "get_block_ids_with_load_errors": _load_errors,
    "save_kv_layer": _layer,
    "wait_for_layer_load": _layer,
}
