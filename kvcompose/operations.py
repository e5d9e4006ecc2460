"""The operations of vLLM's KVConnectorBase_V1 (0.30-0.33), named without importing vLLM."""

# Every instance method a connector answers, scheduler and worker side.
CONNECTOR_OPERATIONS: tuple[str, ...] = (
    # scheduler side
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "update_state_after_alloc",
    "on_new_request",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "bind_kv_cache_manager",
    "bind_gpu_block_pool",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "reset_cache",
    "get_kv_connector_stats",
    # worker side
    "register_kv_caches",
    "set_host_xfer_buffer_ops",
    "get_mem_pool_context",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "finish_forward",
    "reset_capture_state",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_finished_count",
    "get_handshake_metadata",
    "build_connector_worker_meta",
    "get_kv_connector_kv_cache_events",
    # both
    "shutdown",
    # sleep mode (vLLM 0.33+), worker side
    "unregister_kv_caches",
    "restore_kv_caches",
)

# What the composite never calls on a child: it asks get_transfer_results
# (get_finished is its older form), and like MultiConnector it does not
# aggregate the children's differently typed KV cache events.
NOT_FORWARDED_TO_CHILDREN = frozenset({"get_finished", "get_kv_connector_kv_cache_events"})

# Only connectors that support the hybrid KV cache manager (SupportsHMA) have these.
HMA_OPERATIONS = frozenset({"request_finished_all_groups"})
