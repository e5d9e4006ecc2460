"""Per-call cost of the per-layer hot path: a direct child call, vLLM's
MultiConnector and KVComposeConnector (metrics off / on), with no-op children.

All figures come from one run, side by side; compare the ratios, not the ns.
Usage: .venv/bin/python benchmarks/hot_path.py
"""

from __future__ import annotations

import copy
import json
import timeit
from typing import Any

CALLS = 100_000
NOOP = {"connector": "NoopConnector", "module_path": "kvcompose.testing.noop"}
STATEMENTS = {
    "save_kv_layer": "c.save_kv_layer('layer.0', None, None)",
    "wait_for_layer_load": "c.wait_for_layer_load('layer.0')",
}


def main() -> None:
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvcompose.connectors import KVComposeConnector
    from kvcompose.testing.tiny_model import ensure_tiny_model

    base = VllmConfig(
        model_config=ModelConfig(model=str(ensure_tiny_model()), dtype="float32", max_model_len=512),
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"),
    )

    def config(kv_transfer: dict[str, Any]) -> VllmConfig:
        built = copy.copy(base)
        built.kv_transfer_config = KVTransferConfig(**kv_transfer)
        return built

    def compose(children: int, metrics: bool) -> KVComposeConnector:
        pipeline = {"version": 1, "name": "bench", "metrics": {"enabled": metrics},
                    "children": [{"name": f"c{i}", **NOOP} for i in range(children)]}
        return KVComposeConnector(config({"kv_connector": "KVComposeConnector", "kv_role": "kv_both",
                                          "kv_connector_module_path": "kvcompose.connectors",
                                          "kv_connector_extra_config": {"pipeline": pipeline}}),
                                  KVConnectorRole.WORKER, None)

    results = []
    for children in (2, 8):
        multi_children = [{"kv_connector": NOOP["connector"], "kv_connector_module_path": NOOP["module_path"],
                           "kv_role": "kv_both"}] * children
        multi = MultiConnector(config({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"connectors": multi_children}}),
                               KVConnectorRole.WORKER, None)
        subjects = {"direct": multi.sub_connectors[0], "multi": multi,
                    "kvcompose_metrics_off": compose(children, False), "kvcompose_metrics_on": compose(children, True)}
        for op, statement in STATEMENTS.items():
            ns = {name: min(timeit.repeat(statement, globals={"c": c}, number=CALLS, repeat=5)) / CALLS * 1e9
                  for name, c in subjects.items()}
            results.append({"children": children, "op": op, "ns": ns,
                            "metrics_on_vs_multi": ns["kvcompose_metrics_on"] / ns["multi"],
                            "metrics_off_vs_multi": ns["kvcompose_metrics_off"] / ns["multi"]})
    print(f"{'children':>8} {'op':<20} {'direct':>8} {'multi':>8} {'kvc off':>8} {'kvc on':>8} {'on/multi':>9}")
    for r in results:
        ns = r["ns"]
        print(f"{r['children']:>8} {r['op']:<20} {ns['direct']:>7.0f}n {ns['multi']:>7.0f}n "
              f"{ns['kvcompose_metrics_off']:>7.0f}n {ns['kvcompose_metrics_on']:>7.0f}n "
              f"{r['metrics_on_vs_multi']:>9.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
