"""Offline sweep of DPPO's prompt keep rules on logged runs: how much each rule lowers the rolled-out all-equal share,
what it costs in variance (the variance factor), against how persistent the pool is (issue #50).

Made with (from the repository root; about 10 s per run and rule on one core; time nothing beside it):

    .venv/bin/python benchmarks/keep_rule_sweep.py RUN_DIR [RUN_DIR ...] --output FILE.json

Each run's ``groups.jsonl`` is replayed by :func:`dppo_core.tools.advise.replay_prompt_stage` (what ``dppo advise``
prints) with the tiny-dppo preset's estimator (prompt rate 0.5, dense prompts off, so half the prompts are rolled out
in expectation), for every rule of :data:`RULES`: the prompt scheme and the keep-probability floor. Per run and rule:
the expected all-equal share of the rolled-out groups (Σ π·[all-equal] / Σ π) against the logged one, and the
variance factor Σ_{informative} (1/π) / their number, against 2.0 for rolling out half the prompts at random (which
leaves the all-equal share as logged). Beside them the run's persistence (:func:`dppo_core.grouplog.persistence`):
P(all-equal | previous all-equal), P(all-equal | previous mixed), the predictor's AUC, and the prior the ``fitted``
rule would fit to the whole log (``fitted_prior_at_end``: Beta(a, b)).

The replay takes the logged trajectory as the one a pruned run would have followed (advise's docstring says what that
assumes); it draws nothing at random.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dppo_core.grouplog import persistence, read_groups
from dppo_core.tools.advise import make_advice_estimator, replay_prompt_stage

#: (prompt_scheme, min_prompt_keep_prob): the tiny-dppo preset's rule first.
RULES: tuple[tuple[str, float], ...] = (("posterior", 0.2), ("posterior", 0.1), ("fitted", 0.2), ("fitted", 0.1),
                                         ("streak", 0.2), ("streak", 0.1))


def sweep(run: Path, rate: float = 0.5) -> dict[str, Any]:
    groups = read_groups(run)
    pers = persistence(groups).to_dict()
    out: dict[str, Any] = {"run": str(run), "steps": len(groups), "persistence": pers, "rules": []}
    for scheme, floor in RULES:
        est = make_advice_estimator(len(groups[0]["rewards"][0]), rate, None, 0.0, "group", scheme)
        est.min_prompt_keep_prob = floor
        r = replay_prompt_stage(groups, est)
        out.setdefault("fitted_prior_at_end", [round(x, 4) for x in est.history.fitted_prior(est.group_size)])
        out["rules"].append({"prompt_scheme": scheme, "min_prompt_keep_prob": floor,
                             **{k: round(r[k], 4) for k in ("all_equal_share_logged", "all_equal_share_rolled_out",
                                                            "variance_factor", "random_variance_factor",
                                                            "prompt_share_rolled_out", "auc_seen")}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories holding groups.jsonl")
    ap.add_argument("--rate", type=float, default=0.5, help="the prompt prune rate replayed (default 0.5)")
    ap.add_argument("--output", type=Path, default=None, help="write the results here as JSON")
    args = ap.parse_args()
    results = []
    for run in args.runs:
        res = sweep(run, args.rate)
        results.append(res)
        p = res["persistence"]
        print(f"{run}: P(all-equal | previous all-equal) {p['p_equal_after_equal']}, "
              f"P(all-equal | previous mixed) {p['p_equal_after_mixed']}")
        for r in res["rules"]:
            print(f"  {r['prompt_scheme']:9s} floor {r['min_prompt_keep_prob']}: rolled-out all-equal "
                  f"{r['all_equal_share_rolled_out']:.3f} (logged {r['all_equal_share_logged']:.3f}), variance factor "
                  f"{r['variance_factor']:.2f} (at random {r['random_variance_factor']:.2f}), AUC {r['auc_seen']}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"rate": args.rate, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
