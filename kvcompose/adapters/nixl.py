"""vLLM's NixlConnector, as kvcompose reads it: the copy times in its transfer telemetry.

A NIXL child's stats (``get_kv_connector_stats``, an NixlKVConnectorStats)
list, among others, the seconds each of the transfers it finished since the
last stats took (``transfer_duration``, NIXL's own telemetry, which vLLM
turns into seconds). In NIXL's default pull mode those are the decode side's
reads, its loads; the prefill side measures no send.
"""

from __future__ import annotations

import functools
from typing import Any

from kvcompose.adapters.contract import Contract, default_lookup, missing_api
from kvcompose.adapters.contract import unmet as report_unmet

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONNECTOR = f"{_NIXL}.connector.NixlBaseConnector"  # "NixlConnector" resolves to a subclass (NixlPullConnector)
STATS = f"{_NIXL}.stats.NixlKVConnectorStats"
TRANSFER_DURATION = "transfer_duration"  # key of the stats' data: seconds per finished transfer

# Everything this module reads of vLLM (tests/test_adapters.py checks it on each supported release), and the
# TRANSFER_DURATION key of a new NixlKVConnectorStats' data.
CONTRACT: Contract = {
    CONNECTOR: (),  # the class a child resolves to; kvcompose knows it by name (see kvcompose.adapters.completion)
    STATS: ("data",),
}


@functools.cache
def unmet() -> tuple[str, ...]:
    """What of :data:`CONTRACT` the installed vLLM lacks (warned once); while it lacks any, nothing is read."""
    missing = missing_api(CONTRACT)
    if not missing and TRANSFER_DURATION not in default_lookup(STATS)().data:
        missing.append(f"{STATS}.data[{TRANSFER_DURATION!r}]")
    return report_unmet("NixlConnector", missing)


@functools.cache
def _stats_class() -> type | tuple[()]:
    """NixlKVConnectorStats, whose instances this module reads; none (``()``) while the contract is unmet."""
    return () if unmet() else default_lookup(STATS)


def copy_seconds(stats: Any) -> float | None:
    """The seconds the transfers in a child's stats (an NixlKVConnectorStats) took, together; None if it lists
    none."""
    if not isinstance(stats, _stats_class()):
        return None
    durations = stats.data.get(TRANSFER_DURATION)
    return sum(durations) if durations else None
