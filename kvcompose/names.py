"""Span names and attribute keys, and how a failure is named: ids, counts and timings only, never prompt content.

Neutral: read by the operations, the composite's isolation and tracing alike.
"""

from __future__ import annotations

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
LOOKUP_DEFERRALS = "kvcompose.lookup.deferrals"  # the child's "ask again later" answers before this lookup
SAVE_ASYNC = "kvcompose.save.async"
BLOCKS = "kvcompose.blocks"
LOADED_BY = "kvcompose.load.connector"
LOADED_TOKENS = "kvcompose.tokens.loaded"
REQUESTS = "kvcompose.requests"
LAYER = "kvcompose.layer"
FINISHED_SENDING = "kvcompose.finished.sending"
FINISHED_RECVING = "kvcompose.finished.recving"
TRANSFER_SPAN = "kvcompose.transfer"  # transfer spans are named "kvcompose.transfer <direction> <child>"
TRANSFER_DIRECTION = "kvcompose.transfer.direction"  # load | save
TRANSFER_BLOCKS = "kvcompose.transfer.blocks"
TRANSFER_BYTES = "kvcompose.transfer.bytes"
TRANSFER_OUTCOME = "kvcompose.transfer.outcome"  # ok | failed | aborted
TRANSFER_COPY_SECONDS = "kvcompose.transfer.copy_seconds"
TRANSFER_COPY_SOURCE = "kvcompose.transfer.copy_source"  # child | calls
ERROR_TYPE = "error.type"  # OpenTelemetry's semantic convention for failures

SPAN_PREFIX = "kvcompose."


def span_name(operation: str) -> str:
    return SPAN_PREFIX + operation


def qualified_name(error_type: type[BaseException]) -> str:
    """``error.type`` of a failure: the class's qualified name (the message may quote request data)."""
    if error_type.__module__ == "builtins":
        return error_type.__qualname__
    return f"{error_type.__module__}.{error_type.__qualname__}"
