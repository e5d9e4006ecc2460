"""Prefill/decode disaggregation: two real vLLM servers, each running a kvcompose
pipeline of NIXL plus a storage tier (examples/disaggregated), behind the
example proxy. One pair of server start-ups for the whole module."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcompose.testing.tiny_model import prompt_words

from .server_support import Server, free_port, start_server

pytestmark = pytest.mark.engine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "disaggregated"
BLOCK_SIZE = 16  # vLLM's default on the CPU backend; ExampleConnector stores whole blocks
LAYERS = 2  # the tiny model's
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
SETTLE_S = 60
# Well inside NIXL's 30 s block lease: a send nobody completed cannot pass as idle by expiring.
IDLE_WITHIN_S = 20


@dataclass
class PairOptions:
    """What both servers of the pair get besides the pipeline: extra
    environment (e.g. an OTLP endpoint) and extra server arguments."""

    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def pair_options(otlp_receiver: Any) -> PairOptions:
    """Both servers trace (vLLM and kvcompose) to the session's OTLP receiver."""
    return PairOptions(
        env={"KVCOMPOSE_TRACING": "true", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_receiver.endpoint,
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
        args=["--otlp-traces-endpoint", otlp_receiver.endpoint],
    )


@dataclass
class DisaggregatedPair:
    prefill: Server
    decode: Server
    proxy_url: str
    prefill_store: Path

    def complete(self, prompt: str, max_tokens: int = 8, headers: dict[str, str] | None = None) -> dict[str, Any]:
        """A completion through the proxy, as a client sends it."""
        body = _completion(self.decode.model, prompt, max_tokens)
        request = urllib.request.Request(f"{self.proxy_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.load(response)


@pytest.fixture(scope="module")
def pd_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            pair_options: PairOptions) -> Iterator[DisaggregatedPair]:
    """Prefill and decode servers, one core each, started side by side, and the proxy."""
    root = tmp_path_factory.mktemp("disaggregated")
    sides = {
        "prefill": {"VLLM_CPU_OMP_THREADS_BIND": "0", "KVCOMPOSE_PREFILL_STORE": str(root / "prefill-store")},
        "decode": {"VLLM_CPU_OMP_THREADS_BIND": "1", "KVCOMPOSE_DECODE_STORE": str(root / "decode-store")},
    }
    with concurrent.futures.ThreadPoolExecutor(len(sides)) as pool:
        starting = {
            side: pool.submit(
                start_server, tiny_model, _rendered(EXAMPLES / f"{side}.yaml"), root / f"{side}.log",
                env={**env, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                     "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **pair_options.env},
                extra_args=pair_options.args,
            )
            for side, env in sides.items()
        }
        servers = {side: future.result() for side, future in starting.items()}
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, str(EXAMPLES / "proxy.py"), "--prefill", servers["prefill"].url,
                              "--decode", servers["decode"].url, "--port", str(proxy_port)])
    try:
        _wait_for_health(f"http://127.0.0.1:{proxy_port}")
        yield DisaggregatedPair(servers["prefill"], servers["decode"], f"http://127.0.0.1:{proxy_port}",
                                root / "prefill-store")
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        for server in servers.values():
            server.stop()


