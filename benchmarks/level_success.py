"""How often the shipped warm-started tiny model solves each level's training prompts: per level, the distribution of
successes out of G completions per prompt, sampled as training samples them (the trainer's rollout engine and
reward), and the level weights that give a pool a target share of all-correct and all-wrong groups.

Made with (from the repository root, one thread; a few minutes on 2 CPU cores):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/level_success.py --prompts 300 \\
        --output benchmarks/results/realistic-pool/level_success.json

``--preset smollm2-grpo`` measures that training preset's model (SmolLM2-135M-Instruct, ``dppo build --model
smollm2-135m``) with the prompt it trains on (its ``few_shot`` solved example, drawn from levels 1-6 as a pool of
all six levels draws it), its G, temperature and completion length (the smollm2-realistic pool; about 17 minutes
on 2 cores with ``--prompts 128``):

    .venv/bin/python benchmarks/level_success.py --preset smollm2-grpo --prompts 128 \\
        --output benchmarks/results/smollm2-realistic/level_success.json

A group is all-correct when its G rewards are all 1, all-wrong when they are all 0, and mixed otherwise (only a mixed
group has a non-zero advantage). The weights follow the rule written in ``dppo_core/tools/bench/cpu_settings.py`` (the
``cpu-realistic`` pool) before this was run: levels 2-5 at equal weight, level 1 for the all-correct groups,
level 6 for the all-wrong ones, the three weights solving the two target shares, rounded to 0.05.

Where the exact solution has a weight outside [0, 1] (the model solves no level every time, as SmolLM2 at T = 1 does
not), the rule's fallback (written for the smollm2-realistic pool before its levels 2-6 were measured; see
``dppo_core/tools/bench/cpu_settings.py``) keeps the target's all-equal share instead: levels 1-5 in cpu-realistic's
proportions (level 1 twice each of levels 2-5) and level 6 at the weight, on the 0.05 grid, whose expected share of
all-equal groups (all correct or all wrong) is nearest the target's (50%). ``--weights-from FILE`` recomputes the
weights from a measured file without generating anything.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from dppo_core.config import preset
from dppo_core.data import prompt_renderer
from dppo_core.engines.hf import HFRollout
from dppo_core.engines.types import SamplingConfig
from dppo_core.models import load_model
from dppo_core.policy import resolve_model_path
from dppo_core.rewards import accuracy_reward
from dppo_core.tasks import ALL_LEVELS, ArithmeticTask
from dppo_core.warm_start import warm_start

MIDDLE = (2, 3, 4, 5)


def level_counts(engine: HFRollout, level: int, n: int, g: int, temperature: float, max_tokens: int,
                 chunk: int = 32, render=list) -> list[int]:
    """Successes out of ``g`` for ``n`` training prompts of ``level`` drawn without replacement (fixed seed; all of
    them where the level has fewer, as level 1 does); ``render`` turns a problem's messages into the prompt."""
    train = ArithmeticTask([level]).train(level)
    problems = random.Random(f"level-success-{level}").sample(train, min(n, len(train)))
    n = len(problems)
    counts: list[int] = []
    for start in range(0, n, chunk):
        part = problems[start:start + chunk]
        sampling = SamplingConfig(max_tokens=max_tokens, temperature=temperature, seed=level * 1_000_003 + start)
        groups = engine.generate([render(p.messages()) for p in part], g, sampling).groups
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
    if abs(det) < 1e-12:  # level 1 or 6 no different from levels 2-5: no solution (None), only the grid's best
        exact = None
    else:
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


#: Levels 1-5 among themselves in the fallback: cpu-realistic's proportions (0.3 : 0.15 x 4).
FALLBACK_PROPORTIONS = {1: 2.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}


def feasible(exact: dict[str, float] | None) -> bool:
    """Whether the rule's exact solution is a mixture (every weight in [0, 1])."""
    return exact is not None and all(-1e-9 <= w <= 1 + 1e-9 for w in exact.values())


def all_equal_weights(per_level: dict[int, dict[str, float]], target_all_equal: float,
                      step: float = 0.05) -> dict[str, object]:
    """The fallback: levels 1-5 in :data:`FALLBACK_PROPORTIONS`, level 6 at the grid weight whose expected share
    of all-equal groups is nearest ``target_all_equal``."""
    rest = sum(FALLBACK_PROPORTIONS.values())
    best = None
    for j in range(round(1 / step)):
        w6 = j * step
        ws = {**{lvl: (1 - w6) * w / rest for lvl, w in FALLBACK_PROPORTIONS.items()}, 6: w6}
        got = mixture(per_level, {lvl: w for lvl, w in ws.items() if w > 0})
        err = abs(got["all_correct"] + got["all_wrong"] - target_all_equal)
        if best is None or err < best[0] - 1e-12:
            best = (err, ws, got)
    _, ws, got = best
    order = sorted(ws)
    return {"rule": "fallback: all-equal share", "target_all_equal": target_all_equal, "levels": order,
            "level_weights": [round(ws[lvl], 4) for lvl in order], "expected_shares": got}


