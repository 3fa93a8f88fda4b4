"""The persistence of all-equal groups in logged runs (their ``groups.jsonl``), over all prompts and per level of the
embedded task: what DPPO's prompt stage can see (:func:`dppo_core.grouplog.persistence`).

Made with (from the repository root; seconds):

    .venv/bin/python benchmarks/pool_persistence.py RUN_DIR [RUN_DIR ...] --output FILE.json

Per run: P(all-equal | the prompt's previous group all-equal), P(all-equal | previous mixed), the share of all-equal
groups whose previous group was all-equal, the shares of groups all solved / all unsolved / mixed, and of prompts
solved in every group / in none / in between (a prompt rolled out once counts by its one group); the same for the
first ``--early`` steps (the shares the pool starts from), the first and the second half of the steps, and per level.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dppo_core.grouplog import persistence, read_groups


def summary(records: list[dict[str, Any]], keep=None) -> dict[str, Any]:
    p = persistence(records, keep=keep)
    out = p.to_dict()
    if p.groups:
        out.update({f"share_{k}": round(getattr(p, k) / p.groups, 4) for k in ("all_solved", "all_unsolved", "mixed")})
    if p.prompts:
        out.update({f"share_{k}": round(getattr(p, k) / p.prompts, 4)
                    for k in ("prompts_always_solved", "prompts_never_solved", "prompts_between")})
    return out


def run_report(run: Path, early: int = 5) -> dict[str, Any]:
    records = read_groups(run)
    steps = sorted({r["step"] for r in records})
    half = steps[len(steps) // 2] if steps else 0
    levels = sorted({i.split(":", 1)[0] for r in records for i in r["ids"] if i.startswith("L") and ":" in i})
    return {"run": str(run), "steps": len(steps), "all": summary(records),
            f"first_{early}_steps": summary([r for r in records if r["step"] in steps[:early]]),
            "first_half": summary([r for r in records if r["step"] < half]),
            "second_half": summary([r for r in records if r["step"] >= half]),
            "levels": {lvl: summary(records, keep=lambda i, lvl=lvl: i.startswith(lvl + ":")) for lvl in levels}}


def line(name: str, s: dict[str, Any]) -> str:
    def f(x):
        return "  -  " if x is None else f"{x:.3f}"
    return (f"{name:<12} groups {s['groups']:>5}  P(eq|eq) {f(s['p_equal_after_equal'])} ({s['after_equal']})  "
            f"P(eq|mixed) {f(s['p_equal_after_mixed'])} ({s['after_mixed']})  "
            f"eq-after-eq {f(s['share_equal_with_equal_previous'])}"
            f"  groups solved/unsolved/mixed {f(s.get('share_all_solved'))}/{f(s.get('share_all_unsolved'))}/"
            f"{f(s.get('share_mixed'))}  prompts always/never/between {s['prompts_always_solved']}/"
            f"{s['prompts_never_solved']}/{s['prompts_between']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories (or groups.jsonl files)")
    parser.add_argument("--early", type=int, default=5, help="the first this many steps are also summarised alone")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    reports = [run_report(run, args.early) for run in args.runs]
    for rep in reports:
        print(rep["run"])
        for name in ("all", f"first_{args.early}_steps", "first_half", "second_half"):
            print("  " + line(name, rep[name]))
        for lvl, s in rep["levels"].items():
            print("  " + line(lvl, s))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(reports, indent=1) + "\n")


if __name__ == "__main__":
    main()
