"""Per-child stats (vLLM's KVConnectorStats) and their Prometheus metrics."""
