"""A live view of each engine process, for gauges that must stay true while no stats flow.

vLLM moves a connector's stats to the front-end only after an engine step: an
idle engine sends none, and neither does one whose thread is stuck inside a
call. A gauge fed by stats alone then keeps its last value (spans waiting for
export read 40 long after they left). So each engine process also publishes a
small JSON status, from a thread of its own, and the front-end reads it from a
thread of its own.

Engine side::

    from kvcompose.live import board

    board(engine_id).set("breakers", {"hot": 0})            # a value the engine sets when it changes
    board(engine_id).watch("spans_queued", shipper.queued)  # a value read each time the board publishes

A board writes ``/dev/shm/kvcompose-live-<engine_id>-<pid>.json`` (in the
system's temporary directory where there is no ``/dev/shm``) at most every
:data:`PUBLISH_EVERY_S`, only when a value changed, and atomically (a
temporary file renamed over it). The file is removed when the process exits
(``atexit``) or the board is closed; a file whose process is gone (killed) is
removed by the next reader, and by the next engine that starts a board.

Front-end side (vLLM builds the connector's Prometheus metrics in the API
server process, whose ``kv_transfer_config.engine_id`` is the engine's; see
:func:`engine_ids` for data parallelism)::

    view = LiveView(engine_ids(vllm_config, [0]))
    view.subscribe("spans_queued", lambda engine_idx, values: gauge.labels(...).set(max(values)))
    view.start()

About every :data:`READ_EVERY_S` the view's thread reads the live files of its
engines and calls each subscriber of a key with the key's values, one per
process of that engine that publishes it (never with an empty list: an engine
that publishes nothing leaves its gauges to its stats).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompose.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PUBLISH_EVERY_S = 0.5
READ_EVERY_S = 1.0
PREFIX = "kvcompose-live-"
_SHARED_MEMORY = "/dev/shm"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_FILE = re.compile(rf"\.?{PREFIX}(?P<engine>.+)-(?P<pid>\d+)\.json(\.tmp)?")

log = get_logger("live")
Subscriber = Callable[[int, list[Any]], None]


def live_directory() -> Path:
    return Path(_SHARED_MEMORY if os.path.isdir(_SHARED_MEMORY) else tempfile.gettempdir())


def _file_engine(engine_id: str) -> str:
    """The engine id as it appears in file names (an id is free text in ``--kv-transfer-config``)."""
    return _UNSAFE.sub("_", engine_id)


def engine_ids(vllm_config: VllmConfig, engine_indexes: Iterable[int]) -> dict[int, str]:
    """The engine id each engine's processes publish under, by vLLM's engine index (its data parallel rank).

    With data parallelism, vLLM gives each engine core its own id: the configured one plus ``_dp<rank>``
    (``vllm/v1/engine/core.py``, ``run_engine_core``); the front-end's config keeps the configured one.
    """
    engine_id = vllm_config.kv_transfer_config.engine_id
    if vllm_config.parallel_config.data_parallel_size > 1:
        return {index: f"{engine_id}_dp{index}" for index in engine_indexes}
    return dict.fromkeys(engine_indexes, engine_id)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale(directory: Path) -> None:
    """Remove the live files (and unfinished temporary files) of processes that are gone."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if (match := _FILE.fullmatch(entry.name)) is not None and not process_alive(int(match["pid"])):
            Path(entry.path).unlink(missing_ok=True)


def remove_files_of(pid: int) -> None:
    """Remove the live files of process ``pid``, which is gone (its span exporter outlives it, and does this
    when vLLM killed it before its ``atexit``)."""
    directory = live_directory()
    for name in (f"{PREFIX}*-{pid}.json", f".{PREFIX}*-{pid}.json.tmp"):
        for path in directory.glob(name):
            path.unlink(missing_ok=True)


