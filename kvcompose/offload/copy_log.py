"""What the offloading worker measured for each copy job, kept for inspection.

Every job the copy thread finishes is appended to :data:`RECENT_COPIES`, a
bounded, thread-safe log of the process (the oldest records drop out), and
logged at DEBUG on the ``kvcompose.offload`` logger. ``seconds`` is the copy
alone (from the first row copied to the last), the same figure the worker
reports to vLLM as ``TransferResult.transfer_time`` (summed into
``vllm:kv_offload_{load,store}_time``). Timestamps are ``time.time_ns()``, the
clock OpenTelemetry spans use, so a record can be placed inside a span.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

Direction = Literal["store", "load"]
RECENT_LIMIT = 4096


@dataclass(frozen=True)
class CopyRecord:
    job_id: int
    direction: Direction  # store: engine -> host; load: host -> engine
    nbytes: int
    seconds: float
    submitted_ns: int
    started_ns: int
    finished_ns: int
    thread: str
    success: bool

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


class CopyLog:
    """A bounded, thread-safe list of the latest :class:`CopyRecord`."""

    def __init__(self, limit: int = RECENT_LIMIT) -> None:
        self._records: deque[CopyRecord] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def append(self, record: CopyRecord) -> None:
        with self._lock:
            self._records.append(record)

    def records(self) -> list[CopyRecord]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


RECENT_COPIES = CopyLog()


def recent_copies() -> list[CopyRecord]:
    """The latest copy jobs of every offloading worker in this process, oldest first."""
    return RECENT_COPIES.records()
