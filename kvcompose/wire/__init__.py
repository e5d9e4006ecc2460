"""What crosses vLLM's process boundaries for kvcompose: plain data, below every layer that fills or reads it.

- :mod:`kvcompose.wire.metadata`: the scheduler's per-step metadata for its
  workers, and the workers' metadata back.
"""