class Board:
    """One engine process's live values, published to its file by a thread of its own."""

    def __init__(self, engine_id: str, directory: Path) -> None:
        self.engine_id = engine_id
        self.path = directory / f"{PREFIX}{_file_engine(engine_id)}-{os.getpid()}.json"
        self._temporary = self.path.with_name(f".{self.path.name}.tmp")
        self._values: dict[str, Any] = {}
        self._sources: dict[str, Callable[[], Any]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._published: str | None = None
        self._thread: threading.Thread | None = None
        self._failures_logged: set[str] = set()

    def set(self, key: str, value: Any) -> None:
        """Publish ``value`` (JSON-serialisable) under ``key`` from now on."""
        with self._lock:
            self._values[key] = value
            self._start()

    def watch(self, key: str, source: Callable[[], Any]) -> None:
        """Publish what ``source()`` returns under ``key``, read each time the board publishes (on the board's
        thread: it must be safe to call from there, and cheap)."""
        with self._lock:
            self._sources[key] = source
            self._start()

    def _start(self) -> None:
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(target=self._run, name="kvcompose-live-board", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            self.publish()
            self._closed.wait(PUBLISH_EVERY_S)

    def publish(self) -> None:
        """Write the file now if a value changed since it was last written."""
        with self._lock:
            values = dict(self._values)
            sources = dict(self._sources)
        for key, source in sources.items():
            try:
                values[key] = source()
            except Exception as error:  # a source that fails leaves its key out, and is logged once
                if key not in self._failures_logged:
                    self._failures_logged.add(key)
                    log.warning("live_value_failed", key=key, error_type=type(error).__name__)
        text = json.dumps({"engine_id": self.engine_id, "pid": os.getpid(), "values": values}, sort_keys=True)
        if text == self._published or self._closed.is_set():
            return
        try:
            self._temporary.write_text(text)
            os.replace(self._temporary, self.path)
        except OSError as error:
            if "write" not in self._failures_logged:
                self._failures_logged.add("write")
                log.warning("live_file_not_written", path=str(self.path), error_type=type(error).__name__)
            return
        self._published = text

    def close(self) -> None:
        """Stop publishing and remove the file."""
        with _lock:
            if _boards.get(self.engine_id) is self:
                del _boards[self.engine_id]
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._temporary.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


_lock = threading.Lock()
_boards: dict[str, Board] = {}


def board(engine_id: str) -> Board:
    """This process's board for ``engine_id`` (made on first use)."""
    with _lock:
        if (found := _boards.get(engine_id)) is None:
            directory = live_directory()
            if not _boards:  # the first board of this process: clear what killed engines left behind
                _remove_stale(directory)
                atexit.register(close_boards)
            found = _boards[engine_id] = Board(engine_id, directory)
        return found


def close_boards() -> None:
    """Close every board of this process (it exits)."""
    with _lock:
        boards = list(_boards.values())
    for each in boards:
        each.close()


def _forget_boards() -> None:
    """In a forked child: the parent's boards and files are not this process's."""
    global _lock
    _lock = threading.Lock()
    _boards.clear()


os.register_at_fork(after_in_child=_forget_boards)


class LiveView:
    """The front-end's reader of its engines' live files; see the module docstring."""

    def __init__(self, engines: Mapping[int, str], directory: Path | None = None) -> None:
        self._engines = {_file_engine(engine_id): index for index, engine_id in engines.items()}
        self._directory = directory or live_directory()
        self._subscribers: dict[str, list[Subscriber]] = {}
        self._publishing: set[int] = set()  # engines with a live file at the last read
        self._failures_logged: set[str] = set()

    def subscribe(self, key: str, apply: Subscriber) -> None:
        """Call ``apply(engine_idx, values)`` after each read, for every engine that publishes ``key``."""
        self._subscribers.setdefault(key, []).append(apply)

    def publishing(self, engine_idx: int) -> bool:
        """Whether the engine had a live process at the last read."""
        return engine_idx in self._publishing

    def start(self) -> None:
        """Read on a daemon thread until this view is garbage-collected."""
        threading.Thread(target=_read_while_alive, args=(weakref.ref(self),), name="kvcompose-live-view",
                         daemon=True).start()

    def read(self) -> None:
        """Read every live file of the engines now and call the subscribers."""
        documents: dict[int, list[dict[str, Any]]] = {}
        try:
            entries = list(os.scandir(self._directory))
        except OSError:
            entries = []
        for entry in entries:
            match = _FILE.fullmatch(entry.name)
            if match is None or entry.name.startswith(".") or (index := self._engines.get(match["engine"])) is None:
                continue
            if not process_alive(int(match["pid"])):
                Path(entry.path).unlink(missing_ok=True)
                continue
            try:
                documents.setdefault(index, []).append(json.loads(Path(entry.path).read_text())["values"])
            except (OSError, ValueError, KeyError, TypeError):  # removed meanwhile, or not a board's
                continue
        self._publishing = set(documents)
        for key, subscribers in self._subscribers.items():
            for index, values in documents.items():
                found = [each[key] for each in values if key in each]
                if found:
                    for apply in subscribers:
                        self._apply(apply, key, index, found)

    def _apply(self, apply: Subscriber, key: str, index: int, values: list[Any]) -> None:
        try:
            apply(index, values)
        except Exception as error:  # a subscriber that fails must not stop the others, nor the thread
            if key not in self._failures_logged:
                self._failures_logged.add(key)
                log.warning("live_subscriber_failed", key=key, error_type=type(error).__name__)


def _read_while_alive(reference: weakref.ref[LiveView]) -> None:
    while (view := reference()) is not None:
        view.read()
        del view  # not held while sleeping: the view may be collected meanwhile
        time.sleep(READ_EVERY_S)
