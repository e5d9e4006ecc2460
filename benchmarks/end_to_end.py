"""End to end on the CPU engine: output tokens/s and time to first token per connector configuration.

Configurations, each with two ExampleConnector children on fresh directories
in memory (``/dev/shm`` where there is one: the benchmark measures the
connectors' framework, not the disk, which other work on the machine shares):

- ``none``: no connector (the engine alone);
- ``multi``: vLLM's MultiConnector;
- ``kvc_off``: KVComposeConnector, metrics on, tracing off;
- ``kvc_request``: tracing at request granularity (the default), exported
  over OTLP/HTTP to a collector stand-in on loopback that reads and discards
  each export (in this process);
- ``kvc_step``: the same at step granularity;
- ``kvc_unreachable``: step granularity, exporting to a closed loopback port.

Every run is a fresh process (``benchmarks/engine_run.py``) computing on one
OpenMP thread, one after another, so each gets the same machine state and no module globals (the tracer
provider) carry over. Repetitions alternate the order (forward, backward) and
each ratio is taken within a repetition, between runs close in time; the
reported ratio is the median over repetitions. One compute thread because with
two, on a 2-core machine shared with other work, any other process stalls the
engine's parallel regions: throughput swung tenfold between batches.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.otlp_sink import OtlpSink

REPO = Path(__file__).resolve().parent.parent
CONFIGURATIONS = ("none", "multi", "kvc_off", "kvc_request", "kvc_step", "kvc_unreachable")
GRANULARITY = {"kvc_request": "request", "kvc_step": "step", "kvc_unreachable": "step"}
# (name, subject, baseline): subject's figure over baseline's, per repetition
RATIOS = (
    ("kvc_off / multi", "kvc_off", "multi"),
    ("kvc_request / multi", "kvc_request", "multi"),
    ("kvc_step / multi", "kvc_step", "multi"),
    ("kvc_unreachable / kvc_off", "kvc_unreachable", "kvc_off"),
    ("multi / none", "multi", "none"),
)
RUN_TIMEOUT_S = 600
STORES_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else None
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the measured process
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}


def kv_transfer_config(name: str, stores: Path, endpoints: dict[str, str]) -> dict[str, Any] | None:
    """The engine's kv_transfer_config for a configuration; ``stores`` holds the children's directories."""
    from kvcompose.config import load_pipeline
    from kvcompose.render import kv_transfer_config as render
    from tests.engine_support import example_tiers

    tiers = {"hot": stores / "hot", "cold": stores / "cold"}
    if name == "none":
        return None
    if name == "multi":
        children = [{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(path)}} for path in tiers.values()]
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"connectors": children}}
    pipeline = {**example_tiers("bench", tiers), "logging": {"level": "WARNING"}}
    if name in endpoints:
        pipeline["tracing"] = {"enabled": True, "granularity": GRANULARITY[name], "exporter": "otlp",
                               "endpoint": endpoints[name]}
    return render(load_pipeline(pipeline), pipeline)


def run_engine(kv_transfer: dict[str, Any] | None, workdir: Path) -> dict[str, Any]:
    """One configuration in a fresh process; its figures (see engine_run.py)."""
    out = workdir / "result.json"
    env = {**os.environ, **ENGINE_ENV}
    command = [sys.executable, "-m", "benchmarks.engine_run", "--kv-transfer-config", json.dumps(kv_transfer),
               "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"engine run failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def measure(repetitions: int = 3, configurations: tuple[str, ...] = CONFIGURATIONS) -> dict[str, Any]:
    from tests.server_support import free_port

    sink = OtlpSink()
    endpoints = {"kvc_request": sink.endpoint, "kvc_step": sink.endpoint,
                 "kvc_unreachable": f"http://127.0.0.1:{free_port()}/v1/traces"}
    runs: list[dict[str, dict[str, Any]]] = []
    try:
        for repetition in range(repetitions):
            order = configurations if repetition % 2 == 0 else configurations[::-1]
            figures = {}
            for name in order:
                with tempfile.TemporaryDirectory(prefix="kvcompose-bench-", dir=STORES_DIR) as workdir:
                    figures[name] = run_engine(kv_transfer_config(name, Path(workdir), endpoints), Path(workdir))
            runs.append(figures)
    finally:
        sink.stop()
    return {**summarize(runs), "exported": {"requests": sink.exports, "bytes": sink.bytes}}


def summarize(runs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians per configuration, and the medians of the per-repetition ratios."""
    names = [name for name in CONFIGURATIONS if name in runs[0]]
    medians = {name: {key: statistics.median(run[name][key] for run in runs) for key in runs[0][name]}
               for name in names}
    ratios = {
        label: {key: statistics.median(run[subject][key] / run[baseline][key] for run in runs)
                for key in ("tokens_per_s", "tokens_per_cpu_s", "ttft_ms")}
        for label, subject, baseline in RATIOS if subject in names and baseline in names
    }
    return {"repetitions": len(runs), "medians": medians, "ratios": ratios, "runs": runs}


def table(result: dict[str, Any]) -> str:
    lines = ["| configuration | output tokens/s | tokens per CPU-s | TTFT ms | RSS growth MiB | peak RSS MiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, figures in result["medians"].items():
        lines.append(f"| {name} | {figures['tokens_per_s']:.0f} | {figures['tokens_per_cpu_s']:.0f} | "
                     f"{figures['ttft_ms']:.1f} | {figures['rss_growth_mib']:.1f} | {figures['peak_rss_mib']:.0f} |")
    exported = result["exported"]
    lines += ["", f"Spans exported to the collector stand-in: {exported['requests']} requests, "
              f"{exported['bytes'] / 1024:.0f} KiB.", ""]
    lines += ["| ratio (median of repetitions) | tokens/s | tokens per CPU-s | TTFT |", "| --- | --- | --- | --- |"]
    for label, ratio in result["ratios"].items():
        lines.append(f"| {label} | {ratio['tokens_per_s']:.3f} | {ratio['tokens_per_cpu_s']:.3f} | "
                     f"{ratio['ttft_ms']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure()))
