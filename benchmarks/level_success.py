"""How often the shipped warm-started tiny model solves each level's training prompts: per level, the distribution of
successes out of G completions per prompt, sampled as training samples them (the trainer's rollout engine and
reward), and the level weights that give a pool a target share of all-correct and all-wrong groups.

Made with (from the repository root, one thread; a few minutes on 2 CPU cores):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/level_success.py --prompts 300 \\
        --output benchmarks/results/realistic-pool/level_success.json

A group is all-correct when its G rewards are all 1, all-wrong when they are all 0, and mixed otherwise (only a mixed
group has a non-zero advantage). The weights follow the rule written in ``dppo_core/tools/bench/cpu_settings.py`` (the
``cpu-realistic`` pool) before this was run: levels 2-5 at equal weight, level 1 for the all-correct groups,
level 6 for the all-wrong ones, the three weights solving the two target shares, rounded to 0.05.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from dppo_core.engines.hf import HFRollout
from dppo_core.engines.types import SamplingConfig
from dppo_core.models import load_model
from dppo_core.rewards import accuracy_reward
from dppo_core.tasks import ALL_LEVELS, ArithmeticTask
from dppo_core.warm_start import warm_start

MIDDLE = (2, 3, 4, 5)


def level_counts(engine: HFRollout, level: int, n: int, g: int, temperature: float, max_tokens: int,
                 chunk: int = 32) -> list[int]:
    """Successes out of ``g`` for ``n`` training prompts of ``level`` drawn without replacement (fixed seed; all of
    them where the level has fewer, as level 1 does)."""
    train = ArithmeticTask([level]).train(level)
    problems = random.Random(f"level-success-{level}").sample(train, min(n, len(train)))
    n = len(problems)
    counts: list[int] = []
    for start in range(0, n, chunk):
        part = problems[start:start + chunk]
        sampling = SamplingConfig(max_tokens=max_tokens, temperature=temperature, seed=level * 1_000_003 + start)
        groups = engine.generate([p.messages() for p in part], g, sampling).groups
        for p, group in zip(part, groups, strict=True):
            rewards = accuracy_reward(None, group.completions, answer=[str(p.answer)] * len(group.completions))
            counts.append(int(sum(rewards)))
    return counts


def shares(counts: list[int], g: int) -> dict[str, float]:
    n = len(counts)
    return {"all_correct": sum(c == g for c in counts) / n, "all_wrong": sum(c == 0 for c in counts) / n,
            "mixed": sum(0 < c < g for c in counts) / n, "mean_success": sum(counts) / (g * n)}


def mixture(per_level: dict[int, dict[str, float]], weights: dict[int, float]) -> dict[str, float]:
    """Expected shares of a pool drawn by ``weights`` (level -> weight, normalised here)."""
    total = sum(weights.values())
    return {k: sum(weights[lvl] / total * per_level[lvl][k] for lvl in weights)
            for k in ("all_correct", "all_wrong", "mixed", "mean_success")}


def solve_weights(per_level: dict[int, dict[str, float]], target_correct: float, target_wrong: float,
                  step: float = 0.05) -> dict[str, object]:
    """The rule: w1 + wm + w6 = 1 (wm split equally over levels 2-5) with the expected all-correct and all-wrong shares
    equal to the targets; solved exactly, then rounded to ``step`` (the grid point nearest the exact shares)."""
    mid = mixture(per_level, {lvl: 1.0 for lvl in MIDDLE})
    a, b = per_level[1], per_level[6]
    # unknowns w1, w6 (wm = 1 - w1 - w6): two linear equations
    #   w1 a_c + w6 b_c + (1 - w1 - w6) m_c = t_c ;  w1 a_w + w6 b_w + (1 - w1 - w6) m_w = t_w
    m11, m12, r1 = a["all_correct"] - mid["all_correct"], b["all_correct"] - mid["all_correct"], \
        target_correct - mid["all_correct"]
    m21, m22, r2 = a["all_wrong"] - mid["all_wrong"], b["all_wrong"] - mid["all_wrong"], target_wrong - mid["all_wrong"]
    det = m11 * m22 - m12 * m21
    w1, w6 = (r1 * m22 - m12 * r2) / det, (m11 * r2 - m21 * r1) / det
    exact = {"level_1": w1, "levels_2_5": 1 - w1 - w6, "level_6": w6}
    best = None
    k = round(1 / step)
    for i in range(k + 1):
        for j in range(k + 1 - i):
            g1, g6 = i * step, j * step
            gm = 1 - g1 - g6
            if gm <= 1e-9:
                continue
            ws = {1: g1, 6: g6, **{lvl: gm / len(MIDDLE) for lvl in MIDDLE}}
            got = mixture(per_level, {lvl: w for lvl, w in ws.items() if w > 0})
            err = (got["all_correct"] - target_correct) ** 2 + (got["all_wrong"] - target_wrong) ** 2
            if best is None or err < best[0]:
                best = (err, ws, got)
    _, ws, got = best
    order = sorted(ws)
    return {"exact": exact, "levels": order, "level_weights": [round(ws[lvl], 4) for lvl in order],
            "expected_shares": got}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=300, help="training prompts per level (at most all)")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--levels", type=int, nargs="+", default=list(ALL_LEVELS))
    parser.add_argument("--target-correct", type=float, default=0.30)
    parser.add_argument("--target-wrong", type=float, default=0.20)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(warm_start())
    engine = HFRollout(model, tokenizer)
    per_level, raw = {}, {}
    for level in args.levels:
        counts = level_counts(engine, level, args.prompts, args.generations, args.temperature, args.max_tokens)
        raw[level] = counts
        per_level[level] = shares(counts, args.generations)
        hist = [counts.count(c) for c in range(args.generations + 1)]
        print(f"level {level}: " + ", ".join(f"{k} {v:.3f}" for k, v in per_level[level].items()) + f"; hist {hist}",
              flush=True)
    out = {"prompts_per_level": args.prompts, "generations": args.generations, "temperature": args.temperature,
           "max_tokens": args.max_tokens, "model": "shipped warm start (dppo_core.warm_start.warm_start())",
           "levels": {str(lvl): {**per_level[lvl],
                                 "histogram": [raw[lvl].count(c) for c in range(args.generations + 1)]}
                      for lvl in per_level},
           "cpu_baselines_pool_levels_2_5": mixture(per_level, {lvl: 1.0 for lvl in MIDDLE if lvl in per_level})}
    if {1, 6, *MIDDLE} <= set(per_level):
        out["target"] = {"all_correct": args.target_correct, "all_wrong": args.target_wrong,
                         "mixed": round(1 - args.target_correct - args.target_wrong, 6)}
        out["weights"] = solve_weights(per_level, args.target_correct, args.target_wrong)
        print(json.dumps(out["weights"], indent=1))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
