"""Equal tuning: every method of a bench preset gets the same grid of learning rates and schedules on a seed
that is not reported.

Made with (from the repository root; about 50 minutes on 2 CPU cores for cpu-baselines' four methods):

    DPPO_CACHE_DIR=.cache/dppo ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python benchmarks/tune_lr.py --output benchmarks/results/tuning \
        --methods grpo grpo_skip dppo_paper dppo --schedules constant cosine

For each learning rate of ``--grid`` and schedule of ``--schedules`` it runs ``dppo bench --preset PRESET
--seeds SEED --methods ... learning_rate=LR METHOD.learning_rate=LR ...`` (plus ``lr_schedule=S
min_lr_ratio=R`` for a decaying schedule) into ``OUTPUT/lr-LR`` (``OUTPUT/lr-LR-S`` for a decaying one;
``--resume``: an interrupted grid continues where it stopped), then applies the rules below to every method
and writes ``tuning.json`` and ``tuning.md``.

The rules (the same for every method):

- **Score**: a run's **mean held-out sampled accuracy over its evaluations after step 0** (the area under its
  learning curve per step, divided by the number of evaluations). It rewards learning early and a high plateau
  alike, and uses no time: the time to a target is what the reported seeds then measure.
- **Schedule**: one schedule for every method. A decaying schedule replaces ``constant`` only if, for every
  method, its best learning rate scores higher than constant's best (decay must help every method, not one).
- **Learning rate**: each method's highest-scoring learning rate under that schedule.

The tuning seed (default 0) is not among cpu-baselines' reported seeds (1-5). DPPO's pruning settings were
chosen on seed 0 as well (the paper rule's prompt rate among seven settings, ``results/archive/cpu-full-tuning``;
the variance-aware schemes among the variants of ``results/ablation``); that is DPPO's extra budget.

``--summarize`` only re-reads the runs and rewrites the two files.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path


def setting(lr: float, schedule: str = "constant") -> str:
    """A grid point's name: ``1e-4`` (constant) or ``1e-4-cosine``."""
    return f"{lr:g}" if schedule == "constant" else f"{lr:g}-{schedule}"


def lr_dir(output: Path, lr: float, schedule: str = "constant") -> Path:
    return output / f"lr-{setting(lr, schedule)}"


def score(curve: list[dict]) -> float:
    """Mean sampled accuracy over the evaluations after step 0."""
    points = [p["sampled_accuracy"] for p in curve if p["step"] > 0]
    if not points:
        raise ValueError("a run with no evaluation after step 0 cannot be scored; set eval_steps")
    return statistics.fmean(points)


def choose(table: dict[str, dict[str, dict]], grid: list[float], schedules: list[str]) -> tuple[str, dict[str, str]]:
    """The rules of the module docstring: the schedule (``constant`` unless a decaying one raises every method's
    best score), then each method's best learning rate under it."""
    def best(rows: dict, schedule: str) -> str:
        return max((setting(lr, schedule) for lr in grid), key=lambda k: rows[k]["score"])

    schedule = "constant"
    for decay in schedules:
        if decay != "constant" and all(rows[best(rows, decay)]["score"] > rows[best(rows, "constant")]["score"]
                                       for rows in table.values()):
            schedule = decay
            break
    return schedule, {m: best(rows, schedule) for m, rows in table.items()}


def collect(output: Path, grid: list[float], methods: list[str], schedules: list[str]) -> dict:
    table: dict[str, dict[str, dict]] = {m: {} for m in methods}
    stderrs: list[float] = []
    for schedule in schedules:
        for lr in grid:
            bench = lr_dir(output, lr, schedule) / "bench.json"
            if not bench.exists():
                raise SystemExit(f"{bench} is missing: run without --summarize first")
            for run in json.loads(bench.read_text())["runs"]:
                if run["method"] in table and run.get("eval_stderr_max") is not None:
                    stderrs.append(run["eval_stderr_max"])
                if run["method"] in table:
                    table[run["method"]][setting(lr, schedule)] = {
                        "score": score(run["curve"]), "final_accuracy": run["curve"][-1]["sampled_accuracy"],
                        "step_time_median_s": run["step_time_s"]["median"], "train_s": run["wall_s"],
                        "curve": [(p["step"], p["sampled_accuracy"]) for p in run["curve"]]}
    missing = [f"{m} at {setting(lr, s)}" for m in methods for s in schedules for lr in grid
               if setting(lr, s) not in table[m]]
    if missing:
        raise SystemExit(f"no run of {', '.join(missing)}: run without --summarize first")
    schedule, chosen = choose(table, grid, schedules)
    return {"table": table, "schedule": schedule, "chosen": chosen,
            "eval_stderr_max": max(stderrs) if stderrs else None}


