"""Batch scaling on the CPU engine: process CPU per output token at batches of 8, 64 and 256 prompts.

Each engine (tiny model, engine core in its process) has two children: vLLM's
OffloadingConnector on kvcompose's CPU spec (``kvcompose.offload.spec``: real
asynchronous saves and loads on its copy thread) and a no-op child
(``kvcompose.testing.noop``). Prefix caching is off, and half of every batch
repeats the latest new prompts (stored in the offload tier by then), so every
batch both saves and loads. Configurations:

- ``multi``: vLLM's MultiConnector;
- ``multi_twin``: the same again, in a process of its own: what two identical
  engines read apart in this run (the measurement's floor);
- ``kvc_shipped``: KVComposeConnector as shipped (``kvcompose.config``'s
  defaults: metrics on, tracing off);
- ``kvc_receipts``: as shipped with ``receipts: true``, every request carrying
  a router's prediction (``PREDICTION``: right for the repeats, over for the
  new prompts), so each gets a receipt and the router counters count it
  (docs/receipts.md);
- ``kvc_request10``: tracing at request granularity, 10% of requests sampled
  (``tracing.sample_ratio: 0.1``);
- ``kvc_step``: tracing at step granularity, every request.

The traced ones export over OTLP/HTTP to a collector stand-in on loopback
(``benchmarks/otlp_sink.py``, in this process), so export really runs.

Each configuration's engine runs in its own process, all alive together (as in
``benchmarks/end_to_end.py``: no module globals, tracer provider or Prometheus
registry shared). A round asks every engine, in a rotating order, for one
batch of 8 prompts, then every engine for 64, then for 256, each prompt
generating ``OUTPUT_TOKENS`` (``ignore_eos``). The figure is the process CPU
per output token: the engine process's (``time.process_time``, every thread:
the engine's, the offload copy thread, kvcompose's span outbox thread) over the
``generate()`` call and the shipping of its spans, plus that of the span
exporter process the engine started where it traces (found as
``python -m kvcompose.tracing.export_process``, see
``benchmarks/stopwatch.py``). The exporter reads and exports up to
``EXPORT_SETTLED_S`` after the engine shipped, so its CPU is charged per
measurement from the measurement's start to the engine's next one, and a
traced engine is not asked again before that long after its last batch ended.
Ratios to MultiConnector are taken within each round and the median over
rounds is reported, beside ``multi_twin``'s ratio. Time to first token is the
median over a batch's requests (arrival to first token, queueing behind the
batch's prefill included); tokens/s is output tokens over the call's wall time.

Default rounds: ``ROUNDS`` (8), to keep the part near 4 minutes on 2 cores: one
engine alone starts in about 12 s and takes 3.7 s a round (the batch of 256
2.5 s of it), so five took about 20 s a round and started in about 40 s (each
configuration adds about as much). On a
machine busy with other work it takes longer (at a load of 9: 152 s to start,
27 s a round, 6 min 39 s in all); ``--rounds`` shortens it. With 8 rounds the
twin's ratio strays a few percent from 1 (more on a busy machine).

``python -m benchmarks.batch_scaling --profile FILE`` instead profiles kvcompose
as shipped, then MultiConnector, at batch 256 (cProfile, the engine's thread:
the engine core runs on it) and writes the functions in ``kvcompose/`` with
the most own time, and each connector call's time under both (and the raw
profiles beside it, for ``pstats``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import end_to_end
from benchmarks.end_to_end import ENGINE_ENV, REPO
from benchmarks.engine_run import Prompts, generate
from benchmarks.otlp_sink import OtlpSink

CONFIGURATIONS = ("multi", "multi_twin", "kvc_shipped", "kvc_receipts", "kvc_request10", "kvc_step")
TRACING = {"kvc_request10": {"granularity": "request", "sample_ratio": 0.1},
           "kvc_step": {"granularity": "step", "sample_ratio": 1.0}}
BASELINE, TWIN = "multi", "multi_twin"
RECEIPTS = "kvc_receipts"
BATCHES = (8, 64, 256)
OUTPUT_TOKENS = 64
ROUNDS = 8
PROMPT_WORDS = 160  # with the BOS token 161: one full 128-token block (the CPU engine's) is saved and loaded
# A router's prediction on every request of kvc_receipts: the one block a repeat loads (a new prompt has none).
PREDICTION = {"kvcompose": {"predicted_cached_tokens": 128}}
KV_BLOCKS = 1024  # a batch of 256 holds 512 blocks (161 + 64 tokens each), plus those held while saves finish
OFFLOAD_BYTES = 64 << 20  # 512 blocks of 128 KiB: the latest 256 prompts, the repeats among them, stay stored
NOOP_MODULE = "kvcompose.testing.noop"
# The exporter process reads its pipe every 1 s and exports every 2 s (kvcompose.tracing.export_process), so the
# spans of a batch are exported within 3 s of its end.
EXPORT_SETTLED_S = 3.5
STOP_TIMEOUT_S = 60
FIGURES = ("cpu_us_per_token", "tokens_per_s", "ttft_ms")  # ratios to MultiConnector, per round
PROFILED_BATCHES = 3
PROFILE_TOP = 25


def kv_transfer_config(name: str, endpoint: str) -> dict[str, Any]:
    """The engine's kv_transfer_config for a configuration; ``endpoint``: where the traced ones export."""
    from kvcompose.config import load_pipeline
    from kvcompose.offload import SPEC_MODULE, SPEC_NAME
    from kvcompose.render import kv_transfer_config as render

    offload = {"spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE, "cpu_bytes_to_use": OFFLOAD_BYTES}
    if name in (BASELINE, TWIN):
        children = [{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": offload},
                    {"kv_connector": "NoopConnector", "kv_connector_module_path": NOOP_MODULE, "kv_role": "kv_both",
                     "kv_connector_extra_config": {}}]
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"connectors": children}}
    pipeline: dict[str, Any] = {"version": 1, "name": "bench", "children": [
        {"name": "offload", "connector": "OffloadingConnector", "config": offload},
        {"name": "noop", "connector": "NoopConnector", "module_path": NOOP_MODULE},
    ]}
    if name in TRACING:
        pipeline["tracing"] = {"enabled": True, "exporter": "otlp", "endpoint": endpoint, **TRACING[name]}
    if name == RECEIPTS:
        pipeline["receipts"] = True
    return render(load_pipeline(pipeline), pipeline)


