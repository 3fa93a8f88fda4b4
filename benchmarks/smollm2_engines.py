"""Which rollout engine is cheaper for SmolLM2-135M on a CPU: vLLM's CPU engine or the transformers one.

    python benchmarks/smollm2_engines.py [OUT] [--steps N] [--rounds R]
        (OUT: benchmarks/results/smollm2; defaults 3 steps, 1 round: about 15 minutes on 2 cores)

Each setting is a few steps of ``dppo train --preset smollm2-grpo`` alone on the machine (evaluation cut to one
problem, no checkpoints), as training runs the engine: ``rollout_engine=hf`` (the policy itself, PEFT's LoRA
layers in its forward) or ``rollout_engine=vllm`` (vLLM in-process, the LoRA adapter handed over after every
update: the ``sync`` phase), with ``cpu_threads`` 1 and 2. The settings run in ``--rounds`` rounds, each round
every setting once in turn, so that a change in the machine's load meets every setting alike. Per setting, over
the steps after the first of every round (the first warms up): the median seconds of a step's rollout, of its
sync, and the generated tokens per second of rollout + sync (a step's tokens over the two phases' seconds),
which is what choosing the engine changes. Writes ``OUT/engines.json`` and prints a table; nothing else may run
beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = (("hf", 1), ("vllm", 1), ("hf", 2), ("vllm", 2))


def _run(engine: str, threads: int, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "dppo_core", "train", "--preset", "smollm2-grpo", f"max_steps={steps}",
           "eval_problems_per_level=1", "eval_samples=1", "eval_steps=0", "save_steps=0",
           f"rollout_engine={engine}", f"cpu_threads={threads}", f"output_dir={out}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{engine}, {threads} thread(s) failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "step_time" in r and r["step"] > 1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("benchmarks/results/smollm2"))
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    out = args.out
    steps: dict[tuple[str, int], list[dict]] = {s: [] for s in SETTINGS}
    walls: dict[tuple[str, int], list[float]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="smollm2-engines-") as tmp:
        for r in range(args.rounds):
            for engine, threads in SETTINGS:
                t0 = time.perf_counter()
                steps[engine, threads] += _run(engine, threads, args.steps, Path(tmp) / f"{engine}-t{threads}-r{r}")
                walls[engine, threads].append(time.perf_counter() - t0)
                print(f"round {r + 1}: {engine}, {threads} thread(s) done in {walls[engine, threads][-1]:.0f} s",
                      flush=True)
    results = []
    for (engine, threads), rows in steps.items():
        tokens_per_s = [r["tokens_generated"] / (r["time_rollout"] + r.get("time_sync", 0.0)) for r in rows]
        row = {"engine": engine, "cpu_threads": threads, "steps_timed": len(rows),
               "run_wall_s": [round(w, 1) for w in walls[engine, threads]],
               "median_time_rollout": statistics.median(r["time_rollout"] for r in rows),
               "median_time_sync": statistics.median(r.get("time_sync", 0.0) for r in rows),
               "median_step_time": statistics.median(r["step_time"] for r in rows),
               "median_tokens_per_step": statistics.median(r["tokens_generated"] for r in rows),
               "median_tokens_per_s": statistics.median(tokens_per_s)}
        results.append(row)
    print("| engine | threads | rollout s | sync s | tokens / s (rollout + sync) | whole step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in results:
        print(f"| {row['engine']} | {row['cpu_threads']} | {row['median_time_rollout']:.1f} | "
              f"{row['median_time_sync']:.2f} | {row['median_tokens_per_s']:.0f} | {row['median_step_time']:.1f} |")
    load = os.getloadavg()
    report = {"command": "python benchmarks/smollm2_engines.py " + " ".join(argv), "cpu_count": os.cpu_count(),
              "steps_per_run": args.steps, "rounds": args.rounds, "load_average_after": [round(x, 2) for x in load],
              "settings": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
