"""Real children that also write down what vLLM asked them and what they answered, for an independent count.

Each appends one JSON line per ``get_num_new_matched_tokens`` answer and per ``update_state_after_alloc``
call to the file its config names (``record``), so the count can be read back from an engine core running in
another process. Request ids and token counts only.

:class:`EventRecordingOffloadingConnector` writes down instead each KV event it hands vLLM (``take_events``), in
the order it hands them, to ``events_record`` under its ``label`` with the number of the ``take_events`` call
(one per step): the event's kind, medium, block count and a
digest of its msgpack encoding (the form vLLM's ZMQ publisher sends), never the block hashes themselves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector


class _RecordsAdmissions:
    """Writes each lookup answer and each allocation of a real connector (the next class in the MRO)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        self._record = Path(vllm_config.kv_transfer_config.kv_connector_extra_config["record"])

    def _write(self, call: str, request: Any, tokens: int | None) -> None:
        with self._record.open("a") as record:
            record.write(json.dumps({"call": call, "req": request.request_id, "tokens": tokens}) + "\n")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)  # type: ignore[misc]
        self._write("lookup", request, answer[0])
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._write("alloc", request, num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]


class RecordingExampleConnector(_RecordsAdmissions, ExampleConnector):
    pass


class RecordingOffloadingConnector(_RecordsAdmissions, OffloadingConnector):
    pass


def event_record(event: KVCacheEvent) -> dict[str, Any]:
    """What identifies a KV event exactly without writing its block hashes: the digest of its msgpack bytes."""
    return {"kind": type(event).__name__, "medium": event.medium, "blocks": len(event.block_hashes),
            "digest": hashlib.sha256(msgspec.msgpack.encode(event)).hexdigest()}


class EventRecordingOffloadingConnector(OffloadingConnector):
    """OffloadingConnector writing down each KV event it hands vLLM, in the order it hands them."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._events_record, self._label = Path(extra["events_record"]), extra["label"]
        self._takes = 0  # vLLM's calls of take_events: one per step

    def take_events(self) -> Iterable[KVCacheEvent]:
        self._takes += 1
        return self._recorded(super().take_events(), self._takes)

    def _recorded(self, events: Iterable[KVCacheEvent], take: int) -> Iterator[KVCacheEvent]:
        for event in events:
            with self._events_record.open("a") as record:
                record.write(json.dumps({"child": self._label, "take": take, **event_record(event)}) + "\n")
            yield event


def counted(path: Path) -> dict[str, int]:
    """What a child's record says kvcompose must count, once per request: at its first allocation, the answer
    of its last lookup before it (a hit if it held tokens: lookups, hits, matched tokens) and the tokens it was
    told to load; and how often vLLM asked (``asked``) and allocated (``allocations``) in all."""
    counts = dict.fromkeys(("lookups", "hits", "matched", "loaded", "asked", "allocations"), 0)
    last_answer: dict[str, int] = {}
    admitted: set[str] = set()
    for line in map(json.loads, path.read_text().splitlines()):
        req_id, tokens = line["req"], line["tokens"]
        if line["call"] == "lookup":
            counts["asked"] += 1
            if tokens is not None:  # None: ask again later
                last_answer[req_id] = tokens
            continue
        counts["allocations"] += 1
        if req_id in admitted:
            continue
        admitted.add(req_id)
        held = last_answer.get(req_id) or 0
        counts["lookups"] += 1
        counts["hits"] += held > 0
        counts["matched"] += held
        counts["loaded"] += tokens
    return counts
