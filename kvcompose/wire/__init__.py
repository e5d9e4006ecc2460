"""What crosses vLLM's process boundaries for kvcompose: plain data, below every layer that fills or reads it.

- :mod:`kvcompose.wire.metadata`: the scheduler's per-step metadata for its
  workers, and the workers' metadata back;
- :mod:`kvcompose.wire.stats`: the engine's stats for the front-end
  (``KVComposeStats``), whose sections are the calls table
  (:mod:`~kvcompose.wire.calls`), the transfers table
  (:mod:`~kvcompose.wire.transfers`), both on one grid
  (:mod:`~kvcompose.wire.grid`), the span exporter's telemetry
  (:mod:`~kvcompose.wire.telemetry`), the tier economics
  (:mod:`~kvcompose.wire.economics`) and each child's own stats
  (:mod:`~kvcompose.wire.native`).

The engine fills them (kvcompose.instrumentation, kvcompose.metrics' recorders); the front-end turns them into
Prometheus series (kvcompose.metrics.prometheus).
"""
