"""An engine's samples for the tiers it shares with other engines: keyed digests of sampled blocks, bounded.

A shared tier's reuse comes from the whole fleet's interleaved traffic. SHARDS
samples keys spatially: with one fixed threshold on every engine, a key is
sampled everywhere or nowhere, so the engines' sampled references, merged in
time order, are exactly the fleet's references to the sampled keys, and one
sampler (kvcompose.economics.shards) over them gives the fleet's curve.

What leaves the engine is never a block hash: each block hash is digested by
BLAKE2b keyed with the fleet's secret, 8 bytes, and the threshold applies to
that digest. Engines with the same secret and the same block hashes agree on
every digest; anyone without the secret can neither link a digest to a
prompt nor test a guessed prompt. (A keyless sketch, counter stacks of
HyperLogLogs, was the other way: docs/economics.md weighs the two.)

Keys agree across engines only when vLLM's block hashes do: the same hash
algorithm, block size and seed (``PYTHONHASHSEED``, or vLLM's fixed default
seed for SHA-256; xxHash without ``PYTHONHASHSEED`` draws a random seed per
process). Each batch carries a probe, the keyed digest of the engine's hash
configuration (algorithm, block size, vLLM's root parent hash): equal probes,
equal keys, and a fleet whose probes differ is told so instead of shown a
wrong curve.

The buffer holds the last ``buffer_requests`` requests that had a sampled
block; a request that leaves it before any pull took it is counted as
dropped. ``record`` runs on the scheduler's thread and ``batch`` on the
endpoint's: a lock guards the buffer.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvcompose.economics.shards import KEY_SPACE
from kvcompose.wire.fleet import FleetBatch, SampledRequest

DIGEST_BYTES = 8
# The most requests one pull's answer carries; the next pull takes the rest.
MAX_REQUESTS_PER_BATCH = 1 << 16
_PROBE_PREFIX = b"kvcompose fleet probe\x00"


def keyed_digest(keyed: hashlib.blake2b, block_hash: bytes) -> bytes:
    """The fleet's digest of a block hash: ``keyed`` is BLAKE2b keyed with the fleet's secret, 8 bytes, with
    nothing digested yet (copied for each hash: cheaper than keying anew)."""
    one = keyed.copy()
    one.update(block_hash)
    return one.digest()


class FleetSampler:
    """One engine's sampled requests for its shared tiers, and what a pull answers; see the module docstring.

    ``tiers``: tier id -> the child naming it; ``capacities``: tier id -> blocks, where the engine knows;
    ``probe_material``: the engine's block-hash configuration as bytes, None until it is known."""

    def __init__(self, tiers: dict[str, str], sample_rate: float, secret: bytes, buffer_requests: int, engine: str,
                 capacities: dict[str, int] | None = None,
                 probe_material: Callable[[], bytes | None] = lambda: None,
                 clock: Callable[[], float] = time.time) -> None:
        if not secret:
            raise ValueError("the fleet secret must not be empty")
        self.tiers = dict(tiers)
        self.sample_rate = sample_rate
        self.engine = engine
        self.capacities = dict(capacities or {})
        self._keyed = hashlib.blake2b(key=secret, digest_size=DIGEST_BYTES)
        threshold = int(sample_rate * KEY_SPACE)
        self._below = threshold.to_bytes(DIGEST_BYTES, "big") if threshold < KEY_SPACE else None  # None: all
        self._probe_material = probe_material
        self._probe: str | None = None
        self._clock = clock
        self._instance = secrets.token_hex(8)  # a restarted engine starts its sequence again
        self._lock = threading.Lock()
        self._buffer: deque[SampledRequest] = deque(maxlen=buffer_requests)
        self._sequence = 0
        self._references = 0
        self._pulled = 0  # the highest sequence number a pull has taken
        self.dropped = 0

    def record(self, block_hashes: Sequence[bytes], now: float | None = None) -> None:
        """One request's ``Request.block_hashes``, root first, at its first admission."""
        keyed, below, sampled = self._keyed, self._below, []
        for block_hash in block_hashes:  # inline: a call per block would double the cost
            one = keyed.copy()
            one.update(block_hash)
            if below is None or (value := one.digest()) < below:
                sampled.append(one.digest() if below is None else value)
        with self._lock:
            self._references += len(block_hashes)
            if not sampled:
                return
            buffer = self._buffer
            if len(buffer) == buffer.maxlen and buffer[0].sequence > self._pulled:
                self.dropped += 1
            self._sequence += 1
            buffer.append(SampledRequest(self._sequence, self._clock() if now is None else now, self._references,
                                         tuple(int.from_bytes(value, "big") for value in sampled)))

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def references(self) -> int:
        return self._references

    def batch(self, after: int) -> FleetBatch:
        """The buffered requests past sequence number ``after`` (at most :data:`MAX_REQUESTS_PER_BATCH`)."""
        with self._lock:
            pending = [each for each in self._buffer if each.sequence > after][:MAX_REQUESTS_PER_BATCH]
            cursor = pending[-1].sequence if len(pending) == MAX_REQUESTS_PER_BATCH else self._sequence
            self._pulled = max(self._pulled, cursor)
            first = self._buffer[0].sequence if self._buffer else self._sequence + 1
            references = self._references if cursor == self._sequence else pending[-1].references
            dropped = self.dropped
        return FleetBatch(instance=self._instance, engine=self.engine, tiers=self.tiers,
                          sample_rate=self.sample_rate, probe=self.probe(), time=self._clock(),
                          references=references, dropped=dropped, first=first, next=cursor,
                          capacities=self.capacities, requests=pending)

    def probe(self) -> str | None:
        """The keyed digest of the engine's block-hash configuration; None while it is not known."""
        if self._probe is None and (material := self._probe_material()) is not None:
            self._probe = keyed_digest(self._keyed, _PROBE_PREFIX + material).hex()
        return self._probe
