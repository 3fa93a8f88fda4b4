"""Which predictor of "this prompt's next group will be informative" separates the groups best, measured offline on
logged runs (their ``groups.jsonl``).

Made with (from the repository root; seconds):

    .venv/bin/python benchmarks/predictors.py benchmarks/results/tuning-batch/b*/runs/grpo_skip/seed-0 \\
        --output benchmarks/results/predictors

A group is informative when its rewards are not all equal (otherwise every advantage is 0 and it carries no
gradient). Each run is replayed step by step: before a step's groups are seen, every predictor gives each of its
prompts a probability that the group will be informative; then the step's groups are observed (by every
predictor alike). Runs of the strong GRPO (``grpo_skip``) roll out every prompt they draw, so their groups are an
unselected sample; a ``dppo`` run's are the ones its posterior chose, and are scored the same way.

Reported per predictor, over every group of every run given (and per run in ``predictors.json``):

- **AUC**: the probability that a random informative group was ranked above a random uninformative one (ties
  count half); 0.5 is no separation;
- **Brier score** of the probabilities, and a calibration table (predicted vs observed share in ten bins);
- **all-equal share kept**: if each step rolled out the half of its prompts the predictor ranks highest, the
  share of those groups that come out all-equal (against the share among all groups: what a random half gives);
  and the same share in expectation under DPPO's posterior rule on the predictor's probabilities (each prompt kept
  with π = clip(c·√p, floor, 1), half of the step's prompts in expectation; unbiased, so never 0), with its
  **variance factor**: Σ 1/π over the informative groups divided by their number, the factor by which those
  weights multiply the second moment of the step's gradient when the informative groups' gradients are of
  similar size (1: nothing informative was pruned).

The predictors (``G`` the group size; a prompt's evidence is its successes and failures over its earlier groups,
each group's discounted by 2^(-age / h) steps):

- ``posterior-h{h}``: today's posterior scheme (``prompt_scheme: posterior``): Beta(1, 1) + the evidence, and
  P(informative) = 1 - E[p^G] - E[(1 - p)^G] under that Beta;
- ``eb-level-h{h}``: the same with an empirical-Bayes prior per level instead of Beta(1, 1): a Beta fitted by the
  method of moments to the success rates of the level's groups seen so far (discounted alike), so an unseen
  prompt starts at its level's rate, and a seen one is shrunk toward it;
- ``last``: the last group's outcome (informative or not), an unseen prompt the share of informative groups so far;
- ``level``: the share of informative groups of the prompt's level so far (no per-prompt evidence);
- ``hindsight`` (not a predictor: it reads the future): Beta(1, 1) + the prompt's successes and failures over all
  its other groups of the run, earlier and later. How far knowing each prompt's success rate (averaged over the
  run) would go.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from dppo_core.grouplog import informative, read_groups


def level_of(prompt_id: str) -> str:
    """The embedded task's ids are ``L{level}:{question}``; any other id is its own level ``?``."""
    return prompt_id.split(":", 1)[0] if prompt_id.startswith("L") and ":" in prompt_id else "?"


def p_informative(a: float, b: float, g: int) -> float:
    """1 - E[p^G] - E[(1 - p)^G] for p ~ Beta(a, b)."""
    def moment(x: float, y: float) -> float:  # E[p^G] = B(x + G, y) / B(x, y)
        return math.exp(math.lgamma(x + g) + math.lgamma(x + y) - math.lgamma(x) - math.lgamma(x + y + g))
    return max(0.0, 1.0 - moment(a, b) - moment(b, a))


class Evidence:
    """Per prompt, discounted successes and failures; per level, discounted group success rates (for the prior)."""

    def __init__(self, half_life: float | None):
        self.half_life = half_life
        self.prompts: dict[str, tuple[float, float, int]] = {}  # id -> (successes, failures, step)
        self.levels: dict[str, list[tuple[float, int]]] = defaultdict(list)  # level -> [(success rate, step)]

    def decay(self, age: int) -> float:
        return 1.0 if self.half_life is None else 0.5 ** (age / self.half_life)

    def of(self, pid: str, step: int) -> tuple[float, float]:
        if pid not in self.prompts:
            return 0.0, 0.0
        s, f, at = self.prompts[pid]
        d = self.decay(step - at)
        return s * d, f * d

    def observe(self, pid: str, rewards: Sequence[float], step: int) -> None:
        s, f = self.of(pid, step)
        hits = sum(min(1.0, max(0.0, r)) for r in rewards)
        self.prompts[pid] = (s + hits, f + len(rewards) - hits, step)
        self.levels[level_of(pid)].append((hits / len(rewards), step))

    def level_prior(self, level: str, step: int) -> tuple[float, float]:
        """Beta(a, b) by the method of moments on the level's discounted group success rates; (1, 1) while too few."""
        seen = self.levels.get(level, [])
        weights = [self.decay(step - at) for _, at in seen]
        total = sum(weights)
        if len(seen) < 8 or total <= 0:
            return 1.0, 1.0
        mean = sum(w * x for w, (x, _) in zip(weights, seen, strict=True)) / total
        var = sum(w * (x - mean) ** 2 for w, (x, _) in zip(weights, seen, strict=True)) / total
        mean = min(max(mean, 1e-3), 1 - 1e-3)
        if var <= 0 or var >= mean * (1 - mean):
            return 1.0, 1.0
        strength = mean * (1 - mean) / var - 1
        return max(mean * strength, 1e-3), max((1 - mean) * strength, 1e-3)


