"""Runs the engines of tests/test_chaos.py, one after another, in this process.

``python -m tests.chaos_driver PLAN.json``. The plan (written by the test) lists
engines, each a pipeline with FaultInjectionConnector children that read
their faults from files (``faults_files``: child name -> path), and the cases
to run on it: the faults to write into each file, then prompts generated
``rounds`` times.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
driver can read the connectors' per-request state. Each event is one stdout
line, :data:`EVENT_PREFIX` and JSON, printed as it happens: the test reads
them as they come and kills this process when the next one is late, so a
hang is named by the engine and case it happened in.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections import Counter
from pathlib import Path
from time import perf_counter
from typing import Any

import yaml

from kvcompose.config import load_pipeline
from kvcompose.render import kv_transfer_config

from .engine_support import greedy, in_process_connectors, start_llm

EVENT_PREFIX = "chaos-event "


def emit(event: str, **fields: Any) -> None:
    print(EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


def write_faults(path: Path, faults: dict[str, Any]) -> None:
    """Replace the faults file whole, so the engine never reads half of it."""
    staging = path.with_suffix(".new")
    staging.write_text(yaml.safe_dump(faults))
    staging.replace(path)


def generate(llm: Any, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
             "cached": o.num_cached_tokens or 0} for o in outputs]


def run_engine(model: Path, engine: dict[str, Any], rounds: int, max_tokens: int) -> None:
    name, faults_files = engine["name"], {child: Path(path) for child, path in engine["faults_files"].items()}
    for path in faults_files.values():
        write_faults(path, {})
    emit("starting", engine=name)
    started = perf_counter()
    pipeline = engine["pipeline"]
    # With stats on, the scheduler also asks the loading child for its cache hit sources.
    llm = start_llm(model, kv_transfer_config(load_pipeline(pipeline), pipeline), disable_log_stats=False)
    emit("started", engine=name, seconds=round(perf_counter() - started, 2))
    sides = dict(zip(("scheduler", "worker"), in_process_connectors(llm), strict=True))
    # child name -> its FaultInjectionConnector in the scheduler and in the worker
    injectors = {child.name: [composite.children[child.index].connector for composite in sides.values()]
                 for child in sides["scheduler"].children if child.name in faults_files}

    def injected() -> dict[str, Counter[str]]:
        return {child: sum((side.plan.injected for side in pair), Counter()) for child, pair in injectors.items()}

    try:
        for case in engine["cases"]:
            for child, path in faults_files.items():
                write_faults(path, case["faults"].get(child, {}))
            before, started = injected(), perf_counter()
            try:
                outputs = [generate(llm, case["prompts"], max_tokens) for _ in range(rounds)]
            except Exception as error:  # the engine is in an unknown state: skip the rest of its cases
                emit("case", engine=name, case=case["name"], error=f"{type(error).__name__}: {error}"[:2000])
                return
            after = injected()
            emit("case", engine=name, case=case["name"], rounds=outputs, seconds=round(perf_counter() - started, 2),
                 injected={child: dict(after[child] - before[child]) for child in injectors})
        for path in faults_files.values():
            write_faults(path, {})
        emit("state", engine=name, sizes={
            **{f"composite in the {side}": composite.request_state_sizes() for side, composite in sides.items()},
            **{f"{child} in the {side}": injector.request_state_sizes()
               for child, pair in injectors.items() for side, injector in zip(sides, pair, strict=True)},
        })
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm, sides, injectors
        gc.collect()


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    for engine in plan["engines"]:
        run_engine(Path(plan["model"]), engine, plan["rounds"], plan["max_tokens"])
    emit("done")


if __name__ == "__main__":
    # Set here, not on import: tests/test_chaos.py imports this module for EVENT_PREFIX, and every engine the
    # test session started after it would run in-process too.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(sys.argv[1])
