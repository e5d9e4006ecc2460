"""One engine, one connector configuration: start it, run the workload, write the figures as JSON.

Run by ``benchmarks/end_to_end.py`` in a fresh process per configuration and
repetition, with the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the connector's scheduler and
worker sides, the tracer provider and the memory measured are all here.

Workload (tiny model, greedy, ``ignore_eos``), after a warm-up batch:

- time to first token: ``TTFT_REQUESTS`` prompts one after another, as the
  engine reports it (arrival to first token); new prompts, so every connector
  saves them;
- throughput: ``BATCHES`` batches of ``BATCH`` prompts generating
  ``OUTPUT_TOKENS`` each; half the prompts repeat the TTFT prompts (a connector
  loads them), half are new (saved). Output tokens per second of wall time,
  of the fastest batch (the one least disturbed by other processes), and per
  second of this process's CPU time (all its threads: the span exporter's
  too), which other processes on the machine disturb much less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

PROMPT_WORDS = 96
TTFT_REQUESTS = 8
BATCH = 8
BATCHES = 5
OUTPUT_TOKENS = 128


def _memory_kib() -> dict[str, int]:
    """This process's resident set now (VmRSS) and at its peak (VmHWM), KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}


def run(kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    from vllm import SamplingParams

    from kvcompose.testing.tiny_model import ensure_tiny_model, prompt_words
    from tests.engine_support import start_llm

    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    started = time.perf_counter()
    llm = start_llm(ensure_tiny_model(), kv_transfer_config, disable_log_stats=False)
    start_s = time.perf_counter() - started
    prompts = iter(prompt_words(seed, PROMPT_WORDS) for seed in range(10_000))
    llm.generate([next(prompts) for _ in range(BATCH)], sampling(16), use_tqdm=False)  # warm-up

    before = _memory_kib()
    ttft_prompts = [next(prompts) for _ in range(TTFT_REQUESTS)]
    ttft_s = [llm.generate([prompt], sampling(1), use_tqdm=False)[0].metrics.first_token_latency
              for prompt in ttft_prompts]
    tokens_per_s, tokens_per_cpu_s = [], []
    half = BATCH // 2
    for batch in range(BATCHES):
        repeated = [ttft_prompts[(batch * half + i) % TTFT_REQUESTS] for i in range(half)]
        batch_prompts = repeated + [next(prompts) for _ in range(BATCH - half)]
        began, began_cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(batch_prompts, sampling(OUTPUT_TOKENS), use_tqdm=False)
        elapsed, elapsed_cpu = time.perf_counter() - began, time.process_time() - began_cpu
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        tokens_per_s.append(tokens / elapsed)
        tokens_per_cpu_s.append(tokens / elapsed_cpu)
    after = _memory_kib()
    llm.llm_engine.engine_core.shutdown()
    return {
        "start_s": start_s,
        "ttft_ms": 1000 * statistics.median(ttft_s),
        "tokens_per_s": max(tokens_per_s),
        "tokens_per_cpu_s": max(tokens_per_cpu_s),
        "rss_growth_mib": (after["VmRSS"] - before["VmRSS"]) / 1024,
        "peak_rss_mib": after["VmHWM"] / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-transfer-config", required=True, help="JSON; null for no connector")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    args.out.write_text(json.dumps(run(json.loads(args.kv_transfer_config))))


if __name__ == "__main__":
    main()
