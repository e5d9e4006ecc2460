"""Names that vLLM defines, kept here so the CLI answers without importing vLLM.

Importing vLLM takes about 13 s; ``kvcompose validate`` must answer in well
under a second. ``tests/test_vllm_names.py`` fails when these drift from the
installed vLLM.
"""

# Connector names registered in vLLM's KVConnectorFactory (vLLM 0.32/0.33).
BUILTIN_CONNECTORS: frozenset[str] = frozenset(
    {
        "DecodeBenchConnector",
        "ExampleConnector",
        "ExampleHiddenStatesConnector",
        "FlexKVConnectorV1",
        "HF3FSKVConnector",
        "HiSparseConnector",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
        "MooncakeConnector",
        "MooncakeStoreConnector",
        "MoRIIOConnector",
        "MultiConnector",
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
    }
)

# Fields of vllm.config.KVTransferConfig that a pipeline child may set under
# ``transfer:``. The others are owned by kvcompose: the connector name and module
# path come from ``connector``/``module_path``, the role from ``role``, the
# extra config from ``config``.
KV_TRANSFER_FIELDS: frozenset[str] = frozenset(
    {
        "enable_permute_local_kv",
        "engine_id",
        "kv_buffer_device",
        "kv_connector",
        "kv_connector_extra_config",
        "kv_connector_module_path",
        "kv_load_failure_policy",
        "kv_port",
        "kv_role",
    }
)
KV_TRANSFER_FIELDS_OWNED_BY_KVCOMPOSE: frozenset[str] = frozenset(
    {"kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config"}
)

# The name the composite registers under in vLLM's KVConnectorFactory.
COMPOSITE_CONNECTOR = "KVComposeConnector"
COMPOSITE_HMA_CONNECTOR = "KVComposeHMAConnector"
COMPOSITE_MODULE = "kvcompose.connectors"
