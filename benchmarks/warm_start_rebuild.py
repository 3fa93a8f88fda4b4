"""The shipped warm start rebuilt from scratch on this machine, against the shipped one: loss curve and accuracy.

Made with (from the repository root; about 5 minutes a run on 2 cores, each in a fresh cache directory):

    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/warm_start_rebuild.py \\
        --output benchmarks/results/warm_start_rebuild/pinned.json
    .venv/bin/python benchmarks/warm_start_rebuild.py --output benchmarks/results/warm_start_rebuild/unpinned.json

The 600 AdamW steps of :func:`dppo_core.warm_start.warm_start` are chaotic in the last bits: on a CPU whose kernels
differ from those of the machine that built the shipped weights (its fingerprint is in the shipped
``warm_start_log.json``), the rebuild is another model. This records by how much: the ratio of the two runs'
50-step mean losses, the last 100 steps', and greedy accuracy per level (200 test problems a level, 21 on level 1
which has no more) of both models, evaluated here. ``tests/system/test_models.py`` holds a rebuild to bounds set from
these files.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dppo_core.evaluate import evaluate_task
from dppo_core.models import load_model
from dppo_core.numerics import kernel_fingerprint
from dppo_core.rollout import HFRollout
from dppo_core.warm_start import SHIPPED_WARM_START, warm_start


def greedy_levels(path: Path, n_per_level: int) -> dict[str, dict[str, float]]:
    model, tokenizer = load_model(path)
    levels = evaluate_task(HFRollout(model, tokenizer), n_per_level=n_per_level).levels
    return {str(k): {"accuracy": r.accuracy, "stderr": r.stderr, "problems": r.n_problems} for k, r in levels.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="the JSON to write")
    parser.add_argument("--n-per-level", type=int, default=200)
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = warm_start(cache_dir=tmp, force=True, progress=False)
        ours = json.loads((path / "warm_start_log.json").read_text())["loss"]
        rebuilt = greedy_levels(path, args.n_per_level)
    shipped_log = json.loads((SHIPPED_WARM_START / "warm_start_log.json").read_text())
    shipped = shipped_log["loss"]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    result = {
        "command": "benchmarks/warm_start_rebuild.py (see its docstring)",
        "here": kernel_fingerprint(), "shipped_built_with": shipped_log.get("kernels"),
        "loss_ratio_per_50_steps": [round(mean(ours[i:i + 50]) / mean(shipped[i:i + 50]), 4)
                                    for i in range(0, len(ours), 50)],
        "loss_ratio_last_100": round(mean(ours[-100:]) / mean(shipped[-100:]), 4),
        "greedy_rebuilt": rebuilt, "greedy_shipped": greedy_levels(SHIPPED_WARM_START, args.n_per_level),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    for name in ("greedy_rebuilt", "greedy_shipped"):
        result[name + "_mean"] = round(mean([v["accuracy"] for v in result[name].values()]), 4)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if "mean" in k or "ratio" in k}))


if __name__ == "__main__":
    main()