class BatchEngine:
    """One engine, measured a batch at a time (in the engine's own process)."""

    def __init__(self, kv_transfer_config: dict[str, Any]) -> None:
        from kvcompose.testing.tiny_model import ensure_tiny_model
        from tests.engine_support import start_llm

        self._llm = start_llm(ensure_tiny_model(), kv_transfer_config, disable_log_stats=False,
                              num_gpu_blocks_override=KV_BLOCKS, max_num_seqs=max(BATCHES))
        self._prompts = Prompts(PROMPT_WORDS)
        pipeline = kv_transfer_config["kv_connector_extra_config"].get("pipeline", {})
        self._kv_transfer_params = PREDICTION if pipeline.get("receipts") else None  # a router in front of it
        # Warm-up: the largest batch, all new (stored: the first round's repeats), then a small one that loads.
        generate(self._llm, [self._prompts.new() for _ in range(max(BATCHES))], 8)
        self.measure(min(BATCHES))
        self._exporter_mark = _caught_up_exporter_cpu_s()  # the exporter's start (imports) is not charged

    def measure(self, batch: int, profiler: Any = None) -> dict[str, Any]:
        """One batch: half repeats (loaded), half new (saved). ``exporter_s_before``: the span exporter's CPU
        since the previous measurement began (that measurement's share: see the module's docstring).
        ``profiler``: a cProfile profiler, on while the batch is generated and its spans shipped."""
        from benchmarks.stopwatch import exporter_cpu_s
        from kvcompose.tracing import force_flush

        prompts = self._prompts.batch(batch)
        exporter_now = exporter_cpu_s()
        exporter_before = exporter_now - getattr(self, "_exporter_mark", exporter_now)
        self._exporter_mark = exporter_now
        if profiler is not None:
            profiler.enable()
        began, began_cpu = time.perf_counter(), time.process_time()
        outputs = generate(self._llm, prompts, OUTPUT_TOKENS, self._kv_transfer_params)
        wall_s = time.perf_counter() - began
        force_flush()  # the batch's spans leave for the exporter process (the outbox thread would within 0.1 s)
        cpu_s = time.process_time() - began_cpu
        if profiler is not None:
            profiler.disable()
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        return {"batch": batch, "tokens": tokens, "wall_s": wall_s, "engine_cpu_s": cpu_s,
                "tokens_per_s": tokens / wall_s,
                "ttft_ms": 1000 * statistics.median(output.metrics.first_token_latency for output in outputs),
                "loaded_tokens": sum(output.num_cached_tokens or 0 for output in outputs),
                "exporter_s_before": exporter_before}

    def stop(self) -> dict[str, float]:
        """The exporter's CPU since the last measurement began, once it caught up; then shut the engine down."""
        exporter_after = _caught_up_exporter_cpu_s() - self._exporter_mark
        self._llm.llm_engine.engine_core.shutdown()
        return {"exporter_s_before": exporter_after}


