"""The real-model comparison (issue #66) read from its bench: SmolLM2-135M on the smollm2-realistic pool.

Made with (from the repository root; advise replays each grpo_skip log, about 20 s a log on one core; time nothing
beside it):

    .venv/bin/python benchmarks/smollm2_realistic.py benchmarks/results/smollm2-realistic/bench \\
        --output benchmarks/results/smollm2-realistic/summary.json

The argument is one ``dppo bench --preset smollm2-realistic`` invocation (its runs interleaved, its times
comparable among themselves only). Reported:

- the pool's persistence from the ``grpo_skip`` runs' ``groups.jsonl`` (:func:`dppo_core.grouplog.persistence`,
  counts pooled over the seeds) and the all-equal share each method rolled out;
- each method's final greedy and sampled accuracy (mean and standard deviation over seeds), its training minutes
  (the sum of its step times), the minutes of its rollout and update phases and its median step;
- for greedy and for sampled accuracy, each pair of :data:`PAIRS` (a method against a baseline): the training time
  to 90% and 95% of the baseline's final accuracy (its mean over seeds), the crossing interpolated between
  evaluations (:func:`dppo_core.tools.bench.summary.time_to_target`), as Σ baseline time / Σ method time over the
  seeds with a 95% bootstrap interval over seed pairs, the per-seed ratios and a t-interval on their logs; a seed
  whose run never reaches the target is counted as missed, and one where either run is there at its first
  evaluation as at the start (in the sums, not among the ratios);
- ``dppo advise --prompt-scheme fitted`` on each ``grpo_skip`` log: its verdict and predicted speedups.

``--markdown`` prints the results README's two tables (:func:`markdown`) from the same summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from dppo_core.grouplog import informative, persistence, read_groups
from dppo_core.tools.advise import advise
from dppo_core.tools.bench.summary import _bootstrap_ratio, _t975, time_to_target
from dppo_core.tools.bench.tables import unmatched_mark, unmatched_note

#: (method, baseline): dense prompts and the rollout budget against the strong baseline at the full batch, the
#: rollout budget against the batch-matched one, and the smaller batch's own gain.
PAIRS = (("dppo", "grpo_skip"), ("dppo_budget", "grpo_skip_matched"), ("dppo_budget", "grpo_skip"),
         ("grpo_skip_matched", "grpo_skip"))
TARGETS = (0.90, 0.95)


def _curve(run: dict, accuracy: str) -> list[dict]:
    """The run's curve with ``accuracy`` (greedy or sampled) where time_to_target reads it."""
    return [{**p, "sampled_accuracy": p[f"{accuracy}_accuracy"]} for p in run["curve"]]


def _final(run: dict, accuracy: str) -> float:
    return run["curve"][-1][f"{accuracy}_accuracy"]


def speedups(runs: dict, method: str, baseline: str, accuracy: str) -> dict[str, Any]:
    """``method`` against ``baseline`` to each fraction of :data:`TARGETS` of the baseline's final ``accuracy``."""
    seeds = sorted(s for m, s in runs if m == baseline and (method, s) in runs)
    if not seeds:
        return {"seeds": [], "why_not": f"no seed has runs of both {method} and {baseline}"}
    final = statistics.fmean(_final(runs[(baseline, s)], accuracy) for s in seeds)
    out: dict[str, Any] = {"seeds": seeds, "baseline_final": round(final, 4)}
    for f in TARGETS:
        target = f * final
        times = [(time_to_target(_curve(runs[(baseline, s)], accuracy), target),
                  time_to_target(_curve(runs[(method, s)], accuracy), target)) for s in seeds]
        both = [(b, m) for b, m in times if b is not None and m is not None]
        ratios = [(b, m) for b, m in both if b > 0 and m > 0]
        ci = _bootstrap_ratio(ratios, 2000, 0)  # over the seeds with both times positive
        logs = [math.log(b / m) for b, m in ratios]
        paired = None
        if len(logs) > 1:
            half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
            centre = statistics.fmean(logs)
            paired = [round(math.exp(centre - half), 3), round(math.exp(centre + half), 3)]
        total = sum(m for _, m in both)
        out[f"{f:.2f}"] = {"target": round(target, 4),
                           "speedup": round(sum(b for b, _ in both) / total, 3) if total > 0 else None,
                           "ci95": [round(x, 3) for x in ci] if ci else None, "paired_ci95": paired,
                           "per_seed": [round(b / m, 3) for b, m in ratios], "missed": len(times) - len(both),
                           "at_start": len(both) - len(ratios)}
    return out


