"""A second engine in one process registers kvcompose's metrics again.

vLLM's ``PrometheusStatLogger`` is what each engine's front-end builds; it
registers into prometheus_client's default registry, which refuses a name it
already holds. Built twice here (two pipelines, as two ``LLM`` objects in one
process would), the second must not fail and must be the one exported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcompose.exposition import read


def _pipeline_config(vllm_config_with: Callable, name: str, children: list[str]) -> Any:
    pipeline = {"version": 1, "name": name, "children": [
        {"name": child, "connector": "ExampleConnector", "config": {"shared_storage_path": f"/tmp/kvc-unused/{child}"}}
        for child in children
    ]}
    return vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                             "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})


def _info_children(exposition: str) -> set[tuple[str, str]]:
    return {(sample.labels["pipeline"], sample.labels["connector"])
            for sample in read(exposition).series("kvcompose_pipeline_info")}


def _lookups(exposition: str, child: str) -> float:
    return read(exposition).total("kvcompose_lookups_total", connector=child)


def _payload(child: str, hits: int) -> dict[str, Any]:
    """What a step with ``hits`` lookup hits by ``child`` sends to the front-end."""
    from kvcompose.config import DEFAULT_LATENCY_BUCKETS
    from kvcompose.metrics.recorder import PipelineRecorder
    from kvcompose.operations import OPERATIONS
    from kvcompose.wire.stats import KVComposeStats

    recorder = PipelineRecorder(True, DEFAULT_LATENCY_BUCKETS, [child])
    slot = recorder.slot(0, recorder.label(OPERATIONS["get_num_new_matched_tokens"]))
    for _ in range(hits):
        recorder.timed(slot, 0.0001)  # a lookup, timed
        recorder.request_admitted([(16, False)], [0], 0, 16)
    return KVComposeStats(data={"calls": recorder.take()}).to_dict()


def test_second_stat_logger_in_one_process_replaces_the_first(vllm_config_with: Callable) -> None:
    from prometheus_client import generate_latest
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    first = PrometheusStatLogger(_pipeline_config(vllm_config_with, "first", ["hot", "cold"]))
    first.kv_connector_prom.observe(_payload("hot", 3))
    assert _lookups(generate_latest().decode(), "hot") == 3

    second = PrometheusStatLogger(_pipeline_config(vllm_config_with, "second", ["hot", "disk"]))
    second.kv_connector_prom.observe(_payload("hot", 5))
    first.kv_connector_prom.observe(_payload("hot", 100))  # the first engine's series are no longer exported

    exposition = generate_latest().decode()
    assert _info_children(exposition) == {("second", "hot"), ("second", "disk")}
    assert _lookups(exposition, "hot") == 5