def write(output: Path, args, result: dict, command: str) -> None:
    names = [setting(lr, s) for s in args.schedules for lr in args.grid]
    report = {"command": command, "preset": args.preset, "seed": args.seed, "grid": [f"{lr:g}" for lr in args.grid],
              "settings": args.set,
              "schedules": args.schedules, "min_lr_ratio": args.min_lr_ratio,
              "rule": "schedule: constant unless a decaying one raises every method's best score; learning rate: "
                      "highest mean sampled accuracy over the evaluations after step 0", **result}
    (output / "tuning.json").write_text(json.dumps(report, indent=2) + "\n")
    decay = [s for s in args.schedules if s != "constant"]
    lines = [f"# Learning-rate tuning on {args.preset}, seed {args.seed}", "",
             f"Command: `{command}`", "",
             *([f"Every run with {', '.join(f'`{x}`' for x in args.set)} on top of the preset.", ""] if args.set
               else []),
             "Rules: a run's score is its mean held-out sampled accuracy over its evaluations after step 0 (final "
             "accuracy in brackets). "
             + (f"Decaying schedules ({', '.join(decay)}, to {args.min_lr_ratio:g} of the peak at the last step) "
                "replace the constant learning rate only if, for every method, their best learning rate scores "
                f"higher than the constant one's best. Schedule chosen: **{result['schedule']}**. " if decay else "")
             + "Each method then takes its highest-scoring learning rate under that schedule (in **bold**). One "
             + (f"seed: an evaluation point's standard error is at most {se:.3f} (problems as the unit), and a run's "
                "points share their problems, so differences in the mean under about that are within noise."
                if (se := result.get("eval_stderr_max")) is not None else "seed."), "",
             "| method | " + " | ".join(f"lr {n}: mean acc. (final)" for n in names) + " | chosen |",
             "|---|" + "---|" * (len(names) + 1)]
    for m, rows in result["table"].items():
        cells = []
        for n in names:
            text = f"{rows[n]['score']:.3f} ({rows[n]['final_accuracy']:.3f})"
            cells.append(f"**{text}**" if result["chosen"][m] == n else text)
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {result['chosen'][m]} |")
    (output / "tuning.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/tuning"))
    parser.add_argument("--preset", default="cpu-baselines")
    parser.add_argument("--methods", nargs="+", default=["grpo", "grpo_skip", "dppo_paper", "dppo"])
    parser.add_argument("--grid", nargs="+", type=float, default=[5e-5, 1e-4, 2e-4])
    parser.add_argument("--schedules", nargs="+", default=["constant"], choices=["constant", "cosine", "linear"],
                        help="learning-rate schedules to try (constant must be among them: it is the default)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1,
                        help="where a decaying schedule ends, as a fraction of the peak (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="settings for every run of the grid on top of the preset's (a shorter tuning run: "
                             "max_steps=30 eval_steps=10)")
    parser.add_argument("--summarize", action="store_true")
    args = parser.parse_args()
    if "constant" not in args.schedules:
        parser.error("--schedules must include constant, the schedule a decaying one has to beat")
    command = "python benchmarks/tune_lr.py " + shlex.join(sys.argv[1:])
    previous = args.output / "tuning.json"
    if args.summarize and previous.exists():  # keep the command that made the runs
        command = json.loads(previous.read_text())["command"]
    args.output.mkdir(parents=True, exist_ok=True)
    recorded = args.output / "settings.json"  # the --set the grid's runs were made with
    if not args.summarize:
        if recorded.is_file() and json.loads(recorded.read_text()) != args.set:
            parser.error(f"{args.output} holds runs made with --set {' '.join(json.loads(recorded.read_text()))}; "
                         "resume with the same settings or choose another --output")
        recorded.write_text(json.dumps(args.set) + "\n")
        for schedule in args.schedules:
            decay = [] if schedule == "constant" else [f"lr_schedule={schedule}", f"min_lr_ratio={args.min_lr_ratio:g}"]
            for lr in args.grid:
                out = lr_dir(args.output, lr, schedule)
                cmd = [sys.executable, "-m", "dppo_core.tools.cli", "bench", "--preset", args.preset, "--seeds",
                       str(args.seed), "--methods", *args.methods, "--output-dir", str(out), "--resume",
                       *args.set, f"learning_rate={lr:g}", *decay,
                       # and for each method, after its own settings: were a preset to hold tuned rates
                       # per method, tuning it again would still try the grid, not those
                       *(f"{m}.learning_rate={lr:g}" for m in args.methods)]
                print("$ " + shlex.join(cmd), flush=True)
                subprocess.run(cmd, check=True, env=os.environ.copy())
    if recorded.is_file():
        args.set = json.loads(recorded.read_text())
    write(args.output, args, collect(args.output, args.grid, args.methods, args.schedules), command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
