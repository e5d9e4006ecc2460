"""Real vLLM request, block and scheduler-output objects for driving connectors by hand."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

RECORDING = {"connector": "RecordingConnector", "module_path": "kvcompose.testing.recording"}
COMPOSITE = {"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
             "kv_role": "kv_both"}


def make_request(request_id: str, trace_headers: Mapping[str, str] | None = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, list(range(64)), SamplingParams(max_tokens=4), None, trace_headers=trace_headers)


def make_blocks(*block_ids: int) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in block_ids],))


def scheduler_output(
    new: list[Any] = (), cached: list[str] = (), blocks: list[int] = ()  # type: ignore[assignment]
) -> Any:
    """A SchedulerOutput scheduling ``new`` requests (each with ``blocks``) for the first time and ``cached`` ones
    again."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [NewRequestData.from_request(request, (list(blocks),)) for request in new]
    output.scheduled_cached_reqs.req_ids = list(cached)
    # A new request's prompt, one token for each cached one (decode), as vLLM would schedule them.
    output.num_scheduled_tokens = {**{request.request_id: request.num_prompt_tokens for request in new},
                                   **dict.fromkeys(cached, 1)}
    output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
    return output


def composite_pair(
    vllm_config_with: Callable, pipeline: dict[str, Any], kv_cache_config: Any = None,
) -> tuple[Any, Any]:
    """A scheduler-side and a worker-side KVComposeConnector over ``pipeline`` (the worker's KV cache as
    ``kv_cache_config`` says, if given)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcompose.connectors import KVComposeConnector

    config = vllm_config_with({**COMPOSITE, "kv_connector_extra_config": {"pipeline": pipeline}})
    return (KVComposeConnector(config, KVConnectorRole.SCHEDULER, None),
            KVComposeConnector(config, KVConnectorRole.WORKER, kv_cache_config))
