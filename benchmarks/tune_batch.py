"""Equal tuning over the batch: prompts per step 8, 16 and 32, the learning rate re-tuned at each on the same grid,
for the strong GRPO (``grpo_skip``) and ``dppo``, on the tuning seed.

Made with (from the repository root; about 45 minutes on 2 CPU cores):

    DPPO_CACHE_DIR=.cache/dppo ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/tune_batch.py --output benchmarks/results/tuning-batch

The rules, written before the runs and the same for every method:

- **Equal data.** Every run sees as many prompts as the preset's own run (B0 prompts a step for S0 steps,
  evaluated every E0): at B prompts per step it runs ``S0 * B0 / B`` steps and evaluates every ``E0 * B0 / B``, so
  every run is evaluated at the same points of prompts seen (cpu-baselines: B0 = 32, S0 = 60, E0 = 10, seven
  points).
- **Learning rate at each batch**: the highest mean held-out sampled accuracy over the evaluations after step 0
  (``benchmarks/tune_lr.py``'s score), on the grid 5e-5, 1e-4, 2e-4 with the constant schedule (the one
  ``tune_lr.py`` chose on cpu-baselines).
- **Batch**: each method's batch is the one whose best run has the highest mean accuracy over training time: the
  run's accuracy-vs-training-time curve (linear between evaluations, its last value after its end) averaged over
  [0, T], T the shortest training time among the method's candidates (its best run at each batch). It rewards
  reaching a level sooner, and does not reward what a run does after the others have stopped. A run's training
  time here is its steps times its median step time (not the sum of step times), so that a stretch of other load
  on the machine during one run does not decide its batch.

``grpo`` is not tuned over the batch: its gradient equals ``grpo_skip``'s at every batch
(tests/unit/test_exact_expectation.py), so it learns alike per step and only costs more per step. ``dppo_paper`` is
an ablation and is not tuned either. The tuning seed (0) is not among the reported seeds (1-5).

Every run's logs (``groups.jsonl`` included) stay in ``OUTPUT/b{B}-lr{LR}/runs/METHOD/seed-0``; ``--resume``
continues an interrupted grid (finished runs are kept); ``--summarize`` only re-reads the runs and rewrites
``tuning.json`` and ``tuning.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dppo_core.tools.bench import bench_preset, method_config, read_jsonl, run_dir, run_method, summarize_run
from dppo_core.tools.bench.presets import resolve_model_keyword
from dppo_core.tools.bench.summary import accuracy_at_time

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_lr import score  # noqa: E402  (the same score as the rate tuning: one rule)


def setting(batch: int, lr: float) -> str:
    return f"b{batch}-lr{lr:g}"


def base_budget(preset) -> tuple[int, int, int]:
    """The preset's own batch, steps and evaluation interval (before any method's settings)."""
    config = preset.shared_config()
    return config.prompts_per_step, config.max_steps, config.eval_steps


def overrides(batch: int, lr: float, base: tuple[int, int, int]) -> list[str]:
    """What a grid point sets on the preset: the batch, the equal-data step budget and evaluation (``base``: the
    preset's own, :func:`base_budget`), the rate."""
    base_batch, base_steps, base_eval = base
    if (base_batch * base_steps) % batch or (base_batch * base_eval) % batch:
        raise SystemExit(f"--batches: {batch} does not divide {base_batch * base_eval}; choose a divisor so that "
                         "every run is evaluated at the same numbers of prompts seen")
    return [f"prompts_per_step={batch}", f"max_steps={base_batch * base_steps // batch}",
            f"eval_steps={base_batch * base_eval // batch}", f"learning_rate={lr:g}"]


def mean_accuracy_over_time(curve: list[dict], horizon: float, points: int = 200) -> float:
    """The accuracy-vs-training-time curve averaged over [0, horizon] (trapezoids on an even grid)."""
    ts = [horizon * k / points for k in range(points + 1)]
    ys = [accuracy_at_time(curve, t) or 0.0 for t in ts]
    return (sum(ys) - (ys[0] + ys[-1]) / 2) / points


def choose(table: dict[str, dict[str, dict]], batches: list[int], grid: list[float]) -> dict[str, dict]:
    """The rules of the module docstring: per method and batch the best rate, then the method's batch."""
    out = {}
    for method, rows in table.items():
        best = {b: max((setting(b, lr) for lr in grid), key=lambda k: rows[k]["score"]) for b in batches}
        horizon = min(rows[best[b]]["wall_s"] for b in batches)
        over_time = {b: mean_accuracy_over_time(rows[best[b]]["curve"], horizon) for b in batches}
        batch = max(batches, key=lambda b: over_time[b])
        out[method] = {"best_lr_per_batch": {str(b): best[b] for b in batches},
                       "mean_accuracy_over_time": {str(b): over_time[b] for b in batches}, "horizon_s": horizon,
                       "batch": batch, "setting": best[batch]}
    return out


def collect(output: Path, methods: list[str], batches: list[int], grid: list[float], seed: int) -> dict:
    table: dict[str, dict[str, dict]] = {m: {} for m in methods}
    for b in batches:
        for lr in grid:
            for m in methods:
                run = run_dir(output / setting(b, lr), m, seed)
                if not (run / "run.json").is_file():
                    raise SystemExit(f"{run} has not finished: run without --summarize (with --resume) first")
                s = summarize_run(read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "eval.jsonl"))
                median = s["step_time_s"]["median"]
                table[m][setting(b, lr)] = {
                    "score": score(s["curve"]), "final_accuracy": s["curve"][-1]["sampled_accuracy"],
                    "wall_s": median * s["steps"], "measured_wall_s": s["wall_s"], "step_time_median_s": median,
                    "curve": [{"step": p["step"], "train_s": median * p["step"],
                               "sampled_accuracy": p["sampled_accuracy"]} for p in s["curve"]]}
    return {"table": table, "chosen": choose(table, batches, grid)}


