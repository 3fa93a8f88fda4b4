"""How much a larger batch of informative groups speeds learning per step: the gradient noise scale that
``dppo advise`` turns a replayed prompt stage into a predicted speedup with (issue #63, item 5).

Made with (from the repository root; a second on one core, it reads committed logs only):

    .venv/bin/python benchmarks/noise_scale.py benchmarks/results/realistic-pool/matched \\
        --output benchmarks/results/realistic-pool/noise_scale.json

The bench ran ``grpo_skip`` at 32 prompts a step and ``grpo_skip_matched`` at 16, the same seeds, everything else
equal. Steps to a target S(B) in the batch B follow S(B) = S_min (1 + B_noise / B) under the empirical model of
large-batch training (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"): halving the batch
multiplies the steps by r = (1 + x) / (1 + x / 2), x = B_noise / B_small, so x = (r - 1) / (1 - r / 2). B is counted in
informative groups (the ones with a gradient: rewards not all equal, from each run's ``groups.jsonl``), so that the
scale carries over to a pool with another all-equal share. Per seed: the steps each run took to 90% and to 95% of
grpo_skip's final sampled accuracy (mean over seeds; each run's evaluations interpolated linearly in the step), r the
ratio; reported per target with the geometric mean over seeds and a bootstrap interval (10,000 resamples of the seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from dppo_core.grouplog import informative, read_groups
from dppo_core.tools.bench.summary import time_to_target

TARGETS = (0.90, 0.95)


def steps_to(curve: list[dict], target: float) -> float | None:
    """The step at which the run's sampled accuracy first reaches ``target``: the bench's own crossing
    (:func:`dppo_core.tools.bench.summary.time_to_target`), read in steps instead of training seconds."""
    return time_to_target([{**p, "train_s": float(p["step"])} for p in curve], target)


def informative_per_step(run_dir: Path) -> float:
    groups = read_groups(run_dir)
    return sum(informative(r) for g in groups for r in g["rewards"]) / len(groups)


def noise_scale(bench_dir: Path, large: str = "grpo_skip", small: str = "grpo_skip_matched", seed: int = 0) -> dict:
    bench = json.loads((bench_dir / "bench.json").read_text())
    runs = {(r["method"], r["seed"]): r for r in bench["runs"]}
    seeds = sorted(s for m, s in runs if m == large and (small, s) in runs)
    final = sum(runs[(large, s)]["accuracy"]["after"] for s in seeds) / len(seeds)
    inf_small = sum(informative_per_step(bench_dir / "runs" / small / f"seed-{s}") for s in seeds) / len(seeds)
    inf_large = sum(informative_per_step(bench_dir / "runs" / large / f"seed-{s}") for s in seeds) / len(seeds)
    out: dict = {"bench": str(bench_dir), "large": large, "small": small, "seeds": seeds,
                 "informative_groups_per_step": {large: round(inf_large, 3), small: round(inf_small, 3)},
                 "targets": {}}
    rng = random.Random(seed)
    # the batch ratio actually rolled out, in informative groups (not exactly 2 where the all-equal shares differ)
    k = inf_large / inf_small

    def scale(ls: list[float]) -> float | None:
        r = math.exp(sum(ls) / len(ls))
        # S(kB)/S(B) = (1 + x/k)/(1 + x) = 1/r  ->  x = (r - 1) / (1 - r/k)
        return (r - 1) / (1 - r / k) * inf_small if 1 < r < k else None

    for frac in TARGETS:
        target = frac * final
        logs = []
        for s in seeds:
            a, b = steps_to(runs[(small, s)]["curve"], target), steps_to(runs[(large, s)]["curve"], target)
            if a and b:
                logs.append(math.log(a / b))
        if not logs:
            continue

        boot = sorted(v for v in (scale([rng.choice(logs) for _ in logs]) for _ in range(10_000)) if v is not None)
        r = math.exp(sum(logs) / len(logs))
        out["targets"][f"{frac:.2f}"] = {
            "target": round(target, 4), "seeds_reaching": len(logs), "steps_ratio": round(r, 4),
            "noise_scale_informative_groups": None if scale(logs) is None else round(scale(logs), 2),
            "ci95": [round(boot[int(0.025 * len(boot))], 2), round(boot[int(0.975 * len(boot)) - 1], 2)]
            if boot else None, "bootstrap_defined": len(boot)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path, help="a bench directory with grpo_skip and grpo_skip_matched runs")
    ap.add_argument("--output", type=Path, default=None, help="write the result here as JSON")
    args = ap.parse_args()
    res = noise_scale(args.bench)
    print(json.dumps(res, indent=1))
    if args.output:
        args.output.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
