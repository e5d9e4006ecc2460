"""vLLM general plugin: registers KVComposeConnector with KVConnectorFactory.

Installed as the ``vllm.general_plugins`` entry point ``kvcompose``, so a
``--kv-transfer-config`` may name ``KVComposeConnector`` without
``kv_connector_module_path``. vLLM runs general plugins in every process.
"""

from __future__ import annotations

from kvcompose.vllm_names import COMPOSITE_CONNECTOR, COMPOSITE_HMA_CONNECTOR, COMPOSITE_MODULE


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in (COMPOSITE_CONNECTOR, COMPOSITE_HMA_CONNECTOR):
        try:
            KVConnectorFactory.register_connector(name, COMPOSITE_MODULE, name)
        except ValueError:  # already registered: vLLM may load plugins more than once
            pass
