"""The fleet's shared tiers: the engine's sampler and endpoint, the aggregator's pulls, merge and /metrics, faults.

Engines here are real :class:`FleetSampler` objects behind real :class:`FleetEndpoint` HTTP servers; the
aggregator is the real :class:`FleetService` pulling them over HTTP. At rate 1 every key is sampled, so the
merged curve must equal an exact LRU of the interleaved stream at powers of two.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcompose.cli import main
from kvcompose.config import load_pipeline
from kvcompose.economics.fleet import FleetService
from kvcompose.economics.fleet_endpoint import FleetEndpoint
from kvcompose.economics.fleet_merge import FleetMerger
from kvcompose.economics.fleet_samples import FleetSampler
from kvcompose.errors import PipelineConfigError
from kvcompose.exposition import read
from kvcompose.wire.fleet import SAMPLES_PATH, FleetPayloadError, parse_batch
from tests.test_economics_accuracy import exact_lru_hit_ratios

SECRET = b"the fleet's secret"
TIER = "shared-disk"
HASH_CONFIG = b"sha256 / 16 / root"


def sampler(engine: str, rate: float = 1.0, buffer: int = 1 << 12, secret: bytes = SECRET,
            hash_config: bytes = HASH_CONFIG, clock: Callable[[], float] = time.time) -> FleetSampler:
    return FleetSampler({TIER: "disk"}, rate, secret, buffer, engine, {}, lambda: hash_config, clock)


def stream(requests: int, seed: int) -> list[list[bytes]]:
    """Requests' block hashes (32 bytes, as vLLM's SHA-256 ones), root first: shared prefixes, own suffixes."""
    rng = np.random.default_rng(seed)
    prefixes = [[rng.bytes(32) for _ in range(int(rng.integers(2, 12)))] for _ in range(40)]
    return [prefixes[int(rng.zipf(1.3)) % len(prefixes)] + [rng.bytes(32) for _ in range(int(rng.integers(1, 4)))]
            for _ in range(requests)]


@pytest.fixture
def endpoints() -> Iterator[list[FleetEndpoint]]:
    served = [FleetEndpoint(sampler(f"engine-{index}"), "127.0.0.1", 0) for index in range(3)]
    yield served
    for endpoint in served:
        endpoint.close()


def url(endpoint: FleetEndpoint) -> str:
    return f"http://127.0.0.1:{endpoint.port}"


def exposition(service: FleetService) -> str:
    registry = CollectorRegistry()
    registry.register(service)  # type: ignore[arg-type]
    return generate_latest(registry).decode()


# -- the pipeline keys -------------------------------------------------------------------------------------------

def test_a_child_names_a_shared_tier_and_the_fleet_section_sets_one_rate() -> None:
    pipeline = load_pipeline({"version": 1, "name": "p", "fleet": {"sample_rate": 0.0078125, "port": 9000},
                              "children": [{"name": "disk", "connector": "ExampleConnector", "shared": TIER}]})
    assert pipeline.children[0].shared == TIER
    assert pipeline.fleet.sample_rate == 1 / 128 and pipeline.fleet.port == 9000
    assert load_pipeline({"version": 1, "name": "p", "children": [
        {"name": "disk", "connector": "ExampleConnector"}]}).fleet.sample_rate == 1 / 256
    with pytest.raises(PipelineConfigError) as error:
        load_pipeline({"version": 1, "name": "p", "fleet": {"sample_rate": 2},
                       "children": [{"name": "disk", "connector": "ExampleConnector", "shared": "Not Safe"}]})
    message = str(error.value)
    assert "children[0].shared" in message and "fleet.sample_rate" in message
    with pytest.raises(PipelineConfigError) as error:
        load_pipeline({"version": 1, "name": "p", "metrics": {"enabled": False}, "children": [
            {"name": "a", "connector": "ExampleConnector", "shared": TIER},
            {"name": "b", "connector": "ExampleConnector", "shared": TIER}]})
    problems = str(error.value).splitlines()
    assert sum("needs metrics.enabled" in line for line in problems) == 2
    assert any("children[1].shared" in line and "already named by children[0]" in line for line in problems)


# -- the engine's side -------------------------------------------------------------------------------------------

def test_what_leaves_the_engine_is_a_keyed_digest_never_a_block_hash() -> None:
    requests = stream(200, seed=1)
    one, other_secret = sampler("a"), sampler("b", secret=b"another secret")
    for request in requests:
        one.record(request, now=1.0)
        other_secret.record(request, now=1.0)
    body = one.batch(0).to_json().decode()
    hashes = {block for request in requests for block in request}
    assert not any(block[:8].hex() in body for block in hashes)
    expected = {int.from_bytes(hashlib.blake2b(block, key=SECRET, digest_size=8).digest(), "big") for block in hashes}
    digests = {digest for request in one.batch(0).requests for digest in request.digests}
    assert digests == expected  # keyed BLAKE2b, 8 bytes
    assert digests.isdisjoint(d for r in other_secret.batch(0).requests for d in r.digests)  # another secret
    assert one.probe() != other_secret.probe()  # and the probe says so


def test_the_fixed_threshold_samples_the_same_keys_on_every_engine() -> None:
    requests = stream(400, seed=2)
    engines = [sampler(name, rate=1 / 8) for name in "ab"]
    for index, request in enumerate(requests):
        engines[index % 2].record(request, now=float(index))
    sampled = [{d for r in engine.batch(0).requests for d in r.digests} for engine in engines]
    shared_blocks = {block for index, request in enumerate(requests) if index % 2 == 0 for block in request} & {
        block for index, request in enumerate(requests) if index % 2 == 1 for block in request}
    shared_sampled = {d for block in shared_blocks
                      if (d := int.from_bytes(hashlib.blake2b(block, key=SECRET, digest_size=8).digest(), "big"))
                      < (1 << 64) / 8}
    assert shared_sampled and shared_sampled <= sampled[0] & sampled[1]
    total = sum(len(request) for request in requests)
    share = sum(len(r.digests) for engine in engines for r in engine.batch(0).requests) / total
    assert 1 / 16 < share < 1 / 4


def test_the_buffer_is_bounded_and_counts_what_it_dropped_unpulled() -> None:
    bounded = sampler("a", buffer=16, clock=lambda: 40.0)
    for index in range(10):
        bounded.record([bytes([index]) * 32], now=float(index))
    assert bounded.batch(0).next == 10 and bounded.dropped == 0
    for index in range(10, 40):
        bounded.record([bytes([index]) * 32], now=float(index))
    batch = bounded.batch(10)
    assert bounded.buffered == 16 and bounded.dropped == 40 - 10 - 16
    assert [r.sequence for r in batch.requests] == list(range(25, 41)) and batch.first == 25
    merger = FleetMerger(clock=lambda: 40.0)
    merger.add("a", bounded.batch(0))
    assert merger.engines["a"].lost == 24  # sequence numbers 1..24 never reached this aggregator


# -- the aggregator over HTTP ------------------------------------------------------------------------------------

def test_merged_samples_pulled_over_http_equal_an_exact_lru_of_the_interleaved_stream(
        endpoints: list[FleetEndpoint], tmp_path: Path) -> None:
    requests = stream(3000, seed=3)
    start = time.time()
    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, half_life_s=None)
    service = FleetService(merger, lambda: [url(endpoint) for endpoint in endpoints], timeout_s=10)
    for index, request in enumerate(requests):
        endpoints[index % 3].sampler.record(request, now=start + index * 1e-4)
        if index % 700 == 699:  # pulls in between, as a running service would
            for pull in service.round(now=0.0):
                pull.result()
    summary = service.run_once()
    service.close()
    sizes = [16, 64, 256, 1024, 4096]
    merged = [ratio for _, ratio in merger.curve(TIER, sizes)]
    keys = [np.array([int.from_bytes(block[:8], "big") for block in request], dtype=np.uint64)
            for request in requests]
    exact = exact_lru_hit_ratios(keys, sizes, tmp_path)
    assert merged == pytest.approx(exact, abs=1e-9)
    figures = summary["tiers"][TIER]
    assert figures["engines"] == 3 and figures["children"] == ["disk"] and figures["disagreement"] is None
    assert figures["references"] == sum(len(request) for request in requests)
    text = exposition(service)
    samples = read(text, ("kvcompose_fleet_",)).samples
    points = {int(s.labels["size_blocks"]): s.value for s in samples["kvcompose_fleet_cache_size_hit_ratio"]}
    assert points[256] == pytest.approx(exact[2])
    assert read(text, ("kvcompose_fleet_",)).total("kvcompose_fleet_references_total", tier=TIER) == \
        figures["references"]
    assert read(text, ("kvcompose_fleet_",)).total("kvcompose_fleet_targets", state="up") == 3


def test_once_merges_after_every_pull_landed(endpoints: list[FleetEndpoint], monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvcompose fleet --once`` with lateness_s 0: a merge between two pulls would take the first engine's
    requests and put the second's after them as late, whatever their times."""
    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, half_life_s=None)
    service = FleetService(merger, lambda: [url(endpoint) for endpoint in endpoints], timeout_s=10)
    for index, request in enumerate(stream(300, seed=6)):
        endpoints[index % 3].sampler.record(request)
    engines_up_at_merge = []
    merge = merger.merge

    def counting_merge(now: float | None = None) -> int:
        engines_up_at_merge.append(sum(state.up for state in merger.engines.values()))
        return merge(now)

    monkeypatch.setattr(merger, "merge", counting_merge)
    service.run_once()
    service.close()
    assert engines_up_at_merge == [3] and merger.late_requests == 0


