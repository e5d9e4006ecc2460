"""FleetBatch: what an engine's fleet endpoint answers ``kvcompose fleet``'s pull with, and how it is read.

An engine that shares a tier with others (a child with ``shared: <tier id>``)
keeps, for each request that had a sampled block, the keyed digests of its
sampled blocks (kvcompose.economics.fleet_samples) in a bounded buffer. A
pull asks for the requests after a cursor; the answer carries them with the
engine's running count of block references, so the aggregator knows how many
references the samples stand for, and a probe: a digest of the engine's
block-hash configuration, equal on engines whose keys agree.

As JSON (one object)::

    {"format": 1, "instance": "<random per engine process>", "engine": "<engine id>",
     "tiers": {"<tier id>": "<child name>"}, "capacities": {"<tier id>": <blocks>},
     "sample_rate": <float>, "probe": "<16 hex digits>" | null, "time": <Unix s>,
     "references": <block references so far>, "dropped": <requests dropped unpulled>,
     "first": <oldest sequence number buffered>, "next": <the last sequence number this answer covers: the next pull's cursor>,
     "requests": [[<sequence number>, <Unix s>, <references up to and with it>, "<16 hex digits per digest>"]]}

Digests are hex because JSON numbers lose 64-bit integers. The reader trusts
nothing: :func:`parse_batch` turns anything malformed into one
:class:`FleetPayloadError` line.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

FORMAT = 1
SAMPLES_PATH = "/kvcompose/fleet/samples"
DIGEST_HEX = 16  # 8 bytes
# The most a pull's answer may hold: a buffer of 2^24 requests of a few digests each is far less.
MAX_BODY_BYTES = 256 << 20
MAX_NAME = 128
_HEX = re.compile(r"[0-9a-f]+")


class FleetPayloadError(ValueError):
    """A pull's answer is not a fleet batch; the message is one line."""


@dataclass(frozen=True)
class SampledRequest:
    sequence: int
    time: float  # Unix seconds, on the engine's clock
    references: int  # the engine's block references up to and including this request's
    digests: tuple[int, ...]  # its sampled blocks' digests, root first


@dataclass(frozen=True)
class FleetBatch:
    instance: str
    engine: str
    tiers: dict[str, str]  # tier id -> the child that names it
    sample_rate: float
    probe: str | None
    time: float
    references: int
    dropped: int
    first: int
    next: int
    capacities: dict[str, int] = field(default_factory=dict)
    requests: list[SampledRequest] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "instance": self.instance, "engine": self.engine, "tiers": self.tiers,
            "capacities": self.capacities, "sample_rate": self.sample_rate, "probe": self.probe,
            "time": self.time, "references": self.references, "dropped": self.dropped, "first": self.first,
            "next": self.next,
            "requests": [[each.sequence, each.time, each.references,
                          "".join(f"{digest:016x}" for digest in each.digests)] for each in self.requests],
        }, separators=(",", ":")).encode()


def parse_batch(body: bytes) -> FleetBatch:
    """The batch in a pull's answer; :class:`FleetPayloadError` for anything else."""
    if len(body) > MAX_BODY_BYTES:
        raise FleetPayloadError(f"answer of {len(body)} bytes, over the {MAX_BODY_BYTES} allowed")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise FleetPayloadError(f"not JSON: {str(error)[:80]}") from None
    if not isinstance(data, dict):
        raise FleetPayloadError(f"not a fleet batch: a JSON {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise FleetPayloadError(f"format {_shown(data.get('format'))}, expected {FORMAT}")
    rate = _number(data, "sample_rate")
    if not 0 < rate <= 1:
        raise FleetPayloadError(f"sample_rate {rate} is not in (0, 1]")
    probe = data.get("probe")
    if probe is not None and not _is_hex(probe):
        raise FleetPayloadError(f"probe {_shown(probe)} is not {DIGEST_HEX} hex digits")
    tiers = _names(data, "tiers", str)
    capacities = _names(data, "capacities", int)
    first, cursor = _count(data, "first"), _count(data, "next")
    requests = data.get("requests")
    if not isinstance(requests, list):
        raise FleetPayloadError("requests: not a list")
    parsed = [_request(index, item) for index, item in enumerate(requests)]
    if any(later.sequence <= earlier.sequence or later.references < earlier.references
           for earlier, later in pairwise(parsed)):
        raise FleetPayloadError("requests: sequence numbers and reference counts must increase")
    references = _count(data, "references")
    if parsed and (parsed[-1].sequence > cursor or parsed[-1].references > references):
        raise FleetPayloadError("requests: past the batch's cursor or reference count")
    return FleetBatch(instance=_name(data, "instance"), engine=_name(data, "engine"), tiers=tiers,
                      sample_rate=rate, probe=probe, time=_number(data, "time"), references=references,
                      dropped=_count(data, "dropped"), first=first, next=cursor, capacities=capacities,
                      requests=parsed)


def _request(index: int, item: Any) -> SampledRequest:
    if not (isinstance(item, list) and len(item) == 4 and isinstance(item[3], str)):
        raise FleetPayloadError(f"requests[{index}]: not [sequence, time, references, digests]")
    sequence, moment, references, digests = item
    if not (_is_count(sequence) and _is_count(references) and _is_finite(moment)):
        raise FleetPayloadError(f"requests[{index}]: sequence and references must be counts, time a number")
    if not digests or len(digests) % DIGEST_HEX or not _is_hex(digests, len(digests)):
        raise FleetPayloadError(f"requests[{index}]: digests must be {DIGEST_HEX} hex digits each")
    return SampledRequest(sequence, float(moment), references,
                          tuple(int(digests[at:at + DIGEST_HEX], 16) for at in range(0, len(digests), DIGEST_HEX)))


def _names(data: dict[str, Any], key: str, kind: type) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict) or not all(
            isinstance(name, str) and 0 < len(name) <= MAX_NAME and isinstance(item, kind)
            and not isinstance(item, bool) and (kind is str and 0 < len(item) <= MAX_NAME or kind is int and item >= 0)
            for name, item in value.items()):
        raise FleetPayloadError(f"{key}: not a mapping of names to {kind.__name__}s")
    return value


def _name(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise FleetPayloadError(f"{key}: not a name of 1 to {MAX_NAME} characters")
    return value


def _count(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if not _is_count(value):
        raise FleetPayloadError(f"{key}: {_shown(value)} is not a count")
    return value


def _number(data: dict[str, Any], key: str) -> float:
    value = data.get(key)
    if not _is_finite(value):
        raise FleetPayloadError(f"{key}: {_shown(value)} is not a number")
    return float(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_hex(value: Any, length: int = DIGEST_HEX) -> bool:
    return isinstance(value, str) and len(value) == length and _HEX.fullmatch(value) is not None


def _shown(value: Any) -> str:
    return repr(value)[:40]