def _caught_up_exporter_cpu_s() -> float:
    from benchmarks.request_life import caught_up_exporter_cpu_s

    return caught_up_exporter_cpu_s()


class EngineProcess(end_to_end.EngineProcess):
    """A ``python -m benchmarks.batch_scaling --engine`` process: a batch at a time on command, answers on a pipe."""

    ENTRY = ("benchmarks.batch_scaling", "--engine")
    STOP_TIMEOUT_S = STOP_TIMEOUT_S

    def __init__(self, name: str, kv_transfer: dict[str, Any], workdir: Path, tree: Path = REPO) -> None:
        super().__init__(name, kv_transfer, workdir, tree)
        self.traced = name in TRACING
        self.ended = 0.0  # when its last measurement ended (perf_counter)

    def ask(self, command: str) -> dict[str, Any]:
        answer = super().ask(command)
        self.ended = time.perf_counter()
        return answer


def run_rounds(
    engines: list[EngineProcess], rounds: int,
) -> tuple[list[dict[int, dict[str, dict[str, Any]]]], dict[str, float]]:
    """Every engine ready, then ``rounds`` rounds of every batch size on every engine (rotating order), then
    stopped: (per round, per batch size, each engine's figures with its exporter's CPU filled in; the seconds
    the engines took to start and the rounds took)."""
    began = time.perf_counter()
    for engine in engines:
        engine.ask("ready")
    started_s, began = time.perf_counter() - began, time.perf_counter()
    measured: list[dict[int, dict[str, dict[str, Any]]]] = []
    previous: dict[str, dict[str, Any]] = {}
    for round_index in range(rounds):
        measured.append({})
        for batch_index, batch in enumerate(BATCHES):
            shift = (round_index + batch_index) % len(engines)
            measured[-1][batch] = {}
            for engine in engines[shift:] + engines[:shift]:
                if engine.traced and (wait := EXPORT_SETTLED_S - (time.perf_counter() - engine.ended)) > 0:
                    time.sleep(wait)
                figures = engine.ask(f"batch {batch}")
                _charge_exporter(previous.get(engine.name), figures.pop("exporter_s_before"))
                measured[-1][batch][engine.name] = previous[engine.name] = figures
    for engine in engines:
        _charge_exporter(previous.get(engine.name), engine.stop()["exporter_s_before"])
    return measured, {"start_s": started_s, "rounds_s": time.perf_counter() - began}


def _charge_exporter(figures: dict[str, Any] | None, exporter_s: float) -> None:
    """The exporter's CPU from a measurement's start to its engine's next one is that measurement's."""
    if figures is None:
        return
    figures["exporter_cpu_s"] = exporter_s
    figures["exporter_us_per_token"] = 1e6 * exporter_s / figures["tokens"]
    figures["engine_us_per_token"] = 1e6 * figures["engine_cpu_s"] / figures["tokens"]
    figures["cpu_us_per_token"] = figures["engine_us_per_token"] + figures["exporter_us_per_token"]


def measure(
    rounds: int = ROUNDS, configurations: tuple[str, ...] = CONFIGURATIONS, tree: Path = REPO,
) -> dict[str, Any]:
    sink = OtlpSink()
    engines: list[EngineProcess] = []
    with tempfile.TemporaryDirectory(prefix="kvcompose-batch-") as workdir:
        try:
            for name in configurations:
                engines.append(EngineProcess(name, kv_transfer_config(name, sink.endpoint), Path(workdir), tree))
            measured, seconds = run_rounds(engines, rounds)
        finally:
            for engine in engines:
                engine.kill()
            sink.stop()
    return {**summarize(measured), "seconds": seconds, "exported": {"requests": sink.exports, "bytes": sink.bytes}}


