"""The persistence map (issue #63, item 3): DPPO's rollout budget against the batch-matched grpo_skip, point by point
as the pool's persistence rises, beside what ``dppo advise`` predicted for each point from its grpo_skip logs.

Made with (from the repository root; advise replays each grpo_skip log, about 20 s a log on one core; time nothing
beside it):

    .venv/bin/python benchmarks/persistence_map.py benchmarks/results/realistic-pool/matched \\
        benchmarks/results/persistence-map/persist-50 benchmarks/results/persistence-map/persist-70 \\
        benchmarks/results/persistence-map/persist-85 --output benchmarks/results/persistence-map/map.json

Each argument is one ``dppo bench`` invocation (one point: its runs interleaved, its times comparable among
themselves only) that ran ``grpo_skip``, ``grpo_skip_matched`` and ``dppo_budget``. Per point:

- the pool: the share of level 6 (never solved) in its weights, and its persistence from the ``grpo_skip`` runs'
  ``groups.jsonl`` (:func:`dppo_core.grouplog.persistence`, counts pooled over the seeds): P(all-equal | previous
  all-equal), P(all-equal | previous mixed), the all-equal share;
- the all-equal share each method rolled out, from its own logs;
- measured: ``dppo_budget`` against ``grpo_skip_matched`` to 50% and 75% of the latter's **climb** (the start, the
  mean step-0 accuracy of the point's runs, plus that fraction of its final accuracy's mean over seeds minus the
  start): Σ baseline time / Σ method time over the seeds with a 95% bootstrap interval over seed pairs (the bench's
  estimator, :func:`dppo_core.tools.bench.summary.speedups_vs`, on other targets), and a t-interval on the per-seed
  log ratios; beside them the bench's own 90% and 95% of the final accuracy (``speedup_vs``), which sit near or
  below the start where the baseline climbs little; ``grpo_skip_matched`` against ``grpo_skip`` (the smaller batch's
  own gain) at the same climb targets;
- any of :data:`OTHERS` the bench also ran (``measured.others``): against ``grpo_skip_matched`` and ``grpo_skip``, and
  ``dppo_budget`` against it, all to ``grpo_skip_matched``'s climb targets; and the offline filter's pass over the
  pool (``offline_filter``: prompts kept and dropped, its seconds and tokens, means over the seeds);
- with ``--pool``, instead: several invocations of one point on disjoint seeds, ``dppo_budget``'s per-seed ratios
  against ``grpo_skip_matched`` and ``grpo_skip`` pooled (:func:`pooled`);
- predicted: ``dppo advise --prompt-scheme fitted`` (rate 0.5, the bench's rule) on each ``grpo_skip`` log, its
  ``prediction`` (:func:`dppo_core.tools.advise.predicted_speedup`) averaged over seeds (geometric mean), and the
  error: log(predicted / measured) at each climb target.

Why climb targets (the rule written while the first point's first seed ran, before any ``grpo_skip_matched`` or
``dppo_budget`` run of a map point had finished): a pool with more never-solved prompts climbs less in its steps,
and 90% of a final accuracy of 0.55 is below the warm start's 0.505, where every run is "there" at step 0. On
cpu-realistic the bench's 90% / 95% of the final accuracy sit at about 50% / 75% of the climb.
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

PAIR = ("dppo_budget", "grpo_skip_matched")
#: Other methods a point's bench may hold (the offline filter, dynamic sampling, GRESO, dense prompts): each against
#: the batch-matched baseline, ``grpo_skip`` and the rollout budget, all to the batch-matched baseline's climb.
OTHERS = ("grpo_skip_filtered", "dapo_sampling", "greso_sampling", "dppo")
TARGETS = ("0.90", "0.95")
#: The map's targets: these fractions of the batch-matched baseline's climb from the start (module docstring).
CLIMB = (0.50, 0.75)


def _geomean(values: list[float | None]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _all_equal_share(bench_dir: Path, method: str, seeds: list[int]) -> float:
    groups = [row for s in seeds for g in read_groups(bench_dir / "runs" / method / f"seed-{s}")
              for row in g["rewards"]]
    return sum(not informative(r) for r in groups) / len(groups)


def climb_speedups(bench: dict, baseline: str, method: str, targets_of: str | None = None) -> dict[str, Any]:
    """``method`` against ``baseline`` to each :data:`CLIMB` fraction of the climb of ``targets_of`` (default: the
    baseline's), by seed pairs."""
    runs = {(r["method"], r["seed"]): r for r in bench["runs"]}
    seeds = sorted(s for m, s in runs if m == baseline and (method, s) in runs)
    start = statistics.fmean(r["curve"][0]["sampled_accuracy"] for r in bench["runs"])
    final = statistics.fmean(runs[(targets_of or baseline, s)]["accuracy"]["after"] for s in seeds)
    out: dict[str, Any] = {"start": round(start, 4), "baseline_final": round(final, 4)}
    for f in CLIMB:
        target = start + f * (final - start)
        times = [(time_to_target(runs[(baseline, s)]["curve"], target),
                  time_to_target(runs[(method, s)]["curve"], target)) for s in seeds]
        both = [(b, m) for b, m in times if b and m]
        ci = _bootstrap_ratio(both, 2000, 0)
        logs = [math.log(b / m) for b, m in both]
        paired = None
        if len(logs) > 1:
            half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
            centre = statistics.fmean(logs)
            paired = [round(math.exp(centre - half), 3), round(math.exp(centre + half), 3)]
        out[f"{f:.2f}"] = {"target": round(target, 4),
                           "speedup": round(sum(b for b, _ in both) / sum(m for _, m in both), 3) if both else None,
                           "ci95": [round(x, 3) for x in ci] if ci else None, "paired_ci95": paired,
                           "per_seed": [round(b / m, 3) for b, m in both], "missed": len(times) - len(both)}
    return out


def _prefilter(runs_dir: Path, seeds: list[int]) -> dict[str, Any]:
    """The offline filter's pass over the pool (its ``event: prefilter`` line), summed over the seeds."""
    lines = [json.loads(line) for s in seeds for line in (runs_dir / f"seed-{s}" / "metrics.jsonl").open()]
    lines = [m for m in lines if m.get("event") == "prefilter"]
    keys = ("pool", "kept", "dropped_all_correct", "dropped_all_wrong", "time_prefilter", "tokens_generated")
    return {"seeds": len(lines), **{k: round(statistics.fmean(m[k] for m in lines), 2) for k in keys}}


def point(bench_dir: Path) -> dict[str, Any]:
    bench = json.loads((bench_dir / "bench.json").read_text())
    seeds = sorted({r["seed"] for r in bench["runs"] if r["method"] == "grpo_skip"})
    logs = [bench_dir / "runs" / "grpo_skip" / f"seed-{s}" for s in seeds]
    counts: dict[str, float] = {}
    for log in logs:
        for k, v in persistence(read_groups(log)).to_dict().items():
            if k in ("groups", "after_equal", "equal_after_equal", "after_mixed", "equal_after_mixed", "mixed"):
                counts[k] = counts.get(k, 0) + v
    out: dict[str, Any] = {
        "bench": str(bench_dir), "preset": bench["preset"], "seeds": seeds,
        "level_6_share": bench["configs"]["grpo_skip"]["level_weights"][-1],
        "steps": bench["configs"]["grpo_skip"]["max_steps"],
        "p_equal_after_equal": round(counts["equal_after_equal"] / counts["after_equal"], 4),
        "p_equal_after_mixed": round(counts["equal_after_mixed"] / counts["after_mixed"], 4),
        "all_equal_share": {m: round(_all_equal_share(bench_dir, m, seeds), 4)
                            for m in ("grpo_skip", *PAIR[::-1])},
        "final_accuracy": {m: round(bench["methods"][m]["accuracy"]["after"], 4) for m in ("grpo_skip", *PAIR[::-1])},
        "measured": {}, "predicted": {}, "error": {},
    }
    out["measured"] = {"climb": climb_speedups(bench, PAIR[1], PAIR[0]),
                       "smaller_batch_climb": climb_speedups(bench, "grpo_skip", PAIR[1]),
                       "of_final": {t: {k: e.get(k) for k in ("target", "time_to_target", "ci95", "missed")}
                                    for t, e in bench["speedup_vs"][PAIR[1]][PAIR[0]]["by_target"].items()}}
    others = [m for m in OTHERS if m in bench["methods"]]
    for m in others:
        out["all_equal_share"][m] = round(_all_equal_share(bench_dir, m, seeds), 4)
        out["final_accuracy"][m] = round(bench["methods"][m]["accuracy"]["after"], 4)
        out["measured"].setdefault("others", {})[m] = {
            "against_grpo_skip_matched": climb_speedups(bench, PAIR[1], m),
            "against_grpo_skip": climb_speedups(bench, "grpo_skip", m, targets_of=PAIR[1]),
            "dppo_budget_against_it": climb_speedups(bench, m, PAIR[0], targets_of=PAIR[1])}
    if "grpo_skip_filtered" in others:
        out["offline_filter"] = _prefilter(bench_dir / "runs" / "grpo_skip_filtered", seeds)
    predictions = [advise(log, prompt_scheme="fitted")["prediction"] for log in logs]
    for key in ("effective_batch_ratio", "steps_speedup", "step_cost_ratio", "time_speedup"):
        value = _geomean([p.get(key) for p in predictions])
        out["predicted"][key] = None if value is None else round(value, 3)
    for f in CLIMB:
        pred, meas = out["predicted"]["time_speedup"], out["measured"]["climb"][f"{f:.2f}"]["speedup"]
        out["error"][f"{f:.2f}"] = None if pred is None or meas is None else round(math.log(pred / meas), 3)
    return out


def pooled(benches: list[Path]) -> dict[str, Any]:
    """Several invocations of one point (the same preset, disjoint seeds): ``dppo_budget`` against each baseline to
    each climb target of its own invocation, the per-seed ratios of all of them together (each ratio inside its
    invocation, so no time is compared across invocations): geometric mean and a t-interval on the log ratios."""
    loaded = [json.loads((b / "bench.json").read_text()) for b in benches]
    if len({b["preset"] for b in loaded}) != 1:
        raise SystemExit("--pool: the benches must be invocations of one preset")
    out: dict[str, Any] = {"preset": loaded[0]["preset"], "benches": [str(b) for b in benches],
                           "seeds": sorted(s for b in loaded for s in b["seeds"])}
    for base in (PAIR[1], "grpo_skip"):
        out[base] = {}
        for f in CLIMB:
            ratios = [x for b in loaded for x in climb_speedups(b, base, PAIR[0])[f"{f:.2f}"]["per_seed"]]
            logs = [math.log(x) for x in ratios]
            centre = statistics.fmean(logs)
            half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
            out[base][f"{f:.2f}"] = {"geomean": round(math.exp(centre), 4), "n": len(logs),
                                     "t_ci95": [round(math.exp(centre - half), 4), round(math.exp(centre + half), 4)]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("benches", nargs="+", type=Path, help="bench directories, one per point of the map")
    ap.add_argument("--output", type=Path, default=None, help="write the map here as JSON")
    ap.add_argument("--pool", action="store_true",
                    help="the benches are invocations of one point on disjoint seeds: write their pooled per-seed "
                         "ratios (no advise replay)")
    args = ap.parse_args()
    if args.pool:
        result = pooled(args.benches)
        print(json.dumps(result, indent=1))
        if args.output:
            args.output.write_text(json.dumps(result, indent=1) + "\n")
        return
    points = sorted((point(b) for b in args.benches), key=lambda p: p["p_equal_after_equal"])
    errors = [abs(e) for p in points for e in p["error"].values() if e is not None]
    result = {"points": points,
              "mean_abs_log_error": round(sum(errors) / len(errors), 3) if errors else None}
    for p in points:
        m, pr = p["measured"]["climb"], p["predicted"]
        print(f"{p['preset']:15s} P(ae|ae) {p['p_equal_after_equal']:.3f}  measured to 50% / 75% of the climb "
              f"{m['0.50']['speedup']}x {m['0.50']['ci95']} / {m['0.75']['speedup']}x {m['0.75']['ci95']}  "
              f"predicted {pr['time_speedup']}x (steps {pr['steps_speedup']}x, rho {pr['effective_batch_ratio']})")
        for m, vs in p["measured"].get("others", {}).items():
            for name, e in vs.items():
                print(f"    {m:18s} {name:26s} " + "  ".join(
                    f"{f}: {e[f]['speedup']}x {e[f]['ci95']} (missed {e[f]['missed']})" for f in ("0.50", "0.75")))
    print(f"mean |log(predicted / measured)|: {result['mean_abs_log_error']}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