Predictor = Callable[[str, int, int], float]


def make_predictors(half_lives: Sequence[float | None]) -> dict[str, tuple[Evidence | None, Callable]]:
    """name -> (its evidence, or None for the count-based ones, and its prediction function)."""
    out: dict[str, tuple[Evidence | None, Callable]] = {}
    for h in half_lives:
        tag = "inf" if h is None else f"{h:g}"
        ev = Evidence(h)
        out[f"posterior-h{tag}"] = (ev, lambda pid, step, g, ev=ev: p_informative(*(1 + x for x in ev.of(pid, step)),
                                                                                  g))

        ev2 = Evidence(h)

        def eb(pid: str, step: int, g: int, ev: Evidence = ev2) -> float:
            a, b = ev.level_prior(level_of(pid), step)
            s, f = ev.of(pid, step)
            return p_informative(a + s, b + f, g)
        out[f"eb-level-h{tag}"] = (ev2, eb)
    return out


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Mann-Whitney AUC with ties counted half; None without both classes."""
    pos = sum(labels)
    neg = len(labels) - pos
    if not pos or not neg:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, labels, strict=True) if y)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def replay(groups: list[dict], half_lives: Sequence[float | None]) -> dict[str, dict[str, list]]:
    """Every predictor's probability for every group of the run (before its step is observed), and the labels."""
    preds = make_predictors(half_lives)
    out: dict[str, dict[str, list]] = {name: {"p": [], "step": []} for name in (*preds, "last", "level")}
    labels: list[bool] = []
    last: dict[str, bool] = {}
    level_counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    total = [0, 0]
    for rec in groups:
        step = rec["step"]
        g = len(rec["rewards"][0])
        for pid, rewards in zip(rec["ids"], rec["rewards"], strict=True):
            for name, (_, fn) in preds.items():
                out[name]["p"].append(fn(pid, step, g))
            base = (total[0] + 1) / (total[1] + 2)
            out["last"]["p"].append(float(last[pid]) if pid in last else base)
            k = level_counts[level_of(pid)]
            out["level"]["p"].append((k[0] + 1) / (k[1] + 2))
            for name in out:
                out[name]["step"].append(step)
            labels.append(informative(rewards))
        for pid, rewards in zip(rec["ids"], rec["rewards"], strict=True):  # then the step is observed
            for ev, _ in preds.values():
                if ev is not None:
                    ev.observe(pid, rewards, step)
            last[pid] = informative(rewards)
            k = level_counts[level_of(pid)]
            k[0] += informative(rewards)
            k[1] += 1
            total[0] += informative(rewards)
            total[1] += 1
    # hindsight: the prompt's success rate over its other groups of the whole run, future ones included (leave this
    # group out): what no predictor can know, a reference for how far knowing each prompt's rate would go
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for rec in groups:
        for pid, rewards in zip(rec["ids"], rec["rewards"], strict=True):
            totals[pid][0] += sum(min(1.0, max(0.0, r)) for r in rewards)
            totals[pid][1] += len(rewards)
    out["hindsight"] = {"p": [], "step": []}
    for rec in groups:
        for pid, rewards in zip(rec["ids"], rec["rewards"], strict=True):
            hits = totals[pid][0] - sum(min(1.0, max(0.0, r)) for r in rewards)
            out["hindsight"]["p"].append(p_informative(1 + hits, 1 + totals[pid][1] - len(rewards) - hits,
                                                       len(rewards)))
            out["hindsight"]["step"].append(rec["step"])
    return {"labels": labels, **out}  # type: ignore[dict-item]