def summarize(rounds: list[dict[int, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """Per batch size: each configuration's medians over rounds, and its ratios to MultiConnector (the median of
    per-round ratios, with the middle half of rounds), and its extra CPU per request over MultiConnector."""
    batches: dict[int, Any] = {}
    for batch in rounds[0]:
        per_round = [measured[batch] for measured in rounds]
        names = [name for name in CONFIGURATIONS if name in per_round[0]]
        medians = {name: {key: statistics.median(figures[name][key] for figures in per_round)
                          for key, value in per_round[0][name].items() if isinstance(value, int | float)}
                   for name in names}
        ratios = {}
        for name in names:
            if name == BASELINE or BASELINE not in names:
                continue
            ratio: dict[str, Any] = {}
            for key in FIGURES:
                values = [figures[name][key] / figures[BASELINE][key] for figures in per_round]
                ratio[key] = statistics.median(values)
                ratio[f"{key}_middle_half"] = end_to_end.middle_half(values)
            ratio["extra_cpu_us_per_request"] = statistics.median(
                (figures[name]["cpu_us_per_token"] - figures[BASELINE]["cpu_us_per_token"])
                * figures[name]["tokens"] / batch for figures in per_round)
            ratios[name] = ratio
        batches[batch] = {"medians": medians, "ratios": ratios}
    return {"rounds": len(rounds), "output_tokens": OUTPUT_TOKENS, "batches": batches}


def table(result: dict[str, Any]) -> str:
    lines = [f"Process CPU (engine process + span exporter) per output token, {result['output_tokens']} output "
             "tokens a prompt; ratios to MultiConnector are medians of per-round ratios (middle half of rounds in "
             "brackets); multi_twin is an identical MultiConnector engine: its ratio is this run's floor.", "",
             "| batch | configuration | CPU us/token | exporter part | CPU vs multi | extra CPU us/request "
             "| tokens/s | vs multi | TTFT ms | vs multi | tokens loaded/batch |", "|" + " --- |" * 11]
    for batch, measured in result["batches"].items():
        for name, figures in measured["medians"].items():
            ratio = measured["ratios"].get(name)
            if ratio is None:
                vs_cpu, extra, vs_tokens, vs_ttft = "1", "", "1", "1"
            else:
                low, high = ratio["cpu_us_per_token_middle_half"]
                vs_cpu = f"{ratio['cpu_us_per_token']:.3f} ({low:.3f}..{high:.3f})"
                extra = f"{ratio['extra_cpu_us_per_request']:+.0f}"
                vs_tokens, vs_ttft = f"{ratio['tokens_per_s']:.3f}", f"{ratio['ttft_ms']:.3f}"
            lines.append(f"| {batch} | {name} | {figures['cpu_us_per_token']:.1f} | "
                         f"{figures['exporter_us_per_token']:.1f} | {vs_cpu} | {extra} | "
                         f"{figures['tokens_per_s']:.0f} | {vs_tokens} | {figures['ttft_ms']:.1f} | {vs_ttft} | "
                         f"{figures['loaded_tokens']:.0f} |")
    exported = result["exported"]
    lines += ["", f"Spans exported to the collector stand-in: {exported['requests']} requests, "
              f"{exported['bytes'] / 1024:.0f} KiB. The engines started in {result['seconds']['start_s']:.0f} s; "
              f"{result['rounds']} rounds took {result['seconds']['rounds_s']:.0f} s."]
    return "\n".join(lines)


def profile(path: Path, batches: int = PROFILED_BATCHES) -> str:
    """cProfile kvcompose as shipped, then MultiConnector, over ``batches`` batches of the largest size (each
    engine in this process in turn); write the functions in ``kvcompose/`` with the most own time, and the
    connector's calls side by side, to ``path`` and return that summary."""
    import cProfile
    import pstats

    os.environ.update(ENGINE_ENV)
    import kvcompose

    batch, requests = max(BATCHES), max(BATCHES) * batches
    profiled: dict[str, tuple[dict[Any, Any], float]] = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in ("kvc_shipped", BASELINE):
        engine = BatchEngine(kv_transfer_config(name, "http://127.0.0.1:1/v1/traces"))
        try:
            engine.measure(batch)  # the first of this size after the warm-up's small one
            # The thread's CPU time, not the wall clock: on a shared machine a function preempted meanwhile would
            # be charged the other processes' time.
            profiler = cProfile.Profile(time.thread_time)
            measured = [engine.measure(batch, profiler) for _ in range(batches)]
        finally:
            engine.stop()
        engine_us = statistics.median(1e6 * figures["engine_cpu_s"] / figures["tokens"] for figures in measured)
        profiler.dump_stats(path.with_name(f"{path.stem}.{name}.pstats"))
        profiled[name] = pstats.Stats(profiler).stats, engine_us  # type: ignore[attr-defined]
    stats, engine_us = profiled["kvc_shipped"]
    package = str(Path(kvcompose.__file__).resolve().parent) + os.sep
    rows = [(file, line, function, calls, total, cumulative)
            for (file, line, function), (_, calls, total, cumulative, _) in stats.items()
            if str(Path(file).resolve()).startswith(package)]
    rows.sort(key=lambda row: row[4], reverse=True)
    children_code = (package + "offload" + os.sep, package + "testing" + os.sep)  # the children's, in both engines
    own = sum(row[4] for row in rows)
    framework = sum(row[4] for row in rows if not str(Path(row[0]).resolve()).startswith(children_code))
    lines = [f"kvcompose as shipped (metrics on, tracing off), {batches} batches of {batch} prompts x "
             f"{OUTPUT_TOKENS} output tokens, children OffloadingConnector (kvcompose's CPU spec) and a no-op, "
             f"engine core in-process; cProfile of the engine thread's CPU time over generate() "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).",
             f"Engine-process CPU under the profiler: {engine_us:.1f} us per output token, MultiConnector's "
             f"{profiled[BASELINE][1]:.1f} (the profiler's own overhead included: it grows with the calls made).",
             f"Own time in kvcompose/: {own:.3f} s = {1e6 * own / requests:.1f} us per request; of it outside "
             f"kvcompose/offload and kvcompose/testing (the children's code, run under MultiConnector too): "
             f"{1e6 * framework / requests:.1f} us per request.", "",
             f"Top {PROFILE_TOP} functions in kvcompose/ by own time (tottime); per request: over {requests} "
             "requests.", "",
             f"{'tottime s':>10} {'us/request':>10} {'cumtime s':>10} {'cum us/req':>10} {'calls':>9}  function"]
    for file, line, function, calls, total, cumulative in rows[:PROFILE_TOP]:
        where = str(Path(file).resolve())[len(package) - len("kvcompose/"):]
        lines.append(f"{total:10.4f} {1e6 * total / requests:10.2f} {cumulative:10.4f} "
                     f"{1e6 * cumulative / requests:10.2f} {calls:9d}  {where}:{line}({function})")
    lines += ["", "The connector's calls (cumulative us per request, children's work included) under each:", "",
              f"{'call':<34} {'kvcompose':>10} {'Multi':>10} {'extra':>9}"]
    calls = {name: _connector_calls(profiled[name][0], requests) for name in profiled}
    for call in sorted(set(calls["kvc_shipped"]) | set(calls[BASELINE]),
                       key=lambda call: calls["kvc_shipped"].get(call, 0.0) - calls[BASELINE].get(call, 0.0),
                       reverse=True):
        ours, theirs = calls["kvc_shipped"].get(call, 0.0), calls[BASELINE].get(call, 0.0)
        lines.append(f"{call:<34} {ours:10.2f} {theirs:10.2f} {ours - theirs:+9.2f}")
    lines += ["", f"Raw profiles (pstats): {path.stem}.kvc_shipped.pstats and {path.stem}.{BASELINE}.pstats beside "
              "this file."]
    summary = "\n".join(lines) + "\n"
    path.write_text(summary)
    return summary


def _connector_calls(stats: dict[Any, Any], requests: int) -> dict[str, float]:
    """Cumulative us per request in each connector operation of the composite's class (kvcompose's or
    MultiConnector's), and in its Prometheus ``observe``."""
    from kvcompose.operations import CONNECTOR_OPERATIONS

    composites = (f"kvcompose{os.sep}connectors{os.sep}composite.py", "multi_connector.py")
    calls: dict[str, float] = {}
    for (file, _, function), (_, _, _, cumulative, _) in stats.items():
        if file.endswith(composites) and function in CONNECTOR_OPERATIONS:
            calls[function] = calls.get(function, 0.0) + 1e6 * cumulative / requests
        elif function == "observe" and (file.endswith("multi_connector.py")
                                        or file.endswith(f"kvcompose{os.sep}metrics{os.sep}prometheus.py")):
            calls["observe (Prometheus)"] = calls.get("observe (Prometheus)", 0.0) + 1e6 * cumulative / requests
    return calls


def _serve_engine(kv_transfer: str, result_fd: int) -> None:
    with os.fdopen(result_fd, "w", buffering=1) as results:
        engine = BatchEngine(json.loads(kv_transfer))
        results.write(json.dumps({"ready": True}) + "\n")
        for command in sys.stdin:
            if command.strip() == "stop":
                results.write(json.dumps(engine.stop()) + "\n")
                return
            results.write(json.dumps(engine.measure(int(command.split()[1]))) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--profile", type=Path, help="profile kvcompose as shipped at batch 256 into this file")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # an engine process: its kv_transfer_config, JSON
    parser.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine is not None:
        _serve_engine(args.engine, args.result_fd)
    elif args.profile is not None:
        print(profile(args.profile))
    else:
        print(table(measure(rounds=args.rounds)))


if __name__ == "__main__":
    main()
