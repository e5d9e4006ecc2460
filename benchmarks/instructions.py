"""Instructions per request life, counted by valgrind's callgrind: the request benchmarks without the noise.

``python -m benchmarks.instructions`` (optional: needs valgrind, Debian's
``valgrind`` package; not part of ``make bench``). CPU time on these shared
2-core machines moves by 10-30% between runs of the same code, too much to
see a change of a few percent; the number of instructions a request life
executes does not move. It is not time (an instruction that misses the cache
costs more), so use it to compare versions of kvcompose, and the CPU-time
benchmarks for the targets.

Two measures. Request lives: the subjects of ``benchmarks/request_life.py``
(the traced one ships its spans through a pipe to an exporter process,
which runs outside valgrind and is not counted). Worker steps: the steps of
``benchmarks/transfer_cost.py`` (8 requests a step, each loaded by the first of
2 no-op children and saved by both, every request traced) through a
worker-side composite with metrics on and tracing off, at request
granularity, and at step granularity (spans recorded and discarded). One
process under callgrind builds them all, warms each up, then runs each
subject's work with counting switched on (``callgrind_control``) and dumps the
count after each, so the start-up (vLLM's import, about 100 s under valgrind)
is paid once and never counted. Counts include kvcompose's span outbox thread
when it wakes (every 0.1 s of valgrind's slow wall time): compare versions that
ship alike.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.connectors import kvcompose_connector, pipeline
from benchmarks.request_life import SUBJECTS, Collector, live, subjects, warm_up
from benchmarks.transfer_cost import run_steps, step_metadata

CHILD_COUNTS = (2, 8)
REQUESTS = 300
STEPS = 100
STEP_SUBJECTS = {"kvc_off": None, "kvc_request": "request", "kvc_step": "step"}  # name -> tracing granularity
TOTALS = "totals:"


def _counted_run(label: str, units: int, run: Callable[[], Any]) -> None:
    """Under callgrind: ``ready <units> <label>`` before ``run``, ``done`` after it; each waits for a line on
    stdin (the counting is switched meanwhile)."""
    print(f"ready {units} {label}", flush=True)
    sys.stdin.readline()
    run()
    print("done", flush=True)
    sys.stdin.readline()


def _counted(children_counts: tuple[int, ...], requests: int, steps: int) -> None:
    """The process under callgrind: every subject's request lives, then every worker's steps."""
    with Collector() as sink:
        for children in children_counts:
            served = subjects(children, sink.endpoint)
            warm_up(served, f"warm-{children}")
            for name in SUBJECTS:
                _counted_run(f"{children} {name}", requests,
                             partial(_lives, served[name], f"{name}-{children}", requests))
            served["kvc_traced"].shutdown()
    for name, tracing in STEP_SUBJECTS.items():
        worker = kvcompose_connector(pipeline(2, tracing=tracing), "worker")
        run_steps(worker, [step_metadata(2, step) for step in range(10)])  # warm-up
        metadata = [step_metadata(2, step) for step in range(steps)]
        _counted_run(f"step {name}", steps, partial(run_steps, worker, metadata))


def _lives(connector: Any, prefix: str, requests: int) -> None:
    for index in range(requests):
        live(connector, f"{prefix}-{index}")


def _control(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], check=True, capture_output=True)


def measure(children_counts: tuple[int, ...] = CHILD_COUNTS, requests: int = REQUESTS,
            steps: int = STEPS) -> dict[str, int]:
    """Instructions per request life, by ``"<children> <subject>"``, and per worker step, by ``"step <subject>"``."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                   sys.executable, "-m", "benchmarks.instructions", "--counted",
                   "--children", ",".join(map(str, children_counts)), "--requests", str(requests),
                   "--steps", str(steps)]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert process.stdin is not None and process.stdout is not None
        labels = []  # (label, units counted)
        for line in process.stdout:
            if line.startswith("ready "):
                units, label = line.split(" ", 2)[1:]
                labels.append((label.strip(), int(units)))
                _control(process.pid, "--instr=on")
            elif line.strip() == "done":
                _control(process.pid, "--instr=off")
                _control(process.pid, "--dump")
            else:
                continue
            process.stdin.write("\n")
            process.stdin.flush()
        process.wait()
        dumps = sorted(Path(directory).glob("callgrind.out.*"), key=lambda path: int(path.suffix[1:]))
        totals = [next(int(line.split()[1]) for line in path.read_text().splitlines() if line.startswith(TOTALS))
                  for path in dumps]
    return {label: round(total / units) for (label, units), total in zip(labels, totals, strict=True)}


def table(counts: dict[str, int]) -> str:
    lines = ["| children | subject | instructions per request life | over MultiConnector |", "| --- | --- | --- | --- |"]
    steps = ["| worker subject (2 children) | instructions per step | over tracing off |", "| --- | --- | --- |"]
    for label, count in counts.items():
        group, name = label.split()
        if group == "step":
            baseline = counts["step kvc_off"]
            steps.append(f"| {name} | {count:,} | +{count - baseline:,} |")
        else:
            baseline = counts[f"{group} multi"]
            lines.append(f"| {group} | {name} | {count:,} | {count / baseline:.2f}x (+{count - baseline:,}) |")
    return "\n".join(lines) + "\n\n" + "\n".join(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", default=",".join(map(str, CHILD_COUNTS)))
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    children_counts = tuple(int(count) for count in args.children.split(","))
    if args.counted:
        _counted(children_counts, args.requests, args.steps)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.exit(2, "benchmarks.instructions needs valgrind (Debian: apt-get install valgrind)\n")
    print(table(measure(children_counts, args.requests, args.steps)))


if __name__ == "__main__":
    main()