def test_an_engine_that_stops_mid_run_is_counted_and_the_rest_keep_merging(endpoints: list[FleetEndpoint]) -> None:
    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, half_life_s=None)
    service = FleetService(merger, lambda: [url(endpoint) for endpoint in endpoints], timeout_s=5)
    requests = stream(600, seed=4)
    for index, request in enumerate(requests[:300]):
        endpoints[index % 3].sampler.record(request)
    service.run_once()
    endpoints[2].close()  # the third engine goes away
    for index, request in enumerate(requests[300:]):
        endpoints[index % 2].sampler.record(request)
    summary = service.run_once()
    service.close()
    assert summary["targets"][url(endpoints[2])]["up"] is False
    assert summary["targets"][url(endpoints[2])]["failures"] == {"unreachable": 1}
    assert summary["pull_failures"] == {"unreachable": 1}
    assert summary["tiers"][TIER]["references"] == sum(len(request) for request in requests)
    assert summary["tiers"][TIER]["curve"]
    assert read(exposition(service), ("kvcompose_fleet_",)).total("kvcompose_fleet_targets", state="down") == 1


class _Answering:
    """An HTTP server answering every pull with what the test sets; ``hold`` keeps it from answering."""

    def __init__(self) -> None:
        self.body = b""
        self.hold = threading.Event()
        self.hold.set()
        answering = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answering.hold.wait()
                self.send_response(200)
                self.send_header("Content-Length", str(len(answering.body)))
                self.end_headers()
                self.wfile.write(answering.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_slow_engine_delays_no_other_pull_and_no_merge(endpoints: list[FleetEndpoint]) -> None:
    slow = _Answering()
    slow.hold.clear()  # it will not answer while the test looks
    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, half_life_s=None)
    service = FleetService(merger, lambda: [slow.url, *(url(endpoint) for endpoint in endpoints)], timeout_s=1)
    for index, request in enumerate(stream(300, seed=5)):
        endpoints[index % 3].sampler.record(request)
    pulls = service.round()
    for pull in pulls[1:]:
        pull.result()  # the others' pulls finish while the slow one still waits
    service.merge(float("inf"))
    assert service.summary()["tiers"][TIER]["engines"] == 3 and service.summary()["tiers"][TIER]["curve"]
    assert not pulls[0].done()
    assert len(service.round()) == 3  # no second pull of a target whose first is still in flight
    pulls[0].result()
    slow.close()
    service.close()
    assert service.summary()["pull_failures"] == {"timeout": 1}


