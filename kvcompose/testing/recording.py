"""RecordingConnector: a scripted child that logs every call it receives.

Used to compare KVComposeConnector with vLLM's MultiConnector call by call.
Its ``kv_connector_extra_config`` holds ``log`` (the key of its call log in
:data:`CALL_LOGS`) and ``script`` (plain data saying what it answers):

- ``matches``: ``{request_id: [[tokens_or_None, load_async], ...]}``, one per lookup, last repeats
- ``async_saves``: request ids whose ``request_finished`` returns True
- ``params``: ``{request_id: {kv_transfer_params}}``
- ``finished_sending`` / ``finished_recving`` / ``failed_recving``: a list of
  request-id lists, one per ``get_transfer_results`` call
- ``load_errors``: block ids reported by ``get_block_ids_with_load_errors``
- ``handshake``: a value for ``get_handshake_metadata`` (None by default)
- ``mem_pool``: ``get_mem_pool_context`` returns a (do-nothing) context, as a child owning the KV cache
  memory pool does
- ``worker_meta``: send worker metadata from ``build_connector_worker_meta``
- ``fail_shutdown``: raise from ``shutdown``
- ``raises``: method names that raise :class:`ScriptedFailure` (after being logged)
- ``reset_cache``: what ``reset_cache`` returns (default True)
- ``events``: block-hash lists; ``take_events`` returns a generator of a
  ``BlockRemoved`` event per list, as OffloadingConnector's is a generator
- ``events_fail_after``: that generator raises :class:`ScriptedFailure` after yielding this many
- ``gates``: ``{method: key}``: a call of ``method`` waits, once logged, until the
  :class:`Gate` at ``GATES[key]`` is opened (to hold a call while another thread calls)
- ``sleep_mode``: what the class's ``supports_sleep_mode`` answers for this config (default True)
- ``label``: logged with the sleep-mode calls, to tell apart children that share a log
- ``sleep_s``: ``{method: seconds}``: a call of ``method`` sleeps that long, as a copy would take, and appends
  the time it took, measured inside the child, to :data:`TIMINGS` under its log key
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# log key -> [(method, summarized arguments, ...)]
CALL_LOGS: defaultdict[str, list[tuple[Any, ...]]] = defaultdict(list)


class ScriptedFailure(RuntimeError):
    """Raised by a method the script names in ``raises``."""


class Gate:
    """Holds the calls that wait on it (script ``gates``) until it is opened."""

    TIMEOUT_S = 30.0  # a test that never opens its gate fails instead of hanging

    def __init__(self) -> None:
        self.entered = threading.Event()  # set once a call waits here
        self._open = threading.Event()

    def pass_through(self) -> None:
        self.entered.set()
        if not self._open.wait(self.TIMEOUT_S):
            raise TimeoutError("a gated call waited too long: the test never opened its gate")

    def open(self) -> None:
        self._open.set()


# key -> gate, for the script's ``gates``
GATES: dict[str, Gate] = {}
# log key -> [(method, seconds)] of the calls the script's ``sleep_s`` made sleep, timed by the child itself
TIMINGS: defaultdict[str, list[tuple[str, float]]] = defaultdict(list)


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    step: int


@dataclass
class RecordingWorkerMetadata(KVConnectorWorkerMetadata):
    count: int

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, RecordingWorkerMetadata)
        return RecordingWorkerMetadata(self.count + other.count)


@dataclass
class RecordingHandshake(KVConnectorHandshakeMetadata):
    value: str


def _blocks(blocks: Any) -> tuple[int, ...]:
    return tuple(blocks.get_block_ids()[0]) if blocks is not None else ()


class RecordingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.log = CALL_LOGS[extra["log"]]
        self.timings = TIMINGS[extra["log"]]
        self.script: dict[str, Any] = extra.get("script", {})
        self._lookups: defaultdict[str, int] = defaultdict(int)
        self._results_calls = 0
        self._steps = 0

    def _record(self, *entry: Any) -> None:
        self.log.append(entry)
        if (gate := self.script.get("gates", {}).get(entry[0])) is not None:
            GATES[gate].pass_through()
        if (seconds := self.script.get("sleep_s", {}).get(entry[0])) is not None:
            start = time.perf_counter()
            time.sleep(seconds)
            self.timings.append((entry[0], time.perf_counter() - start))
        if entry[0] in self.script.get("raises", ()):
            raise ScriptedFailure(f"scripted failure in {entry[0]}")

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._record("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        answers = self.script.get("matches", {}).get(request.request_id, [[0, False]])
        answer = answers[min(self._lookups[request.request_id], len(answers) - 1)]
        self._lookups[request.request_id] += 1
        return answer[0], answer[1]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._record("update_state_after_alloc", request.request_id, _blocks(blocks), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._steps += 1
        self._record("build_connector_meta", self._steps)
        return RecordingMetadata(self._steps)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._record("request_finished", request.request_id, tuple(block_ids))
        params = self.script.get("params", {}).get(request.request_id)
        return request.request_id in self.script.get("async_saves", []), dict(params) if params else None

    def on_new_request(self, request: Any) -> None:
        self._record("on_new_request", request.request_id)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        self._record("update_connector_output", meta.count if meta is not None else None)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        self._record("get_external_cache_hit_sources", request.request_id, num_external_tokens)
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def take_events(self) -> Any:
        self._record("take_events")
        return self._events()

    def _events(self) -> Iterator[BlockRemoved]:
        fail_after = self.script.get("events_fail_after")
        for yielded, block_hashes in enumerate(self.script.get("events", [])):
            if yielded == fail_after:
                break
            yield BlockRemoved(block_hashes=block_hashes, medium="CPU")
        if fail_after is not None:
            raise ScriptedFailure("scripted failure while iterating take_events")

    def has_pending_block_frees(self) -> bool:
        self._record("has_pending_block_frees")
        return bool(self.script.get("pending_frees"))

    def reset_cache(self) -> bool | None:
        self._record("reset_cache")
        return self.script.get("reset_cache", True)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._record("set_xfer_handshake_metadata", tuple(sorted(metadata)))

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._record("register_kv_caches", tuple(sorted(kv_caches)))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, RecordingMetadata)
        self._record("bind_connector_metadata", connector_metadata.step)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._record("clear_connector_metadata")
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._record("handle_preemptions", getattr(kv_connector_metadata, "step", None))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._record("start_load_kv", tuple(sorted(kwargs)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._record("save_kv_layer", layer_name, tuple(sorted(kwargs)))

    def wait_for_save(self) -> None:
        self._record("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        raise AssertionError("the composite must call get_transfer_results, not get_finished")

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._record("get_transfer_results", tuple(sorted(finished_req_ids)))
        call, self._results_calls = self._results_calls, self._results_calls + 1

        def scripted(key: str) -> set[str]:
            per_call = self.script.get(key, [])
            return set(per_call[call]) if call < len(per_call) else set()

        return KVConnectorTransferResults(
            finished_sending=scripted("finished_sending"),
            finished_recving=scripted("finished_recving"),
            failed_recving=scripted("failed_recving"),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._record("get_block_ids_with_load_errors")
        return set(self.script.get("load_errors", []))

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager | None:
        self._record("get_mem_pool_context")
        return contextlib.nullcontext() if self.script.get("mem_pool") else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        self._record("get_handshake_metadata")
        value = self.script.get("handshake")
        return RecordingHandshake(value) if value is not None else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._record("build_connector_worker_meta")
        return RecordingWorkerMetadata(1) if self.script.get("worker_meta") else None

    # sleep mode (vLLM 0.33+)
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return bool(kv_transfer_config.kv_connector_extra_config.get("script", {}).get("sleep_mode", True))

    def unregister_kv_caches(self) -> None:
        self._record("unregister_kv_caches", self.script.get("label"))

    def restore_kv_caches(self) -> None:
        self._record("restore_kv_caches", self.script.get("label"))

    def shutdown(self) -> None:
        self._record("shutdown")
        if self.script.get("fail_shutdown"):
            raise RuntimeError("scripted shutdown failure")
