"""The table of benchmarks/smollm2_run.sh's runs: GRPO and DPPO on SmolLM2-135M-Instruct, from their own logs.

    python benchmarks/smollm2_summary.py [OUT]     (OUT: benchmarks/results/smollm2)

Reads OUT/<method>/{eval.jsonl, metrics.jsonl}, OUT/<method>.wall_s (the run's wall-clock seconds, evaluations
included, written by the run script) and, for a run continued with --resume, OUT/<method>.continued_wall_s; writes
OUT/summary.json (each curve point with the minutes of training steps to it, ``curve_train_minutes``) and the
table between the markers of OUT/README.md (printed too). Gains are read at the common
step (the last step every method ran: both presets' max_steps) and at each run's last step. The standard error of a
gain is over the held-out problems, sqrt(se_before^2 + se_after^2): the two evaluations are of the same problems, so
this is conservative.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

METHODS = ("grpo", "dppo")
START, END = "<!-- smollm2:start -->", "<!-- smollm2:end -->"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(out: Path) -> dict:
    summary = {}
    for method in METHODS:
        evals = [r for r in _read(out / method / "eval.jsonl") if "greedy_accuracy" in r]
        steps = [r for r in _read(out / method / "metrics.jsonl") if "step_time" in r]
        first, last = evals[0], evals[-1]
        wall, more = out / f"{method}.wall_s", out / f"{method}.continued_wall_s"
        summary[method] = {
            "steps": len(steps),
            "wall_minutes": float(wall.read_text()) / 60 if wall.is_file() else None,
            "continued_wall_minutes": float(more.read_text()) / 60 if more.is_file() else None,
            "train_minutes": sum(r["step_time"] for r in steps) / 60,
            "curve": [(r["step"], r["greedy_accuracy"], r["greedy_stderr"], r["sampled_accuracy"]) for r in evals],
            # the minutes of training steps (evaluations not counted) at each point of the curve
            "curve_train_minutes": [sum(s["step_time"] for s in steps if s["step"] <= r["step"]) / 60
                                    for r in evals],
            "greedy_gain": last["greedy_accuracy"] - first["greedy_accuracy"],
            "greedy_gain_se": math.hypot(first["greedy_stderr"], last["greedy_stderr"]),
            "sampled_gain": last["sampled_accuracy"] - first["sampled_accuracy"],
            "tokens_generated": sum(r["tokens_generated"] for r in steps),
            "tokens_trained": sum(r["tokens_trained"] for r in steps),
            "zero_std_groups": statistics.mean(r["zero_std_groups"] for r in steps),
        }
    common = min(max(s for s, *_ in summary[m]["curve"]) for m in METHODS)
    for m in METHODS:
        at = {step: (a, se) for step, a, se, _ in summary[m]["curve"]}
        (a0, se0), (a1, se1) = at[summary[m]["curve"][0][0]], at[common]
        upto = [r for r in _read(out / m / "metrics.jsonl") if "step_time" in r and r["step"] <= common]
        summary[m] |= {"common_step": common, "greedy_gain_at_common": a1 - a0,
                       "greedy_gain_at_common_se": math.hypot(se0, se1),
                       "train_minutes_at_common": sum(r["step_time"] for r in upto) / 60,
                       "tokens_generated_at_common": sum(r["tokens_generated"] for r in upto),
                       "tokens_trained_at_common": sum(r["tokens_trained"] for r in upto),
                       "zero_std_groups_at_common": statistics.mean(r["zero_std_groups"] for r in upto),
                       "median_s": {phase: statistics.median(r[f"time_{phase}"] for r in upto)
                                    for phase in ("rollout", "update")}
                       | {"step": statistics.median(r["step_time"] for r in upto)}}
    return summary


def table(summary: dict) -> str:
    rows = ["| | " + " | ".join(f"`{m}`" for m in METHODS) + " |", "|---|" + "---:|" * len(METHODS)]

    def row(name, fmt):
        rows.append(f"| {name} | " + " | ".join(fmt(summary[m]) for m in METHODS) + " |")

    steps = sorted({s for m in METHODS for s, *_ in summary[m]["curve"]})
    for step in steps:
        row(f"greedy accuracy, step {step}", lambda s, step=step: next(
            (f"{a:.3f} ± {se:.3f}" for st, a, se, _ in s["curve"] if st == step), "–"))
    common = summary[METHODS[0]]["common_step"]
    row(f"**greedy gain by step {common}** (± its standard error)",
        lambda s: f"**{s['greedy_gain_at_common']:+.3f} ± {s['greedy_gain_at_common_se']:.3f}**")
    row("greedy gain by the last step", lambda s: f"{s['greedy_gain']:+.3f} ± {s['greedy_gain_se']:.3f}")
    row("sampled accuracy (T = 1), first → last", lambda s: f"{s['curve'][0][3]:.3f} → {s['curve'][-1][3]:.3f}")
    row("steps", lambda s: str(s["steps"]))
    row(f"wall-clock minutes to step {common} (evaluations included)",
        lambda s: "–" if s["wall_minutes"] is None else f"{s['wall_minutes']:.1f}")
    row("then continued (`--resume`), minutes", lambda s: "–" if s["continued_wall_minutes"] is None
        else f"{s['continued_wall_minutes']:.1f} (to step {s['steps']})")
    row(f"training minutes to step {common} (steps only)", lambda s: f"{s['train_minutes_at_common']:.1f}")
    row(f"median step to step {common}: rollout / update / whole (s)",
        lambda s: f"{s['median_s']['rollout']:.1f} / {s['median_s']['update']:.1f} / {s['median_s']['step']:.1f}")
    row(f"tokens generated / trained to step {common}",
        lambda s: f"{s['tokens_generated_at_common']:,} / {s['tokens_trained_at_common']:,}")
    row(f"rolled-out groups all equal, to step {common}", lambda s: f"{100 * s['zero_std_groups_at_common']:.1f}%")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "benchmarks/results/smollm2")
    summary = summarise(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = table(summary)
    readme = out / "README.md"
    if readme.is_file() and START in readme.read_text():
        head, rest = readme.read_text().split(START, 1)
        readme.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