def pool_weights(per_level: dict[int, dict[str, float]], target_correct: float,
                 target_wrong: float) -> dict[str, object]:
    """The rule, and its fallback where the exact solution is not a mixture."""
    solved = solve_weights(per_level, target_correct, target_wrong)
    if feasible(solved["exact"]):
        return solved
    return {**all_equal_weights(per_level, target_correct + target_wrong), "exact": solved["exact"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=300, help="training prompts per level (at most all)")
    parser.add_argument("--preset", help="a training preset whose model, prompt (system prompt, few_shot), G, "
                                         "temperature and completion length to use (default: the shipped tiny "
                                         "warm start, G 8, T 1, 64 tokens)")
    parser.add_argument("--generations", type=int, default=None, help="default 8, or the preset's")
    parser.add_argument("--temperature", type=float, default=None, help="default 1, or the preset's")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 64, or the preset's")
    parser.add_argument("--chunk", type=int, default=32, help="prompts per generate call")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    parser.add_argument("--levels", type=int, nargs="+", default=list(ALL_LEVELS))
    parser.add_argument("--target-correct", type=float, default=0.30)
    parser.add_argument("--target-wrong", type=float, default=0.20)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--weights-from", type=Path, default=None,
                        help="a file this script wrote: recompute its weights (to --output) without generating")
    args = parser.parse_args()
    if args.weights_from:
        out = json.loads(args.weights_from.read_text())
        per_level = {int(k): v for k, v in out["levels"].items()}
        if not {1, 6, *MIDDLE} <= set(per_level):
            parser.error(f"--weights-from {args.weights_from}: the rule needs levels 1-6 measured, the file has "
                         f"{sorted(per_level)}")
        out["target"] = {"all_correct": args.target_correct, "all_wrong": args.target_wrong,
                         "mixed": round(1 - args.target_correct - args.target_wrong, 6)}
        out["weights"] = pool_weights(per_level, args.target_correct, args.target_wrong)
        print(json.dumps(out["weights"], indent=1))
        args.output.write_text(json.dumps(out, indent=1) + "\n")
        return
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    render, model_name = list, "shipped warm start (dppo_core.warm_start.warm_start())"
    if args.preset:
        # the example is drawn from the pool's levels (dppo_core.data.few_shot_turns): a pool lists all six (a
        # level it does not want at weight 0), so the example is the same whichever levels are measured here
        config = preset(args.preset).with_overrides({"train_levels": list(ALL_LEVELS)})
        path, render = resolve_model_path(config), prompt_renderer(config)
        model_name = f"{config.model} (preset {args.preset}, few_shot {config.few_shot})"
        defaults = (config.num_generations, config.temperature, config.max_completion_length)
    else:
        path, defaults = warm_start(), (8, 1.0, 64)
    args.generations, args.temperature, args.max_tokens = (
        given if given is not None else default
        for given, default in zip((args.generations, args.temperature, args.max_tokens), defaults, strict=True))
    model, tokenizer = load_model(path)
    engine = HFRollout(model, tokenizer)
    per_level, raw = {}, {}
    for level in args.levels:
        counts = level_counts(engine, level, args.prompts, args.generations, args.temperature, args.max_tokens,
                              chunk=args.chunk, render=render)
        raw[level] = counts
        per_level[level] = shares(counts, args.generations)
        hist = [counts.count(c) for c in range(args.generations + 1)]
        print(f"level {level}: " + ", ".join(f"{k} {v:.3f}" for k, v in per_level[level].items()) + f"; hist {hist}",
              flush=True)
    out = {"prompts_per_level": args.prompts, "generations": args.generations, "temperature": args.temperature,
           "max_tokens": args.max_tokens, "model": model_name, "preset": args.preset,
           "levels": {str(lvl): {**per_level[lvl],
                                 "histogram": [raw[lvl].count(c) for c in range(args.generations + 1)]}
                      for lvl in per_level},
           "cpu_baselines_pool_levels_2_5": mixture(per_level, {lvl: 1.0 for lvl in MIDDLE if lvl in per_level})}
    if {1, 6, *MIDDLE} <= set(per_level):
        out["target"] = {"all_correct": args.target_correct, "all_wrong": args.target_wrong,
                         "mixed": round(1 - args.target_correct - args.target_wrong, 6)}
        out["weights"] = pool_weights(per_level, args.target_correct, args.target_wrong)
        print(json.dumps(out["weights"], indent=1))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
