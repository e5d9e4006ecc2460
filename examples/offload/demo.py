"""Offloading demo: examples/offload/pipeline.yaml on a real CPU engine, with the worker's measured copies.

Sends one ~300-word prompt three times through the tiny model: the first
run stores its KV blocks to the offload child (and the disk child), the
repeats load them back from the offload child's file-backed host buffer.
Prints each copy job the worker ran (bytes, seconds, throughput) and the
offload child's ``vllm:kv_offload_*`` counters. The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the worker's copy log is
readable here. Everything it writes lives under one temp dir, removed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIPELINE = REPO / "examples" / "offload" / "pipeline.yaml"
ROUNDS = 3


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kvcompose-offload-demo-"))
    os.environ.update(
        KVCOMPOSE_OFFLOAD_BYTES=str(64 << 20), KVCOMPOSE_OFFLOAD_DIR=str(workdir / "host"),
        KVCOMPOSE_DISK=str(workdir / "disk"), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
    )
    try:
        run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvcompose.config import load_pipeline
    from kvcompose.offload.copy_log import recent_copies
    from kvcompose.render import file_reference, kv_transfer_config
    from kvcompose.testing.tiny_model import ensure_tiny_model, prompt_words

    config = kv_transfer_config(load_pipeline(PIPELINE), file_reference(PIPELINE))
    started = time.monotonic()
    llm = LLM(model=str(ensure_tiny_model()), enforce_eager=True, dtype="float32", max_model_len=512,
              enable_prefix_caching=False, disable_log_stats=False, kv_transfer_config=KVTransferConfig(**config))
    print(f"engine ready in {time.monotonic() - started:.0f}s")
    prompt = prompt_words(seed=15, length=300)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for round_number in range(ROUNDS):
        started = time.monotonic()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        print(f"round {round_number + 1}: {output.num_cached_tokens or 0}/{len(output.prompt_token_ids)} prompt tokens "
              f"from a tier, {time.monotonic() - started:.2f}s")
    time.sleep(1)  # the last step's stats reach the front-end with the next update

    print("\ncopy jobs of the offload worker (kvcompose.offload.copy_log.recent_copies()):")
    for record in recent_copies():
        print(f"  job {record.job_id:>3} {record.direction:<5} {record.nbytes:>9} B in {record.seconds * 1e3:7.3f} ms "
              f"= {record.bytes_per_second / 1e9:6.2f} GB/s on {record.thread}")
    print("\nvLLM's counters for the offload child:")
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kv_offload_") and metric.labels.get("connector") == "offload":
            if hasattr(metric, "value") and metric.value:
                extra = {k: v for k, v in metric.labels.items() if k not in ("model_name", "engine")}
                print(f"  {metric.name}{extra} = {metric.value}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