def _completion(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def _example_proxy() -> Any:
    """examples/disaggregated/proxy.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("disaggregated_proxy", EXAMPLES / "proxy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rendered(pipeline: Path) -> str:
    """Exactly what `kvcompose render` prints for the pipeline file."""
    return subprocess.run([sys.executable, "-m", "kvcompose", "render", str(pipeline)],
                          capture_output=True, text=True, check=True).stdout.strip()


def _wait_for_health(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _total(metrics: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    from kvcompose.exposition import read

    return read(metrics, ("kvcompose_", "vllm:")).total(name, **labels)


def _settled(server: Server, done: Callable[[str], bool], timeout_s: float = SETTLE_S) -> str:
    """The server's /metrics once ``done`` holds (the last step's stats arrive a moment late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if done(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def _stored_prompts(store: Path) -> set[Path]:
    return {path.parent for path in store.rglob("*.safetensors")}


def _expected(plain_llm: Any, prompts: list[str], max_tokens: int = 8) -> list[str]:
    from .engine_support import greedy

    return [o.outputs[0].text for o in plain_llm.generate(prompts, greedy(max_tokens), use_tqdm=False)]


def test_a_request_through_the_proxy_decodes_the_plain_tokens_from_nixl(
    pd_pair: DisaggregatedPair, plain_llm: Any
) -> None:
    prompt = prompt_words(seed=31, length=96)
    [expected] = _expected(plain_llm, [prompt])
    prefill_before, decode_before = pd_pair.prefill.metrics(), pd_pair.decode.metrics()
    stored_before = _stored_prompts(pd_pair.prefill_store)

    response = pd_pair.complete(prompt, headers={"traceparent": TRACEPARENT})
    assert response["choices"][0]["text"] == expected, pd_pair.decode.log_tail()
    prompt_tokens = response["usage"]["prompt_tokens"]

    # The decode server received the prompt's KV over NIXL, counted by the NIXL
    # child's own metrics under its pipeline name, and computed none of the prompt.
    decode = _settled(pd_pair.decode, lambda m: _total(m, "kvcompose_loaded_tokens_total", connector="nixl")
                      > _total(decode_before, "kvcompose_loaded_tokens_total", connector="nixl"))

    def rose(name: str, **labels: str) -> float:
        return _total(decode, name, **labels) - _total(decode_before, name, **labels)

    assert rose("vllm:nixl_xfer_time_seconds_count", connector="nixl") >= 1
    assert rose("vllm:nixl_bytes_transferred_sum", connector="nixl") > 0
    assert rose("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == prompt_tokens
    assert rose("vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert rose("kvcompose_loaded_tokens_total", connector="nixl") == prompt_tokens
    assert rose("kvcompose_loaded_tokens_total", connector="store") == 0
    assert _total(decode, "vllm:nixl_num_failed_transfers_total") == 0

    # The prefill server computed the prompt and its storage child holds its KV.
    prefill = pd_pair.prefill.metrics()
    assert (_total(prefill, "vllm:prompt_tokens_by_source_total", source="local_compute")
            - _total(prefill_before, "vllm:prompt_tokens_by_source_total", source="local_compute")) == prompt_tokens
    [folder] = _stored_prompts(pd_pair.prefill_store) - stored_before
    layers = sorted(folder.glob("*.safetensors"))
    assert len(layers) == LAYERS
    from safetensors.torch import load_file

    stored_tokens = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # whole blocks, the last token left out
    assert load_file(layers[0])["kv_cache"].shape[0] == stored_tokens

    # The same prompt again: the prefill server loads it from its storage tier
    # before handing it over, and the tokens stay the same.
    assert pd_pair.complete(prompt)["choices"][0]["text"] == expected
    prefill = _settled(pd_pair.prefill, lambda m: _total(m, "kvcompose_loaded_tokens_total", connector="store")
                       > _total(prefill_before, "kvcompose_loaded_tokens_total", connector="store"))
    assert (_total(prefill, "kvcompose_loaded_tokens_total", connector="store")
            - _total(prefill_before, "kvcompose_loaded_tokens_total", connector="store")) == stored_tokens


def test_one_trace_holds_both_servers_spans(pd_pair: DisaggregatedPair, otlp_receiver: Any) -> None:
    """Prefill lookup, save to the storage tier, the NIXL hand-over and the decode-side load, in the caller's trace;
    NIXL's send (a save on the prefill side) and receive (a load on the decode side) as transfers."""
    trace_id = secrets.token_hex(16)
    before = pd_pair.decode.metrics()
    nixl_bytes_before = _total(before, "vllm:nixl_bytes_transferred_sum", connector="nixl")
    nixl_xfer_before = _total(before, "vllm:nixl_xfer_time_seconds_sum", connector="nixl")
    pd_pair.complete(prompt_words(seed=33, length=96), headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"})

    def kvcompose_calls(spans: list[Any]) -> set[tuple[str, str, str]]:
        return {(span.service, span.name, span.attributes.get("kvcompose.connector.name", ""))
                for span in spans if span.name.startswith("kvcompose.")}

    wanted = {
        ("kvcompose-prefill", "kvcompose.lookup", "nixl"), ("kvcompose-prefill", "kvcompose.lookup", "store"),
        ("kvcompose-prefill", "kvcompose.transfer save store", "store"),
        ("kvcompose-decode", "kvcompose.lookup", "nixl"),
        ("kvcompose-prefill", "kvcompose.transfer save nixl", "nixl"),  # NIXL's send, after the request ends
        ("kvcompose-decode", "kvcompose.transfer load nixl", "nixl"),
    }
    def arrived(spans: list[Any]) -> bool:  # each server exports in its own batches, vLLM's spans too
        return wanted <= kvcompose_calls(spans) and sum(s.name == "llm_request" for s in spans) >= 2

    deadline = time.monotonic() + SETTLE_S
    while not arrived(spans := [s for s in otlp_receiver.spans() if s.trace_id == trace_id]):
        assert time.monotonic() < deadline, (sorted(wanted - kvcompose_calls(spans)),
                                             sum(s.name == "llm_request" for s in spans))  # missing
        time.sleep(0.5)

    assert sum(s.name == "llm_request" for s in spans) == 2  # vLLM's own span on each server
    assert len({s.span_id for s in spans}) == len(spans)  # ids stay apart across the two servers

    def nixl_transfers(service: str) -> list[Any]:
        return [s for s in spans if s.service == service and s.name.startswith("kvcompose.transfer ")
                and s.attributes["kvcompose.connector.name"] == "nixl"]

    def described(transfers: list[Any]) -> list[tuple[str, str]]:
        return [(s.attributes["kvcompose.transfer.direction"], s.attributes["kvcompose.transfer.outcome"])
                for s in transfers]

    assert described(nixl_transfers("kvcompose-prefill")) == [("save", "ok")]  # the send
    assert described(nixl_transfers("kvcompose-decode")) == [("load", "ok")]  # the receive
    (sent,), (received,) = nixl_transfers("kvcompose-prefill"), nixl_transfers("kvcompose-decode")
    assert sent.duration_ns > 0 and received.duration_ns > 0
    # The decode side's bytes are NIXL's own count for this request.
    nixl_bytes = _settled(pd_pair.decode, lambda metrics: _total(
        metrics, "vllm:nixl_bytes_transferred_sum", connector="nixl") > nixl_bytes_before, SETTLE_S)
    moved = _total(nixl_bytes, "vllm:nixl_bytes_transferred_sum", connector="nixl") - nixl_bytes_before
    assert received.attributes["kvcompose.transfer.bytes"] == moved > 0
    # ... and its copy time NIXL's own telemetry of the transfer, not the request's wait.
    xfer_seconds = _total(nixl_bytes, "vllm:nixl_xfer_time_seconds_sum", connector="nixl") - nixl_xfer_before
    assert received.attributes["kvcompose.transfer.copy_source"] == "child"
    assert received.attributes["kvcompose.transfer.copy_seconds"] == pytest.approx(xfer_seconds, rel=1e-6)
    assert received.attributes["kvcompose.transfer.copy_seconds"] * 1e9 <= received.duration_ns


def test_ten_concurrent_requests_complete_and_leave_nothing_waiting(
    pd_pair: DisaggregatedPair, plain_llm: Any
) -> None:
    prompts = [prompt_words(seed=seed, length=96) for seed in range(40, 50)]
    expected = _expected(plain_llm, prompts)
    decode_before = pd_pair.decode.metrics()

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: pd_pair.complete(p)["choices"][0]["text"], prompts))
    assert texts == expected

    # Every async NIXL send finished (the prefill server freed the blocks it held
    # for the decode server) and every receive finished: nothing left in either.
    for server in (pd_pair.prefill, pd_pair.decode):
        metrics = _settled(server, _idle, IDLE_WITHIN_S)
        assert _idle(metrics), f"{server.url} still busy:\n{_busy_lines(metrics)}"
        assert _total(metrics, "vllm:nixl_num_kv_expired_reqs_total") == 0
    decode = pd_pair.decode.metrics()
    transfers = (_total(decode, "vllm:nixl_xfer_time_seconds_count", connector="nixl")
                 - _total(decode_before, "vllm:nixl_xfer_time_seconds_count", connector="nixl"))
    assert transfers >= len(prompts)
    assert _total(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0


BUSY_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_kv_fetch_by_stage",
               "vllm:kv_cache_usage_perc")


def _idle(metrics: str) -> bool:
    return all(_total(metrics, name) == 0 for name in BUSY_SERIES)


def _busy_lines(metrics: str) -> str:
    return "\n".join(line for line in metrics.splitlines() if line.startswith(BUSY_SERIES))


def test_the_decode_server_names_the_pipeline_setting_at_fault(pd_pair: DisaggregatedPair, plain_llm: Any) -> None:
    """The prefill server describes its pipeline in the handed-over
    kv_transfer_params; given a description whose NIXL child is a push
    connector, the decode server's log names the child setting that differs."""
    proxy = _example_proxy()
    prompt = prompt_words(seed=33, length=96)
    [expected] = _expected(plain_llm, [prompt])
    body = _completion(pd_pair.decode.model, prompt, 8)
    prefilled = proxy.post_json(f"{pd_pair.prefill.url}/v1/completions", proxy.prefill_request(body), {})
    shape = prefilled["kv_transfer_params"]["kvcompose"]
    assert shape == {"pipeline": "pd-prefill", "hybrid_kv_cache_manager": False, "children": [
        ["nixl", "NixlConnector", "NixlPullConnector"], ["store", "ExampleConnector", "ExampleConnector"]]}

    shape["children"][0][1:] = ["NixlPushConnector", "NixlPushConnector"]
    decoded = proxy.post_json(f"{pd_pair.decode.url}/v1/completions", proxy.decode_request(body, prefilled), {})
    assert decoded["choices"][0]["text"] == expected  # the servers themselves do match
    problem = ("children[0].connector: child 'nixl' is 'NixlConnector' (class NixlPullConnector) here but "
               "'NixlPushConnector' (class NixlPushConnector) in pipeline 'pd-prefill' of the server that "
               "prefilled this request")
    deadline = time.monotonic() + SETTLE_S
    while problem not in pd_pair.decode.log_tail(100_000) and time.monotonic() < deadline:
        time.sleep(0.5)
    [line] = [line for line in pd_pair.decode.log_tail(100_000).splitlines() if problem in line]
    assert "[error" in line and "prefill/decode pipelines do not match" in line and "pipeline=pd-decode" in line
