"""Pilot, then continue, replayed offline on logged groups: what each pilot setting would cost in generated tokens and
in the variance of the informative groups' weights, before any run with a pilot (issue #51's choice of setting).

    python benchmarks/pilot_replay.py --output benchmarks/results/pilot/replay.json \
        benchmarks/results/realistic-pool/comparison/runs/dppo/seed-*/groups.jsonl

Each logged group of G rewards and lengths (a run's ``groups.jsonl``, in step order per file) is replayed as if its
first k completions were the pilot (completions are exchangeable: the first k are a random k), with the package's
own continue probabilities (:func:`dppo_core.posterior.continue_probs`) and a prompt history rebuilt from the groups
seen before the step, as the trainer keeps it (half-life 20 steps): each group with an all-equal pilot is continued
with probability c_q (a seeded draw, ``--seed``) and, if stopped, enters the history as its k pilot rewards, as
``DPPOTrainer`` records it (issue #64: the first version recorded every group whole, G rewards, which made the
posterior's history richer than a pilot run's and its variance factor optimistic). Per setting:

- ``tokens``: expected generated tokens over the logged groups' tokens (the pilot's k always, the rest with c_q);
- ``variance_factor``: the mean of 1 / c_q over the informative groups (rewards not all equal): how much a
  continued informative group's contribution to the gradient's second moment grows (1 without a pilot);
- ``cost_times_variance``: their product, a first-order cost of the same gradient noise (< 1: the pilot pays);
- ``informative_with_equal_pilot``: the share of the informative groups whose pilot was all equal (they are the ones
  the weight 1 / c_q falls on).

The rule written before the comparison ran: the setting with the least variance factor among those whose tokens are
at most 0.75 (the issue's 25% cut).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from dppo_core.grouplog import read_groups
from dppo_core.grpo import group_advantages
from dppo_core.history import PromptHistory
from dppo_core.posterior import continue_probs


def replay(logs: list[list[dict]], k: int, c: float, scheme: str, group_size: int, seed: int = 0) -> dict:
    tokens = total = informative = hidden = 0
    inverse = 0.0
    gen = torch.Generator().manual_seed(seed)
    for log in logs:
        history = PromptHistory(half_life=20.0)
        for line in log:
            rewards = torch.tensor(line["rewards"], dtype=torch.float64)
            lengths = torch.tensor(line["lengths"], dtype=torch.float64)
            step = line["step"] - 1  # the trainer's step counter when it drew
            probs = continue_probs(rewards[:, :k], c, scheme, history=history, prompt_ids=line["ids"],
                                   group_size=group_size, step=step)
            tokens += float((lengths[:, :k].sum(1) + probs * lengths[:, k:].sum(1)).sum())
            total += float(lengths.sum())
            mixed = rewards.std(dim=1) > 0
            informative += int(mixed.sum())
            hidden += int((mixed & (probs < 1)).sum())
            inverse += float((1 / probs)[mixed].sum())
            # the history as the trainer keeps it: a stopped group's k pilot rewards, every other group whole
            stop = (probs < 1) & (torch.rand(probs.shape, generator=gen, dtype=torch.float64) >= probs)
            ids = line["ids"]
            for rows, seen in ((~stop, rewards), (stop, rewards[:, :k])):
                if rows.any():
                    r = seen[rows]
                    history.update([i for i, x in zip(ids, rows.tolist(), strict=True) if x], r, group_advantages(r),
                                   step)
    t, v = tokens / total, inverse / max(1, informative)
    return {"pilot_size": k, "continue_probability": c, "continue_scheme": scheme, "tokens": round(t, 4),
            "variance_factor": round(v, 3), "cost_times_variance": round(t * v, 3),
            "informative_with_equal_pilot": round(hidden / max(1, informative), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="groups.jsonl files (or run directories)")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--probabilities", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--seed", type=int, default=0, help="the continue draws' seed (the history depends on them)")
    args = parser.parse_args()
    logs = [read_groups(p) for p in args.logs]
    group_size = len(logs[0][0]["rewards"][0])
    rows = [replay(logs, k, c, scheme, group_size, args.seed) for k, c, scheme in
            itertools.product(args.sizes, args.probabilities, ("constant", "posterior"))]
    eligible = [r for r in rows if r["tokens"] <= 0.75]
    chosen = min(eligible, key=lambda r: r["variance_factor"]) if eligible else None
    groups = sum(len(line["rewards"]) for log in logs for line in log)
    result = {"command": "python benchmarks/pilot_replay.py " + " ".join(sys.argv[1:]), "groups": groups,
              "group_size": group_size, "rule": "least variance_factor among tokens <= 0.75", "chosen": chosen,
              "settings": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"k={r['pilot_size']} c={r['continue_probability']:<4} {r['continue_scheme']:9s} "
              f"tokens {r['tokens']:.3f} variance factor {r['variance_factor']:.2f} "
              f"product {r['cost_times_variance']:.2f}")
    print(f"chosen: {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
