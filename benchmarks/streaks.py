"""Do streaks carry information beyond a prompt's last group? (issue #63, item 4)

GRESO skips a prompt with a probability that grows with z, the number of consecutive all-equal groups it has had;
DPPO's `posterior` and `fitted` rules read the whole history through a decayed Beta posterior. This asks the logs
whether z predicts the next group beyond what the last group (and the posterior) already say:

    python benchmarks/streaks.py benchmarks/results/realistic-pool/matched/runs/grpo_skip/seed-* \\
        --output benchmarks/results/realistic-pool/streaks.json

For each group of a prompt seen before (every `groups.jsonl` given, a run each), z is the length of the run of
all-equal groups that ends with its previous group (0: the previous group was mixed). Reported, pooled over the runs:

- `by_streak`: P(all-equal | z) for z = 0, 1, 2, 3, 4+ with the counts: if z carried nothing beyond the last group,
  every z >= 1 would show the same P;
- `by_streak_and_side`: the same, split by the side of the last all-equal group (all solved / all unsolved);
- `within_posterior_bins`: P(all-equal | z = 1) against P(all-equal | z >= 2) among groups whose posterior
  P(informative) (the `fitted` rule's prediction: the square of `dppo_core.posterior.posterior_scores` under the
  prior fitted to the history so far, half-life 20 steps) falls in the same bin: the information in z that the
  posterior does not already hold.
  A gap there is what a streak-based keep rule could use; none means the posterior already reads it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from dppo_core.grouplog import informative, read_groups
from dppo_core.grpo import group_advantages
from dppo_core.history import PromptHistory
from dppo_core.posterior import posterior_scores

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.01)


def _streak_key(z: int) -> str:
    return "4+" if z >= 4 else str(z)


def _rate(equal: int, total: int) -> dict:
    se = math.sqrt(equal / total * (1 - equal / total) / total) if total else None
    return {"p_all_equal": equal / total if total else None, "n": total, "stderr": se}


def analyse(logs: list[list[dict]], half_life: float = 20.0) -> dict:
    by_streak: dict[str, list[int]] = {}
    by_side: dict[str, list[int]] = {}
    bins: dict[str, list[int]] = {}
    for log in logs:
        streak: dict[str, int] = {}
        side: dict[str, str] = {}
        history = PromptHistory(half_life=half_life)
        for line in log:
            step = line["step"] - 1
            ids, rewards = line["ids"], torch.tensor(line["rewards"], dtype=torch.float64)
            group_size = rewards.shape[1]
            seen = [i for i in ids if i in streak]
            prior = history.fitted_prior(group_size)
            scores = posterior_scores(history, seen, step=step, group_size=group_size, prior=prior) if seen else []
            # the score is sqrt(P(the next group is informative)) with group-scaled advantages
            p_inf = dict(zip(seen, [float(x) ** 2 for x in scores], strict=True))
            for pid, r in zip(ids, line["rewards"], strict=True):
                equal = not informative(r)
                if pid in streak:
                    z = streak[pid]
                    c = by_streak.setdefault(_streak_key(z), [0, 0])
                    c[0], c[1] = c[0] + equal, c[1] + 1
                    if z:  # (a prompt rolled out twice in one step has no posterior for its second group)
                        s = by_side.setdefault(f"{side[pid]} z={_streak_key(z)}", [0, 0])
                        s[0], s[1] = s[0] + equal, s[1] + 1
                    if z and pid in p_inf:
                        x = p_inf.pop(pid)
                        b = next(k for k in range(len(BINS) - 1) if BINS[k] <= x < BINS[k + 1])
                        key = f"[{BINS[b]:.1f}, {min(1.0, BINS[b + 1]):.1f}) z={'1' if z == 1 else '2+'}"
                        e = bins.setdefault(key, [0, 0])
                        e[0], e[1] = e[0] + equal, e[1] + 1
                streak[pid] = streak.get(pid, 0) + 1 if equal else 0
                if equal:
                    side[pid] = "solved" if r[0] == 1.0 else "unsolved" if r[0] == 0.0 else "other"
            history.update(ids, rewards, group_advantages(rewards), step)
    return {"by_streak": {k: _rate(*v) for k, v in sorted(by_streak.items())},
            "by_streak_and_side": {k: _rate(*v) for k, v in sorted(by_side.items())},
            "within_posterior_bins": {k: _rate(*v) for k, v in sorted(bins.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="run directories (or groups.jsonl files), one per run")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    logs = [read_groups(p) for p in args.logs]
    result = {"command": "python benchmarks/streaks.py " + " ".join(sys.argv[1:]), "runs": len(logs),
              **analyse(logs)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for part in ("by_streak", "by_streak_and_side", "within_posterior_bins"):
        print(part)
        for k, v in result[part].items():
            print(f"  {k:24s} P(all-equal) {v['p_all_equal']:.3f} ± {v['stderr']:.3f}  (n={v['n']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