HOSTILE = {
    "not JSON": b"\x00\xff garbage",
    "a list": b"[1, 2, 3]",
    "deeply nested": b"[" * 100000 + b"]" * 100000,
    "wrong format": json.dumps({"format": 99}).encode(),
    "rate above 1": None,
    "NaN time": None,
    "digests not hex": None,
    "sequence numbers going back": None,
    "a negative count": None,
    "a huge count": None,
    "a far-future clock": None,
    "tiers not names": None,
}


def _hostile_bodies() -> dict[str, bytes]:
    engine = sampler("h", clock=lambda: 1000.0)
    engine.record([b"\x01" * 32, b"\x02" * 32], now=1000.0)
    engine.record([b"\x03" * 32], now=1000.5)
    good = json.loads(engine.batch(0).to_json())
    good["time"] = 1000.0

    def changed(**fields: object) -> bytes:
        return json.dumps({**good, **fields}).encode().replace(b"NaN", b"NaN")

    requests = good["requests"]
    bodies = {name: body for name, body in HOSTILE.items() if body is not None}
    bodies.update({
        "rate above 1": changed(sample_rate=3.0),
        "NaN time": changed(time=float("nan")),
        "digests not hex": changed(requests=[[1, 1000.0, 2, "zz" * 8]]),
        "sequence numbers going back": changed(requests=[requests[1], requests[0]]),
        "a negative count": changed(references=-5),
        "a huge count": changed(next=1 << 70),
        "a far-future clock": changed(time=1e18),
        "tiers not names": changed(tiers={"x": 5}),
    })
    return bodies


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_at_the_aggregator_is_a_clear_one_line_error_and_changes_nothing(case: str) -> None:
    body = _hostile_bodies()[case]
    merger = FleetMerger(clock=lambda: 1000.0)
    with pytest.raises(FleetPayloadError) as error:
        merger.add("h", parse_batch(body))
    assert "\n" not in str(error.value) and len(str(error.value)) < 200
    assert merger.engines.get("h") is None or merger.engines["h"].instance is None
    assert merger.merge(float("inf")) == 0


