"""One thread or two for SmolLM2-135M on a 2-core CPU: the smollm2-grpo step, alone and beside a second run.

    python benchmarks/smollm2_threads.py [OUT]     (OUT: benchmarks/results/smollm2; about 15 minutes)

Four settings, each a few steps of `dppo train --preset smollm2-grpo` (evaluation cut to one problem): alone with
cpu_threads 1 and 2, then two runs side by side (what a shared machine, or benchmarks/smollm2_run.sh, gives each
run) with 1 and 2 threads each. Writes OUT/threads.json: the median step, rollout and update seconds of each
setting's steps after the first (the first warms up), and prints them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 4
SETTINGS = (("alone", 1, 1), ("alone", 2, 1), ("side by side", 1, 2), ("side by side", 2, 2))


def _runs(threads: int, copies: int, root: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "dppo_core", "train", "--preset", "smollm2-grpo", f"max_steps={STEPS}",
           "eval_problems_per_level=1", "eval_samples=1", "save_steps=0", f"cpu_threads={threads}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([*cmd, f"output_dir={root / f't{threads}-c{copies}-{k}'}"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for k in range(copies)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(err[-2000:])
    lines = []
    for k in range(copies):
        metrics = root / f"t{threads}-c{copies}-{k}" / "metrics.jsonl"
        lines += [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_time" in r and r["step"] > 1]
    return lines


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "benchmarks/results/smollm2")
    results = []
    with tempfile.TemporaryDirectory(prefix="smollm2-threads-") as tmp:
        for where, threads, copies in SETTINGS:
            t0 = time.perf_counter()
            steps = _runs(threads, copies, Path(tmp))
            row = {"setting": where, "cpu_threads": threads, "runs": copies, "steps_timed": len(steps),
                   "wall_s": time.perf_counter() - t0}
            for key in ("step_time", "time_rollout", "time_update"):
                row[f"median_{key}"] = statistics.median(r[key] for r in steps)
            results.append(row)
            print(f"{where:>12}, {threads} thread(s): step {row['median_step_time']:.1f} s (rollout "
                  f"{row['median_time_rollout']:.1f}, update {row['median_time_update']:.1f})", flush=True)
    (out / "threads.json").write_text(json.dumps({"command": "python benchmarks/smollm2_threads.py",
                                                  "cpu_count": os.cpu_count(), "settings": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
