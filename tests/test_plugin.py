"""The vllm.general_plugins entry point registers KVComposeConnector."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_entry_point_is_installed() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvcompose") == "kvcompose.plugin:register"


def test_vllm_plugin_loader_registers_the_connector() -> None:
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "load_general_plugins(); load_general_plugins()\n"
        "cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector='KVComposeConnector', kv_role='kv_both'))\n"
        "print(cls.__module__, cls.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["kvcompose.connectors.composite", "KVComposeConnector"]