def test_hostile_answers_over_http_are_counted_and_the_service_keeps_serving(endpoints: list[FleetEndpoint]) -> None:
    hostile = _Answering()
    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, half_life_s=None)
    service = FleetService(merger, lambda: [hostile.url, url(endpoints[0])], timeout_s=5)
    endpoints[0].sampler.record(stream(1, seed=6)[0])
    bodies = _hostile_bodies()
    for body in bodies.values():
        hostile.body = body
        service.run_once()
    hostile.close()
    service.close()
    assert service.summary()["pull_failures"] == {"bad_answer": len(bodies)}
    assert service.summary()["tiers"][TIER]["engines"] == 1
    assert "kvcompose_fleet_cache_size_hit_ratio" in exposition(service)


def test_an_engine_refuses_a_bad_cursor(endpoints: list[FleetEndpoint]) -> None:
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(f"{url(endpoints[0])}{SAMPLES_PATH}?after=-1", timeout=10)
    assert error.value.code == 400


# -- keys that cannot agree --------------------------------------------------------------------------------------

@pytest.mark.parametrize("difference", ["hash_config", "secret", "rate"])
def test_engines_whose_keys_cannot_agree_get_a_clear_message_not_a_curve(difference: str) -> None:
    other = {"hash_config": {"hash_config": b"xxhash / 16 / a random root"},
             "secret": {"secret": b"another fleet's secret"}, "rate": {"rate": 0.5}}[difference]
    engines = [sampler("engine-a", clock=lambda: 1100.0),
               sampler("engine-b", clock=lambda: 1100.0, **other)]  # type: ignore[arg-type]
    for index, request in enumerate(stream(100, seed=7)):
        engines[index % 2].record(request, now=1000.0 + index)
    merger = FleetMerger(lateness_s=0.0, clock=lambda: 1100.0)
    for index, engine in enumerate(engines):
        merger.add(f"http://e{index}", engine.batch(0))
    merger.merge()
    message = merger.disagreement(TIER)
    assert message is not None and "engine-a" in message and "engine-b" in message
    assert ("cannot agree" in message) if difference != "rate" else ("different rates" in message)
    assert merger.curve(TIER) == []


# -- the command -------------------------------------------------------------------------------------------------

