"""Two OffloadingConnector children: their own metrics register once and stay apart.

With vLLM's MultiConnector, two children of one class either crash with
"Duplicated timeseries" (vLLM issue 39906) or share one series. kvcompose
labels each child's native series with ``connector``. Only the classes'
scheduler-side metric code runs here: it needs no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LOAD_BYTES = "vllm:kv_offload_load_bytes"


def test_two_offloading_children_register_and_observe_per_child(vllm_config_with: Callable) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.wire.native import NativeStats, class_path

    registry = CollectorRegistry()
    metric_types: dict[type, Any] = {
        kind: type(f"Isolated{kind.__name__}", (kind,), {"__init__": _registered_in(kind, registry)})
        for kind in (Counter, Gauge, Histogram)
    }
    pipeline = {"version": 1, "name": "offload", "children": [
        {"name": "cpu_a", "connector": "OffloadingConnector"},
        {"name": "cpu_b", "connector": "OffloadingConnector"},
    ]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    prom = KVComposeConnector.build_prom_metrics(config, metric_types, ["model_name", "engine"], {0: ["m", "0"]})

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    native = {}
    for child, loaded in (("cpu_a", 1000), ("cpu_b", 7)):
        stats = OffloadingConnectorStats()
        stats.increase_counter(LOAD_BYTES, loaded)
        native[child] = NativeStats(class_path(OffloadingConnector), stats).to_dict()
    prom.observe({"native": native}, 0)

    exposition = generate_latest(registry).decode()
    assert 'vllm:kv_offload_load_bytes_total{connector="cpu_a",engine="0",model_name="m"} 1000.0' in exposition
    assert 'vllm:kv_offload_load_bytes_total{connector="cpu_b",engine="0",model_name="m"} 7.0' in exposition


def _registered_in(kind: type, registry: Any) -> Callable[..., None]:
    """An __init__ that registers the metric in ``registry`` (the test's own)."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kind.__init__(self, *args, registry=registry, **kwargs)

    return init