def _all_equal_share(bench_dir: Path, method: str, seeds: list[int]) -> float:
    rewards = [r for s in seeds for g in read_groups(bench_dir / "runs" / method / f"seed-{s}")
               for r in g["rewards"]]
    return sum(not informative(r) for r in rewards) / len(rewards)


def _mean_sd(values: list[float]) -> list[float]:
    return [round(statistics.fmean(values), 4), round(statistics.stdev(values), 4) if len(values) > 1 else 0.0]


def summarize(bench_dir: Path, replay: bool = True) -> dict[str, Any]:
    bench = json.loads((bench_dir / "bench.json").read_text())
    runs = {(r["method"], r["seed"]): r for r in bench["runs"]}
    methods = list(dict.fromkeys(r["method"] for r in bench["runs"]))
    seeds = sorted({s for _, s in runs})
    if "grpo_skip" not in methods:
        raise SystemExit(f"{bench_dir}: no grpo_skip runs, whose logs give the pool's persistence")
    skip_seeds = sorted(s for m, s in runs if m == "grpo_skip")
    counts = {k: 0 for k in ("groups", "after_equal", "equal_after_equal", "after_mixed", "equal_after_mixed")}
    for s in skip_seeds:
        for k, v in persistence(read_groups(bench_dir / "runs" / "grpo_skip" / f"seed-{s}")).to_dict().items():
            if k in counts:
                counts[k] += v

    def ratio(num: str, den: str) -> float | None:
        return round(counts[num] / counts[den], 4) if counts[den] else None

    out: dict[str, Any] = {
        "bench": str(bench_dir), "preset": bench["preset"], "seeds": seeds,
        "persistence": {"p_equal_after_equal": ratio("equal_after_equal", "after_equal"),
                        "p_equal_after_mixed": ratio("equal_after_mixed", "after_mixed"), "groups": counts["groups"]},
        "methods": {}, "speedups": {}, "advise": [],
    }
    for m in methods:
        own = [s for s in seeds if (m, s) in runs]
        mine = [runs[(m, s)] for s in own]
        out["methods"][m] = {
            "seeds": own, "all_equal_share": round(_all_equal_share(bench_dir, m, own), 4),
            "greedy_final": _mean_sd([_final(r, "greedy") for r in mine]),
            "sampled_final": _mean_sd([_final(r, "sampled") for r in mine]),
            "greedy_start": round(statistics.fmean(r["curve"][0]["greedy_accuracy"] for r in mine), 4),
            "training_minutes": round(statistics.fmean(r["wall_s"] for r in mine) / 60, 2),
            "median_step_s": round(statistics.fmean(r["step_time_s"]["median"] for r in mine), 2),
            "phase_minutes": {p: round(statistics.fmean(r["phase_s"][p] for r in mine) / 60, 2)
                              for p in ("rollout", "update") if p in mine[0]["phase_s"]},
            "tokens_generated": round(statistics.fmean(r["tokens"]["generated"] for r in mine)),
            "tokens_trained": round(statistics.fmean(r["tokens"]["trained"] for r in mine)),
            "prompts_rolled_out": mine[0].get("prompts_rolled_out") and round(
                statistics.fmean(r["prompts_rolled_out"] for r in mine), 2)}
    for accuracy in ("greedy", "sampled"):
        out["speedups"][accuracy] = {f"{m} vs {b}": speedups(runs, m, b, accuracy)
                                     for m, b in PAIRS if m in methods and b in methods}
    if replay:
        for s in skip_seeds:
            report = advise(bench_dir / "runs" / "grpo_skip" / f"seed-{s}", prompt_scheme="fitted")
            out["advise"].append({"seed": s, "verdict": report["verdict"], "prediction": report.get("prediction")})
    return out