def test_kvcompose_fleet_once_prints_the_tiers(endpoints: list[FleetEndpoint],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    for index, request in enumerate(stream(200, seed=8)):
        endpoints[index % 3].sampler.record(request)
    assert main(["fleet", "--once", "--lateness", "0", "--capacity", f"{TIER}=512",
                 *(arg for endpoint in endpoints for arg in ("--target", url(endpoint)))]) == 0
    figures = json.loads(capsys.readouterr().out)["tiers"][TIER]
    assert figures["engines"] == 3 and figures["capacity_blocks"] == 512
    assert 512 in [size for size, _ in figures["curve"]]


def test_kvcompose_fleet_refuses_bad_options_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_status:
        main(["fleet", "--prometheus", "http://p:9090", "--capacity", "t=-1", "--interval", "0"])
    assert exit_status.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all("Traceback" not in line for line in lines)


# -- kvcompose advise --fleet ------------------------------------------------------------------------------------

def test_advise_fleet_sizes_a_shared_tier_by_the_fleet_curve_and_sums_its_value_over_engines(
        endpoints: list[FleetEndpoint], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_economics_advise import TIERS, registry, run, write

    for index, request in enumerate(stream(400, seed=9)):
        endpoints[index % 3].sampler.record(request)
    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, capacities={TIER: 64})
    service = FleetService(merger, lambda: [url(endpoint) for endpoint in endpoints])
    service.run_once()
    service.close()
    fleet = tmp_path / "fleet.txt"
    fleet.write_text(exposition(service))
    # Two engines' /metrics in one file, and a copy of it standing for two more: counters add up.
    engines = write(tmp_path / "engines.txt", registry(net_negative_disk=False))
    status, out, err = run(["advise", "--metrics", str(engines), "--fleet", str(fleet), "--json"], capsys)
    assert status == 0, err
    shared = json.loads(out)["shared_tiers"]
    assert [tier["tier"] for tier in shared] == [TIER] and shared[0]["children"] == ["disk"]
    saved = sum(TIERS["disk"]["saved_s"]) * 10  # the scenario's disk tier, both engines, when it pays
    wait = sum(TIERS["disk"]["wait"]["load"])
    assert shared[0]["prefill_saved_s"] == pytest.approx(saved) and shared[0]["load_wait_s"] == pytest.approx(wait)
    assert shared[0]["net_s"] == pytest.approx(saved - wait) and shared[0]["engines"] == 3
    curve = dict(merger.curve(TIER))
    assert shared[0]["hit_ratio_at_capacity"] == pytest.approx(curve[64])
    status, out, _ = run(["advise", "--metrics", str(engines), "--metrics", str(engines), "--fleet", str(fleet)],
                         capsys)
    assert status == 0 and f"shared tier {TIER}" in out and f"net {2 * (saved - wait):+.3g} s" in out
    # Where it does not pay, summed over the engines, advise exits 1 and names it.
    losing = write(tmp_path / "losing.txt", registry(net_negative_disk=True))
    status, out, _ = run(["advise", "--metrics", str(losing), "--fleet", str(fleet), "--json"], capsys)
    assert status == 1 and TIER in json.loads(out)["net_negative"]


def test_advise_fleet_refuses_what_is_not_the_aggregators_metrics(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_economics_advise import registry, run, write

    engines = write(tmp_path / "engines.txt", registry())
    status, _, err = run(["advise", "--metrics", str(engines), "--fleet", str(engines)], capsys)
    assert status == 2 and err.strip().count("\n") == 0 and "not the /metrics of kvcompose fleet" in err


def test_every_fleet_series_is_documented(endpoints: list[FleetEndpoint]) -> None:
    import urllib.request

    endpoints[0].sampler.record(stream(1, seed=10)[0])
    nowhere = endpoints[1]
    nowhere.close()  # a target that does not answer, so that the failure counter has a sample
    service = FleetService(FleetMerger(lateness_s=0.0, capacities={TIER: 64}), lambda: [url(endpoints[0]), url(nowhere)])
    service.run_once()
    service.close()
    with urllib.request.urlopen(f"{url(endpoints[0])}/metrics", timeout=10) as response:
        engine_metrics = response.read().decode()
    names = {sample for text in (exposition(service), engine_metrics)
             for sample in read(text, ("kvcompose_fleet_",)).samples}
    assert len(names) >= 14
    docs = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    assert sorted(name for name in names if f"`{name}`" not in docs) == []


def test_kvcompose_fleet_finds_the_engines_in_a_real_prometheus_targets_api(
        endpoints: list[FleetEndpoint], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.prometheus_support import JOB, start_prometheus

    for request in stream(50, seed=11):
        endpoints[0].sampler.record(request)
    # Prometheus scrapes the engine's fleet endpoint as a target (it reports it up: its /metrics parses).
    prometheus = start_prometheus(url(endpoints[0]), tmp_path)
    try:
        assert main(["fleet", "--once", "--lateness", "0", "--prometheus", prometheus.url, "--job", JOB]) == 0
        figures = json.loads(capsys.readouterr().out)
        assert main(["fleet", "--once", "--prometheus", prometheus.url, "--job", "another-job"]) == 0
        nobody = json.loads(capsys.readouterr().out)
    finally:
        prometheus.stop()
    assert list(figures["targets"]) == [url(endpoints[0])]
    assert figures["tiers"][TIER]["references"] == endpoints[0].sampler.references
    assert nobody["targets"] == {} and nobody["tiers"] == {}


def test_the_service_serves_its_metrics_and_keeps_pulling(endpoints: list[FleetEndpoint], tmp_path: Path) -> None:
    import subprocess
    import sys
    import urllib.request

    from tests.prometheus_support import wait
    from tests.server_support import free_port, stop_process

    port = free_port()
    log = tmp_path / "fleet.log"
    with log.open("wb") as sink:
        service = subprocess.Popen(
            [sys.executable, "-m", "kvcompose", "fleet", "--listen", f"127.0.0.1:{port}", "--interval", "0.2",
             "--lateness", "0", *(arg for endpoint in endpoints for arg in ("--target", url(endpoint)))],
            stdout=sink, stderr=subprocess.STDOUT)

    def references() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return read(response.read().decode(), ("kvcompose_fleet_",)).total(
                "kvcompose_fleet_references_total", tier=TIER)

    try:
        requests = stream(100, seed=12)
        for index, request in enumerate(requests[:50]):
            endpoints[index % 3].sampler.record(request)
        wait(lambda: references() == sum(len(request) for request in requests[:50]), 60, log.read_text)
        for index, request in enumerate(requests[50:]):  # later traffic reaches it at the next pulls
            endpoints[index % 3].sampler.record(request)
        wait(lambda: references() == sum(len(request) for request in requests), 60, log.read_text)
    finally:
        stop_process(service)


# -- the engine's wiring -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("secret", ["", "s3cret"])
def test_the_scheduler_samples_for_its_shared_tier_only_with_the_fleets_secret(
        secret: str, vllm_config_with: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.request

    from kvcompose.connectors.children import child_specs
    from kvcompose.instrumentation import stream_sampler
    from tests.test_economics_reports import _admitted

    pipeline = {"version": 1, "name": "fleet", "fleet": {"host": "127.0.0.1", "port": 0, "sample_rate": 1.0},
                "children": [{"name": "disk", "connector": "ExampleConnector", "shared": TIER,
                              "config": {"shared_storage_path": "/nonexistent"}}]}
    config = vllm_config_with({"kv_connector": "KVComposeConnector", "kv_connector_module_path": "kvcompose.connectors",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline}})
    config.cache_config.num_gpu_blocks = 300
    monkeypatch.setenv("KVCOMPOSE_FLEET_SECRET", secret)
    loaded = load_pipeline(pipeline)
    sampler = stream_sampler(child_specs(config, loaded), (0,), config, None, loaded)
    assert sampler is not None
    if not secret:
        assert sampler.fleet is None  # no digest leaves an engine without the fleet's secret
        return
    assert sampler.fleet is not None
    try:
        request = _admitted(list(range(16 * 4)))  # a real vLLM request: 4 blocks, hashed as the engine does
        sampler.admitted(request)
        with urllib.request.urlopen(f"http://127.0.0.1:{sampler.fleet.endpoint.port}{SAMPLES_PATH}?after=0",
                                    timeout=10) as response:
            batch = parse_batch(response.read())
    finally:
        sampler.close()
    expected = tuple(int.from_bytes(hashlib.blake2b(block, key=secret.encode(), digest_size=8).digest(), "big")
                     for block in request.block_hashes)
    assert batch.tiers == {TIER: "disk"} and batch.references == 4 and batch.requests[0].digests == expected
    assert batch.probe is not None  # vLLM's root hash is set (the request above was hashed with it)


def test_a_restarted_engine_is_pulled_from_its_new_beginning(tmp_path: Path) -> None:
    first = FleetEndpoint(sampler("engine-a"), "127.0.0.1", 0)
    port = first.port
    merger = FleetMerger(max_size_blocks=4096, lateness_s=0.0, half_life_s=None)
    service = FleetService(merger, lambda: [f"http://127.0.0.1:{port}"])
    requests = stream(60, seed=13)
    for request in requests[:40]:
        first.sampler.record(request)
    service.run_once()
    first.close()
    again = FleetEndpoint(sampler("engine-a"), "127.0.0.1", port)  # the same engine, started anew
    try:
        for request in requests[40:]:
            again.sampler.record(request)
        summary = service.run_once()
    finally:
        again.close()
        service.close()
    assert summary["tiers"][TIER]["references"] == sum(len(request) for request in requests)
    assert summary["targets"][f"http://127.0.0.1:{port}"]["lost_requests"] == 0
