"""The loader's bounds: no input hangs it, exhausts memory or gets past it unrefused.

Every test runs under :func:`time_limit`, which turns a hang into a failure.
The limits are generous (a hang is minutes, the loader takes milliseconds);
how fast the loader is belongs in the report, not in a test.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.config import load_pipeline
from kvcompose.errors import PipelineConfigError
from kvcompose.source import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES

HANG_LIMIT_S = 20.0
VALID_HEAD = "version: 1\nname: x\nchildren:\n  - name: a\n    connector: ExampleConnector\n    config:\n"


@contextlib.contextmanager
def time_limit(seconds: float = HANG_LIMIT_S) -> Iterator[None]:
    """Fail the block with TimeoutError when it runs longer than ``seconds`` (a hang, not slowness)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: the loader hangs on this input")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def alias_fan_out(levels: int, width: int = 9) -> str:
    """Billion laughs: each level is a list of ``width`` aliases of the level below."""
    names = [f"l{level}" for level in range(levels)]
    lines = [f"      {names[0]}: &{names[0]} [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"      {names[i]}: &{names[i]} [" + ", ".join([f"*{names[i - 1]}"] * width) + "]"
              for i in range(1, levels)]
    return VALID_HEAD + "\n".join(lines) + "\n"


def refusal(source: object) -> list[str]:
    with time_limit(), pytest.raises(PipelineConfigError) as caught:
        load_pipeline(source)  # type: ignore[arg-type]
    return str(caught.value).splitlines()


@pytest.mark.parametrize("levels", [7, 9, 30])
def test_alias_fan_out_is_refused(tmp_path: Path, levels: int) -> None:
    # 9 ** levels items once expanded; before the bound, 7 levels took 15 s and 9 never finished.
    path = tmp_path / "laughs.yaml"
    path.write_text(alias_fan_out(levels))
    assert len(path.read_bytes()) < 2500
    assert refusal(path) == [f"{path}: the document holds more than {MAX_NODES} values, keys and list items "
                             f"(counting aliases as written out); a pipeline may hold at most {MAX_NODES}"]


def test_merge_key_fan_out_is_refused(tmp_path: Path) -> None:
    lines = ["      m0: &m0 {a: 1, b: 2}"]
    lines += [f"      m{i}: &m{i} [" + ", ".join([f"{{<<: *m{i - 1}, k: {j}}}" if i == 1 else f"*m{i - 1}"
                                                for j in range(8)]) + "]" for i in range(1, 9)]
    path = tmp_path / "merges.yaml"
    path.write_text(VALID_HEAD + "\n".join(lines) + "\n")
    assert "more than 20000 values" in refusal(path)[0]


def test_a_modest_alias_fan_out_loads(tmp_path: Path) -> None:
    path = tmp_path / "small.yaml"
    path.write_text(alias_fan_out(3, width=5))  # 5 + 25 + 125 items: well under the bound
    with time_limit():
        config = load_pipeline(path).children[0].config
    assert config["l2"] == [[["lol"] * 5] * 5] * 5


def test_the_node_bound_counts_every_value(tmp_path: Path) -> None:
    # The other nodes: the root mapping, 3 keys, 2 values, the children list, the child mapping,
    # 3 keys, 2 values, the config mapping, its key v and the list itself.
    overhead = 16
    fits = tmp_path / "fits.yaml"
    fits.write_text(VALID_HEAD + "      v: [" + ",".join(["1"] * (MAX_NODES - overhead)) + "]\n")
    with time_limit():
        assert len(load_pipeline(fits).children[0].config["v"]) == MAX_NODES - overhead
    over = tmp_path / "over.yaml"
    over.write_text(VALID_HEAD + "      v: [" + ",".join(["1"] * (MAX_NODES - overhead + 1)) + "]\n")
    assert "more than 20000 values" in refusal(over)[0]


@pytest.mark.parametrize("opening", ["[", "{", "- ", "[a: "])
def test_deep_nesting_is_refused_without_recursion(tmp_path: Path, opening: str) -> None:
    # Up to 500k levels: libyaml's scanner is quadratic in the depth, so reading stops at the bound.
    path = tmp_path / "deep.yaml"
    path.write_text((opening * 500_000)[:MAX_FILE_BYTES])
    assert refusal(path) == [f"{path}:1: the document nests deeper than {MAX_DEPTH} levels "
                             "(counting aliases as written out)"]


def test_nesting_through_aliases_is_refused(tmp_path: Path) -> None:
    lines = ["      d0: &d0 [x]"] + [f"      d{i}: &d{i} [[[[*d{i - 1}]]]]" for i in range(1, 20)]
    path = tmp_path / "deep_aliases.yaml"
    path.write_text(VALID_HEAD + "\n".join(lines) + "\n")
    assert refusal(path) == [f"{path}: the document nests deeper than {MAX_DEPTH} levels "
                             "(counting aliases as written out)"]


def test_files_over_one_mebibyte_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(VALID_HEAD + "      pad: '" + "x" * MAX_FILE_BYTES + "'\n")
    assert refusal(path) == [f"{path}: file is larger than 1 MiB ({MAX_FILE_BYTES} bytes), the most read"]
    at_limit = tmp_path / "at_limit.yaml"
    text = VALID_HEAD + "      pad: ''\n"
    at_limit.write_text(text[:-2] + "x" * (MAX_FILE_BYTES - len(text)) + "'\n")
    assert len(at_limit.read_bytes()) == MAX_FILE_BYTES
    with time_limit():
        assert len(load_pipeline(at_limit).children[0].config["pad"]) == MAX_FILE_BYTES - len(text)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "pipeline.fifo"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    assert refusal(fifo) == [f"{fifo}: is a FIFO (named pipe), not a regular file"]
    assert refusal(Path("/dev/zero")) == ["/dev/zero: is a character device, not a regular file"]
    assert refusal(Path("/dev/null")) == ["/dev/null: is a character device, not a regular file"]
    link = tmp_path / "link.yaml"
    link.symlink_to(fifo)
    assert refusal(link) == [f"{link}: is a FIFO (named pipe), not a regular file"]


def test_mappings_are_bounded_too() -> None:
    shared: Any = ["lol"]
    for _ in range(40):
        shared = [shared, shared]  # 2 ** 40 items once expanded, 41 objects in memory
    child = {"name": "a", "connector": "ExampleConnector", "config": {"v": shared}}
    assert "more than 20000 values" in refusal({"version": 1, "name": "x", "children": [child]})[0]
    cyclic: dict[str, Any] = {"version": 1, "name": "x"}
    cyclic["children"] = [{"name": "a", "connector": "ExampleConnector", "config": cyclic}]
    assert refusal(cyclic) == [f"the document nests deeper than {MAX_DEPTH} levels (counting aliases as written out)"]
