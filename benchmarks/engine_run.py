"""One engine with one connector configuration, measured a round at a time on command.

``benchmarks/end_to_end.py`` starts one of these processes per configuration,
all alive together, and asks them in turn for a round (a line ``round`` on
stdin; ``stop`` ends it), so every configuration is measured within seconds
of the others. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the connector's scheduler and worker
sides, its tracer provider and the memory measured are all here. Answers are
JSON lines on the file descriptor ``--result-fd``.

A round (tiny model, greedy, ``ignore_eos``):

- time to first token of ``TTFT_PROMPTS`` new prompts, one after another, as
  the engine reports it (arrival to first token); every connector saves them.
  A prompt asks for one token, so its whole life (lookup to
  ``request_finished`` and the stats taken after it) lies inside that time,
  and so does all the time its engine spends in the connector, timed apart;
- one batch of ``BATCH`` prompts generating ``OUTPUT_TOKENS`` each: half repeat
  earlier prompts (a connector loads them), half are new (saved). Output
  tokens per second of wall time and per second of this process's CPU time
  (all its threads: the span exporter's too);
- what the connector cost per output token of the batch: time inside its
  calls (and, of that, inside its children's own calls), time in the
  front-end's Prometheus update for it
  (``benchmarks/stopwatch.py``), the CPU time of kvcompose's span outbox thread
  (it ships the spans, in this process) and of the span exporter process since
  the previous round, per token generated since then. The time in the
  connector and its children, and the outbox thread's CPU, during the
  one-token prompts are reported per first token too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.stopwatch import CHILDREN, ENGINE, FRONT_END, exporter_cpu_s, outbox_thread_cpu_s

PROMPT_WORDS = 96
# The median of this many per round: single prompts' times to first token vary by 5-10% on these machines,
# and two a round (as before) left the ratios at the mercy of that.
TTFT_PROMPTS = 8
BATCH = 8
OUTPUT_TOKENS = 128
KV_BLOCKS = 512  # 8192 tokens of KV cache: plenty for a batch, small enough for six engines at once


def _memory_mib() -> dict[str, float]:
    """This process's resident set now (VmRSS) and at its peak (VmHWM), MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


class Prompts:
    """Prompts of ``words`` words an engine has not seen yet (``new``), and those it was sent (``seen``)."""

    def __init__(self, words: int) -> None:
        from kvcompose.testing.tiny_model import prompt_words

        self._source: Iterator[str] = (prompt_words(seed, words) for seed in range(1_000_000))
        self.seen: list[str] = []

    def new(self) -> str:
        prompt = next(self._source)
        self.seen.append(prompt)
        return prompt

    def batch(self, size: int) -> list[str]:
        """Half the latest prompts again (they are loaded), the rest new."""
        repeated = self.seen[-(size // 2):]
        return repeated + [self.new() for _ in range(size - len(repeated))]


def generate(llm: Any, prompts: list[str], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
             ) -> list[Any]:
    """Greedy, every prompt to ``max_tokens`` tokens; ``kv_transfer_params``: sent with every request, as the
    OpenAI server passes a request body's."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                extra_args=extra), use_tqdm=False)


class MeasuredEngine:
    def __init__(self, kv_transfer_config: dict[str, Any] | None) -> None:
        from kvcompose.testing.tiny_model import ensure_tiny_model
        from tests.engine_support import start_llm

        started = time.perf_counter()
        self._llm = start_llm(ensure_tiny_model(), kv_transfer_config, disable_log_stats=False,
                              num_gpu_blocks_override=KV_BLOCKS)
        self.start_s = time.perf_counter() - started
        self._prompts = Prompts(PROMPT_WORDS)
        generate(self._llm, [self._prompts.new() for _ in range(BATCH)], 16)  # warm-up
        self.baseline_rss_mib = _memory_mib()["VmRSS"]
        self._exporter_cpu_s = exporter_cpu_s()

    def round(self) -> dict[str, Any]:
        ENGINE.reset()
        CHILDREN.reset()
        outbox_before = outbox_thread_cpu_s()
        ttft_s = [generate(self._llm, [self._prompts.new()], 1)[0].metrics.first_token_latency
                  for _ in range(TTFT_PROMPTS)]
        connector_us_per_first_token = 1e6 * ENGINE.seconds / TTFT_PROMPTS
        children_us_per_first_token = 1e6 * CHILDREN.seconds / TTFT_PROMPTS
        outbox_after_first = outbox_thread_cpu_s()
        prompts = self._prompts.batch(BATCH)
        ENGINE.reset()
        CHILDREN.reset()
        FRONT_END.reset()
        began, began_cpu = time.perf_counter(), time.process_time()
        outputs = generate(self._llm, prompts, OUTPUT_TOKENS)
        elapsed, elapsed_cpu = time.perf_counter() - began, time.process_time() - began_cpu
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        exporter_now = exporter_cpu_s()
        exporter_s, self._exporter_cpu_s = exporter_now - self._exporter_cpu_s, exporter_now
        outbox_batch_s = outbox_thread_cpu_s() - outbox_after_first
        return {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / elapsed_cpu,
                "ttft_ms": 1000 * statistics.median(ttft_s),
                "connector_us_per_first_token": connector_us_per_first_token,
                "children_us_per_first_token": children_us_per_first_token,
                "outbox_us_per_first_token": 1e6 * (outbox_after_first - outbox_before) / TTFT_PROMPTS,
                "connector_us_per_token": 1e6 * ENGINE.seconds / tokens,
                "children_us_per_token": 1e6 * CHILDREN.seconds / tokens,
                "connector_us_per_token_by_call": {call: 1e6 * seconds / tokens
                                                   for call, seconds in ENGINE.by_call.items()},
                "front_end_us_per_token": 1e6 * FRONT_END.seconds / tokens,
                "outbox_us_per_token": 1e6 * outbox_batch_s / tokens,
                "exporter_us_per_token": 1e6 * exporter_s / (tokens + TTFT_PROMPTS)}

    def stop(self) -> dict[str, float]:
        """Memory over the measured rounds, then shut the engine down (its connector flushes spans)."""
        memory = _memory_mib()
        began = time.perf_counter()
        self._llm.llm_engine.engine_core.shutdown()
        return {"rss_growth_mib": memory["VmRSS"] - self.baseline_rss_mib, "peak_rss_mib": memory["VmHWM"],
                "start_s": self.start_s, "shutdown_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-transfer-config", required=True, help="JSON; null for no connector")
    parser.add_argument("--result-fd", required=True, type=int)
    args = parser.parse_args()
    with os.fdopen(args.result_fd, "w", buffering=1) as results:
        engine = MeasuredEngine(json.loads(args.kv_transfer_config))
        results.write(json.dumps({"ready": True}) + "\n")
        for command in sys.stdin:
            if command.strip() == "stop":
                results.write(json.dumps(engine.stop()) + "\n")
                return
            results.write(json.dumps(engine.round()) + "\n")


if __name__ == "__main__":
    main()