def write(output: Path, args, result: dict, command: str) -> None:
    report = {"command": command, "preset": args.preset, "seed": args.seed, "batches": args.batches,
              "grid": [f"{lr:g}" for lr in args.grid], "rule": __doc__.split("The rules")[1].split("``grpo``")[0],
              **result}
    (output / "tuning.json").write_text(json.dumps(report, indent=2) + "\n")
    names = [setting(b, lr) for b in args.batches for lr in args.grid]
    batch0, steps0, eval0 = base_budget(bench_preset(args.preset))
    lines = [f"# Batch and learning-rate tuning on {args.preset}, seed {args.seed}", "", f"Command: `{command}`", "",
             f"Rules (benchmarks/tune_batch.py, written before the runs): every run sees {batch0 * steps0:,} prompts "
             f"({steps0} x {batch0} / B steps, evaluated every {eval0} x {batch0} / B). At each batch B the "
             "learning rate with the highest mean sampled accuracy over the evaluations after step 0 (final "
             "accuracy in brackets); then each method's batch is the one whose best run has the highest mean "
             "accuracy over training time, up to the shortest of the method's candidates. One seed: differences "
             "within an evaluation's standard error (about 0.017 on cpu-baselines) are noise.", "",
             "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for m, rows in result["table"].items():
        best = set(result["chosen"][m]["best_lr_per_batch"].values())
        cells = []
        for n in names:
            text = f"{rows[n]['score']:.3f} ({rows[n]['final_accuracy']:.3f})"
            cells.append(f"**{text}**" if n in best else text)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "| method | " + " | ".join(f"B={b}: mean acc. over time (train s)" for b in args.batches)
              + " | horizon | chosen |", "|---|" + "---|" * (len(args.batches) + 2)]
    for m, c in result["chosen"].items():
        walls = {b: result["table"][m][c["best_lr_per_batch"][str(b)]]["wall_s"] for b in args.batches}
        cells = [f"{c['mean_accuracy_over_time'][str(b)]:.3f} ({walls[b]:.0f} s)" for b in args.batches]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {c['horizon_s']:.0f} s | **{c['setting']}** |")
    (output / "tuning.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/tuning-batch"))
    parser.add_argument("--preset", default="cpu-baselines")
    parser.add_argument("--methods", nargs="+", default=["grpo_skip", "dppo"])
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 16, 8])
    parser.add_argument("--grid", nargs="+", type=float, default=[5e-5, 1e-4, 2e-4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="keep finished runs, run the others")
    parser.add_argument("--summarize", action="store_true")
    args = parser.parse_args()
    command = "python benchmarks/tune_batch.py " + shlex.join(sys.argv[1:])
    previous = args.output / "tuning.json"
    if args.summarize and previous.exists():  # keep the command that made the runs
        command = json.loads(previous.read_text())["command"]
    preset = bench_preset(args.preset)
    if not args.summarize:
        if args.output.exists() and not args.resume:
            raise SystemExit(f"{args.output} exists: pass --resume to continue it, or another --output")
        for b in args.batches:
            for lr in args.grid:
                for m in args.methods:
                    config = method_config(preset, m, args.seed, args.output / setting(b, lr),
                                           overrides(b, lr, base_budget(preset)))
                    if (Path(config.output_dir) / "run.json").is_file():
                        continue
                    config = config.with_overrides({"model": resolve_model_keyword(config.model)})
                    print(f"$ {m} {setting(b, lr)}", flush=True)
                    info = run_method(m, config, preset, log=lambda line: print("  " + line, flush=True))
                    print(f"  done in {info['elapsed_s']:.0f} s", flush=True)
    write(args.output, args, collect(args.output, args.methods, args.batches, args.grid, args.seed), command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