def evaluate(p: Sequence[float], steps: Sequence, labels: Sequence[bool], floor: float = 0.2) -> dict:
    """AUC, Brier score, calibration bins and the all-equal share of each step's top half."""
    brier = sum((x - y) ** 2 for x, y in zip(p, labels, strict=True)) / len(p)
    bins = []
    for k in range(10):
        idx = [i for i, x in enumerate(p) if k / 10 <= x < (k + 1) / 10 or (k == 9 and x == 1.0)]
        if idx:
            bins.append({"bin": f"{k / 10:.1f}-{(k + 1) / 10:.1f}", "n": len(idx),
                         "predicted": sum(p[i] for i in idx) / len(idx),
                         "observed": sum(labels[i] for i in idx) / len(idx)})
    by_step: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        by_step[s].append(i)
    kept = []
    for idx in by_step.values():
        top = sorted(idx, key=lambda i: -p[i])[: max(1, len(idx) // 2)]
        kept.extend(top)
    kept_mass = uninformative_mass = inverse = 0.0
    for idx in by_step.values():
        pi = sqrt_keep_probs([p[i] for i in idx], len(idx) / 2, floor)
        kept_mass += sum(pi)
        uninformative_mass += sum(q for q, i in zip(pi, idx, strict=True) if not labels[i])
        inverse += sum(1 / q for q, i in zip(pi, idx, strict=True) if labels[i])
    return {"auc": auc(p, labels), "brier": brier, "calibration": bins,
            "all_equal_share_top_half": sum(not labels[i] for i in kept) / len(kept),
            "all_equal_share_sqrt_keep": uninformative_mass / kept_mass,
            "variance_factor_sqrt_keep": inverse / max(1, sum(labels))}


def sqrt_keep_probs(p: Sequence[float], budget: float, floor: float = 0.2) -> list[float]:
    """DPPO's posterior scheme on these probabilities: π = clip(c·√p, floor, 1) with Σ π = budget (bisection on c)."""
    roots = [math.sqrt(max(x, 0.0)) for x in p]
    lo, hi = 0.0, 1e6
    for _ in range(100):
        c = (lo + hi) / 2
        if sum(min(1.0, max(floor, c * r)) for r in roots) < budget:
            lo = c
        else:
            hi = c
    return [min(1.0, max(floor, hi * r)) for r in roots]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories holding groups.jsonl")
    parser.add_argument("--half-lives", nargs="+", default=["5", "10", "20", "40", "inf"])
    parser.add_argument("--floor", type=float, default=0.2, help="the keep probability's floor (tiny-dppo's 0.2)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    half_lives = [None if h == "inf" else float(h) for h in args.half_lives]
    pooled: dict[str, dict[str, list]] = defaultdict(lambda: {"p": [], "step": [], "labels": []})
    per_run = {}
    for run in args.runs:
        groups = read_groups(run)
        if not groups:
            raise SystemExit(f"{run}: its groups.jsonl has no steps")
        r = replay(groups, half_lives)
        labels = r.pop("labels")
        per_run[run.as_posix()] = {"groups": len(labels), "all_equal_share": 1 - sum(labels) / len(labels),
                                   **{n: evaluate(v["p"], v["step"], labels, args.floor) for n, v in r.items()}}
        for n, v in r.items():  # steps made unique per run so that top halves stay within a step of one run
            pooled[n]["p"] += v["p"]
            pooled[n]["labels"] += labels
            pooled[n]["step"] += [(len(per_run), s) for s in v["step"]]
    result = {n: evaluate(v["p"], v["step"], v["labels"], args.floor) for n, v in pooled.items()}
    labels = next(iter(pooled.values()))["labels"]
    base = 1 - sum(labels) / len(labels)
    lines = [f"{len(labels)} groups from {len(args.runs)} runs; all-equal share among all groups: {base:.3f}", "",
             "| predictor | AUC | Brier | all-equal share: each step's top half "
             f"| kept ∝ √p (half, floor {args.floor:g}) | its variance factor |", "|---|---|---|---|---|---|"]
    for n, e in sorted(result.items(), key=lambda kv: -(kv[1]["auc"] or 0)):
        lines.append(f"| {n} | {e['auc']:.3f} | {e['brier']:.4f} | {e['all_equal_share_top_half']:.3f} "
                     f"| {e['all_equal_share_sqrt_keep']:.3f} | {e['variance_factor_sqrt_keep']:.2f} |")
    print("\n".join(lines))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/predictors.py " + " ".join(sys.argv[1:])
        (args.output / "predictors.json").write_text(json.dumps(
            {"command": command, "all_equal_share": base, "pooled": result, "runs": per_run}, indent=1) + "\n")
        (args.output / "predictors.md").write_text(
            "# Predictors of informative groups, offline\n\n" + f"Command: `{command}`\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
