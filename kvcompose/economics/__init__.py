"""Tier economics: what each tier is worth, and what it would be worth at another size.

- :mod:`kvcompose.economics.shards`: the engine-side sampler of the prefix-block stream (an LRU hit-ratio
  curve by cache size, and write waste), fed once per admitted request.
- :mod:`kvcompose.economics.sizes`: the sizes the curve is read at, each tier's reach, blocks in bytes.
- :mod:`kvcompose.economics.streams`: synthetic prefix-block streams for tests and benchmarks.
- ``kvcompose advise``: per-tier advice from a saved /metrics or a Prometheus server.

Nothing here imports vLLM; only the sampler imports numpy.
"""
