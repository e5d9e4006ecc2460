"""kvcompose demo: a real vLLM engine on the CPU with examples/pipeline.yaml.

Replays a small workload of repeated prompts through two ExampleConnector
tiers ("hot" then "cold"), wipes the hot tier half-way to show the cold one
serving, and prints what each child did. Everything it writes lives under
one temp directory, which it removes at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "examples" / "pipeline.yaml"
PROMPTS = 6
MAX_TOKENS = 16


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kvcompose-demo-"))
    os.environ.update(
        KVCOMPOSE_HOT=str(workdir / "hot"), KVCOMPOSE_COLD=str(workdir / "cold"),
        VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
    )
    try:
        run(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"\nremoved {workdir} (the stores, nothing else was written)")


def run(workdir: Path) -> None:
    rendered = subprocess.run([sys.executable, "-m", "kvcompose", "render", str(PIPELINE)],
                              check=True, capture_output=True, text=True).stdout
    print(f"pipeline {PIPELINE.relative_to(REPO)} -> --kv-transfer-config {rendered.strip()}")
    print(f"stores: hot={workdir / 'hot'} cold={workdir / 'cold'}")

    from kvcompose.testing.tiny_model import ensure_tiny_model, prompt_words

    model = ensure_tiny_model()
    print(f"starting vLLM (CPU, tiny random-weight model at {model}) ...", flush=True)
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=str(model), enforce_eager=True, dtype="float32", max_model_len=512, enable_prefix_caching=False,
              disable_log_stats=False, kv_transfer_config=KVTransferConfig(**json.loads(rendered)))
    print(f"engine ready in {time.monotonic() - started:.0f}s\n")

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [prompt_words(seed=100 + i, length=64 + 16 * i) for i in range(PROMPTS)]
    rounds = [("first sight: both tiers save", prompts), ("repeat: the hot tier loads", prompts)]
    for label, batch in rounds:
        replay(llm, label, batch, params)
    shutil.rmtree(workdir / "hot", ignore_errors=True)
    replay(llm, "hot tier wiped: the cold tier loads", prompts, params)
    time.sleep(1)  # the last step's stats reach the front-end with the next stats update
    print_table()
    print("\nmetrics: kvcompose_* series in vLLM's Prometheus registry (`vllm serve` exposes them on /metrics)")
    print("traces: off in examples/pipeline.yaml (tracing.enabled)")


def replay(llm: object, label: str, prompts: list[str], params: object) -> None:
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    total = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"  {label:<40} {len(prompts)} requests, {cached}/{total} prompt tokens from a tier, "
          f"{time.monotonic() - started:.2f}s", flush=True)


def print_table() -> None:
    from prometheus_client import generate_latest

    from kvcompose.metrics.summary import summarize

    children = summarize(generate_latest().decode())
    print(f"\n{'child':<6} {'lookups':>7} {'hits':>5} {'matched':>8} {'loaded':>7}")
    for name, row in children.items():
        print(f"{name:<6} {sum(row.lookups.values()):>7.0f} {row.lookups['hit']:>5.0f} "
              f"{row.matched_tokens:>8.0f} {row.loaded_tokens:>7.0f}")
    print(f"\n{'child':<6} {'operation':<30} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for name, row in children.items():
        for op in sorted(row.latency_buckets):
            p50, p99 = row.latency(op, 0.5) or 0.0, row.latency(op, 0.99) or 0.0
            print(f"{name:<6} {op:<30} {row.calls(op):>6} {1000 * p50:>8.3f} {1000 * p99:>8.3f}")


if __name__ == "__main__":
    main()
