"""A worker's calls of one forward step, in vLLM's order, for driving a connector by hand."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def forward_step(worker: Any, layers: int = 2, finished: Iterable[str] = ()) -> tuple[Any, set[int]]:
    """Everything between binding and clearing a step's metadata: loads, per-layer
    waits and saves, then the transfer results and the blocks that failed to load."""
    worker.start_load_kv(None)
    for layer in range(layers):
        name = f"model.layers.{layer}"
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, None, None)
    worker.wait_for_save()
    return worker.get_transfer_results(set(finished)), worker.get_block_ids_with_load_errors()