def _interval(entry: dict[str, Any]) -> str:
    """One target's cell: the speedup, the t-interval on the per-seed log ratios, then the bootstrap interval over
    seed pairs (with a few seeds the bootstrap's spans little more than the seeds' range; the t-interval is the
    wider, honest one), and the seeds that missed or started there."""
    if entry.get("speedup") is None:
        return "never reached"
    ci, paired = entry.get("ci95"), entry.get("paired_ci95")
    cell = (f"{entry['speedup']:.2f}x" + (f" [{paired[0]:.2f}, {paired[1]:.2f}]" if paired else "")
            + (f"; bootstrap [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
    notes = [f"{entry[k]} {label}" for k, label in (("missed", "missed"), ("at_start", "there at step 0"))
             if entry.get(k)]
    return cell + (f" ({', '.join(notes)})" if notes else "")


def markdown(result: dict[str, Any]) -> str:
    """The results README's tables, from :func:`summarize`'s result: each method's run, then each pair's time
    to 90% / 95% of its baseline's final accuracy, greedy and sampled."""
    lines = ["| method | seeds | prompts rolled out a step | all-equal groups | greedy accuracy, start -> final "
             "(sd) | sampled, final (sd) | training minutes (rollout, update) | tokens trained |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m, row in result["methods"].items():
        phases = row["phase_minutes"]
        lines.append(
            f"| `{m}` | {len(row['seeds'])} | {row['prompts_rolled_out'] or 'n/a'} | {row['all_equal_share']:.1%} "
            f"| {row['greedy_start']:.3f} -> {row['greedy_final'][0]:.3f} ({row['greedy_final'][1]:.3f}) "
            f"| {row['sampled_final'][0]:.3f} ({row['sampled_final'][1]:.3f}) | {row['training_minutes']:.1f} "
            f"({phases.get('rollout', 0):.1f}, {phases.get('update', 0):.1f}) | {row['tokens_trained']:,} |")
    lines += ["", "| method against baseline | accuracy | baseline's final | to 90% | to 95% |",
              "|---|---|---:|---:|---:|"]
    marked = False
    for accuracy, pairs in result["speedups"].items():
        for name, e in pairs.items():
            if e.get("why_not"):
                continue
            method, baseline = name.split(" vs ")
            mark = unmatched_mark(method, baseline)
            marked = marked or bool(mark)
            lines.append(f"| `{method}`{mark} against `{baseline}` | {accuracy} | {e['baseline_final']:.3f} | "
                         f"{_interval(e['0.90'])} | {_interval(e['0.95'])} |")
    if marked:
        lines += ["", unmatched_note(result)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path, help="the smollm2-realistic bench directory")
    ap.add_argument("--output", type=Path, default=None, help="write the summary here as JSON")
    ap.add_argument("--no-advise", action="store_true", help="skip the advise replay")
    ap.add_argument("--markdown", action="store_true", help="print the results README's tables too")
    args = ap.parse_args()
    result = summarize(args.bench, replay=not args.no_advise)
    p = result["persistence"]
    print(f"persistence: P(all-equal | previous all-equal) {p['p_equal_after_equal']}, "
          f"P(all-equal | previous mixed) {p['p_equal_after_mixed']}")
    for m, row in result["methods"].items():
        print(f"{m:18s} greedy {row['greedy_start']:.3f} -> {row['greedy_final'][0]:.3f} ± {row['greedy_final'][1]:.3f}"
              f"  sampled -> {row['sampled_final'][0]:.3f}  {row['training_minutes']:.1f} min training, all-equal "
              f"{row['all_equal_share']:.1%}")
    for accuracy, pairs in result["speedups"].items():
        for name, e in pairs.items():
            print(f"{accuracy:8s} {name:34s} " + (e.get("why_not") or "  ".join(
                f"{f}: {e[f]['speedup']}x {e[f]['ci95']} t {e[f]['paired_ci95']} (missed {e[f]['missed']}, at the "
                f"start {e[f]['at_start']})" for f in ("0.90", "0.95"))))
    for a in result["advise"]:
        print(f"advise, seed {a['seed']}: {a['verdict']}")
    if args.markdown:
        print(markdown(result))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
