"""The connectors the micro-benchmarks compare, all over no-op children.

The first child answers every lookup with ``MATCHED_TOKENS`` (so it is the
loader) and the others with 0, for vLLM's MultiConnector and kvcompose alike.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.connectors import KVComposeConnector

NOOP_MODULE = "kvcompose.testing.noop"
MATCHED_TOKENS = 16


def _child_extra_config(index: int) -> dict[str, Any]:
    return {"matched_tokens": MATCHED_TOKENS if index == 0 else 0}


@cache
def _base_config() -> VllmConfig:
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    from kvcompose.testing.tiny_model import ensure_tiny_model

    return VllmConfig(
        model_config=ModelConfig(model=str(ensure_tiny_model()), dtype="float32", max_model_len=512),
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"),
    )


def _vllm_config(kv_transfer: dict[str, Any]) -> VllmConfig:
    from vllm.config import KVTransferConfig

    config = copy.copy(_base_config())
    config.kv_transfer_config = KVTransferConfig(**kv_transfer)
    return config


def _role(side: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorRole[side.upper()]


def multi_connector(children: int, side: str) -> KVConnectorBase_V1:
    """vLLM's MultiConnector over ``children`` no-op children (``side``: scheduler or worker)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    connectors = [
        {"kv_connector": "NoopConnector", "kv_connector_module_path": NOOP_MODULE, "kv_role": "kv_both",
         "kv_connector_extra_config": _child_extra_config(index)}
        for index in range(children)
    ]
    config = _vllm_config({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"connectors": connectors}})
    return MultiConnector(config, _role(side), None)


def pipeline(children: int, metrics: bool = True, tracing: str | None = None, per_layer: bool = False) -> dict:
    """A kvcompose pipeline of no-op children; ``tracing`` is a granularity (spans made, none exported)."""
    return {
        "version": 1,
        "name": "bench",
        "metrics": {"enabled": metrics, "per_layer": per_layer},
        "tracing": {"enabled": tracing is not None, "exporter": "none", "granularity": tracing or "request"},
        "logging": {"level": "WARNING"},
        "children": [{"name": f"c{index}", "connector": "NoopConnector", "module_path": NOOP_MODULE,
                      "config": _child_extra_config(index)} for index in range(children)],
    }


def kvcompose_vllm_config(pipeline: dict) -> VllmConfig:
    return _vllm_config({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                         "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})


def kvcompose_connector(pipeline: dict, side: str, workers: int = 1) -> KVComposeConnector:
    """``workers``: the engine's world size, as the connector sees it (none are started)."""
    from kvcompose.connectors import KVComposeConnector

    config = kvcompose_vllm_config(pipeline)
    if workers != config.parallel_config.world_size:
        config.parallel_config = copy.copy(config.parallel_config)
        config.parallel_config.world_size = workers
    return KVComposeConnector(config, _role(side), None)
