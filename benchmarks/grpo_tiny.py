"""GRPO on the embedded task: held-out accuracy before and after, for each rollout engine and update mode.

Made with (from the repository root, 2 CPU cores, about 9 minutes per variant):

    .venv/bin/python benchmarks/grpo_tiny.py --output benchmarks/results/tiny-grpo

Each variant is ``dppo train --preset tiny-grpo`` with the overrides listed in VARIANTS; its metrics.jsonl,
eval.jsonl and config.json are kept under OUTPUT/NAME (checkpoints and the final model are not), and
OUTPUT/summary.md tabulates the first and last evaluation. ``--summarize`` only rewrites the summary from
runs already in OUTPUT.

Learning curves over seeds (full fine-tuning, transformers engine, evaluation every 25 steps on all five
levels, so forgetting of the untrained level 1 shows):

    .venv/bin/python benchmarks/grpo_tiny.py --curves 0 1 2 --output benchmarks/results/tiny-grpo

``--curves-name NAME --set KEY=VALUE ...`` puts curves with extra overrides in OUTPUT/NAME, e.g. the
preset's KL term: ``--curves 0 1 2 --curves-name curves-kl-0.04 --set beta=0.04``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "full-hf": [],
    "full-vllm": ["rollout_engine=vllm"],
    "lora-hf": ["update_mode=lora", "learning_rate=3e-4"],
    "dppo-hf": ["preset=tiny-dppo"],  # the tiny-dppo preset: tiny-grpo plus unbiased pruning
}
KEEP = ("metrics.jsonl", "eval.jsonl", "config.json")


def run(name: str, overrides: list[str], output: Path) -> None:
    work = output / f".{name}-run"
    preset = next((o.split("=", 1)[1] for o in overrides if o.startswith("preset=")), "tiny-grpo")
    overrides = [o for o in overrides if not o.startswith("preset=")]
    cmd = [sys.executable, "-m", "dppo_core", "train", "--preset", preset, "--output-dir", str(work), *overrides]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    (output / name).mkdir(parents=True, exist_ok=True)
    for f in KEEP:
        shutil.copy(work / f, output / name / f)
    shutil.rmtree(work)


CURVE_OVERRIDES = ["eval_steps=25", "eval_levels=[1,2,3,4,5]"]


def summarize(output: Path) -> str:
    lines = ["# GRPO on the embedded task (tiny-grpo preset)", "",
             "Command: `.venv/bin/python benchmarks/grpo_tiny.py --output benchmarks/results/tiny-grpo` "
             "(each variant is `dppo train --preset tiny-grpo` plus the overrides shown).", "",
             "Held-out problems of the trained levels (2-5; 200 per level, level 2 has 148): greedy accuracy and "
             "sampled accuracy at T=1 (2 samples per problem), mean over levels ± standard error; "
             "train time is the sum of step times (evaluation excluded), 2 CPU cores, one variant at a time. "
             "Each run's config.json holds its exact settings; the learning curves of the "
             "preset over three seeds are in curves-kl-0.04.", "",
             "| variant | overrides | steps | train time | greedy before | greedy after | sampled before "
             "| sampled after "
             "| worked-steps share (sampled) | tokens generated | tokens trained |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, overrides in VARIANTS.items():
        d = output / name
        if not (d / "eval.jsonl").exists():
            continue
        evals = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines() if x.strip()]
        steps = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        first, last = evals[0], evals[-1]
        train_s = sum(s["step_time"] for s in steps)

        def acc(e, k):
            return f"{e[k + '_accuracy']:.3f} ± {e[k + '_stderr']:.3f}"

        lines.append(f"| {name} | `{' '.join(overrides) or '-'}` | {len(steps)} | {train_s / 60:.1f} min | "
                     f"{acc(first, 'greedy')} | {acc(last, 'greedy')} | {acc(first, 'sampled')} | "
                     f"{acc(last, 'sampled')} | "
                     f"{first['sampled_steps_share']:.2f} → {last['sampled_steps_share']:.2f} | "
                     f"{sum(s['tokens_generated'] for s in steps):,} | {sum(s['tokens_trained'] for s in steps):,} |")
    lines += ["", "Per level (sampled accuracy, before → after):", "",
              "| variant | " + " | ".join(f"L{lvl}" for lvl in (2, 3, 4, 5)) + " |", "|---|---|---|---|---|"]
    for name in VARIANTS:
        d = output / name
        if not (d / "eval.jsonl").exists():
            continue
        evals = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines() if x.strip()]
        cells = [f"{evals[0][f'sampled_L{lvl}']:.2f} → {evals[-1][f'sampled_L{lvl}']:.2f}" for lvl in (2, 3, 4, 5)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (output / "summary.md").write_text(text)
    return text


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def plot_curves(curves: Path, overrides: list[str] | None = None) -> str:
    """Accuracy vs step and vs training wall-clock per seed (curves.png) and a table (curves.md)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(d for d in curves.iterdir()
                  if d.is_dir() and not d.name.startswith(".") and (d / "eval.jsonl").exists())
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    rows = ["| seed | steps | train time | sampled before | after | gain | sampled L2-5 gain | greedy before | after "
            "| greedy L1 before | after | largest greedy drop (level: drop / SE; < 0: every level rose) "
            "| zero-signal groups at step 1 "
            "| worked-steps share (sampled) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, d in enumerate(runs):
        evals, steps = _read(d / "eval.jsonl"), _read(d / "metrics.jsonl")
        clock = {0: 0.0}
        total = 0.0
        for m in steps:
            total += m["step_time"]
            clock[m["step"]] = total
        xs = [e["step"] for e in evals]
        for ax, x in ((axes[0], xs), (axes[1], [clock[s] / 60 for s in xs])):
            ax.errorbar(x, [e["sampled_accuracy"] for e in evals], yerr=[e["sampled_stderr"] for e in evals],
                        color=f"C{i}", marker="o", label=f"{d.name} sampled (T=1)")
            ax.plot(x, [e["greedy_accuracy"] for e in evals], color=f"C{i}", ls="--", marker="x",
                    label=f"{d.name} greedy")
        first, last = evals[0], evals[-1]
        levels = sorted(int(k[len("greedy_L"):]) for k in first
                        if k.startswith("greedy_L") and not k.endswith("stderr"))

        def level_mean(e, kind, lv):
            return sum(e[f"{kind}_L{x}"] for x in lv) / len(lv)

        l25 = [x for x in levels if x >= 2]
        gain25 = 100 * (level_mean(last, "sampled", l25) - level_mean(first, "sampled", l25))
        drops = [(first[f"greedy_L{x}"] - last[f"greedy_L{x}"], x, first[f"greedy_L{x}_stderr"]) for x in levels]
        drop, lvl, se = max(drops)
        rows.append(f"| {d.name} | {len(steps)} | {total / 60:.1f} min | {first['sampled_accuracy']:.3f} ± "
                    f"{first['sampled_stderr']:.3f} | {last['sampled_accuracy']:.3f} ± {last['sampled_stderr']:.3f} | "
                    f"{100 * (last['sampled_accuracy'] - first['sampled_accuracy']):+.1f} pts | {gain25:+.1f} pts | "
                    f"{first['greedy_accuracy']:.3f} | {last['greedy_accuracy']:.3f} | "
                    f"{first.get('greedy_L1', float('nan')):.3f} | {last.get('greedy_L1', float('nan')):.3f} | "
                    f"L{lvl}: {drop:+.3f} / {se:.3f} | {steps[0]['zero_std_groups']:.2f} | "
                    f"{first['sampled_steps_share']:.2f} → {last['sampled_steps_share']:.2f} |")
    rows += ["", "Per level: the warm start (step 0) and the end of training; greedy per seed, sampled as the mean "
             "over seeds; SE is one evaluation's standard error at step 0 (greedy).", "",
             "| level | held-out problems | greedy at step 0 ± SE | greedy after (per seed) | sampled at step 0 "
             "| sampled after |",
             "|---|---|---|---|---|---|"]
    all_evals = [_read(d / "eval.jsonl") for d in runs]
    first0 = all_evals[0][0]
    per_level = json.loads((runs[0] / "config.json").read_text()).get("eval_problems_per_level", 200)
    from dppo_core.tasks import ArithmeticTask

    task = ArithmeticTask()
    for lv in sorted(int(k[len("greedy_L"):]) for k in first0 if k.startswith("greedy_L") and not k.endswith("stderr")):
        before_sampled = sum(e[0][f"sampled_L{lv}"] for e in all_evals) / len(all_evals)
        after_sampled = sum(e[-1][f"sampled_L{lv}"] for e in all_evals) / len(all_evals)
        rows.append(f"| L{lv} | {min(per_level, len(task.test(lv)))} | "
                    f"{first0[f'greedy_L{lv}']:.3f} ± {first0[f'greedy_L{lv}_stderr']:.3f} | "
                    + " / ".join(f"{e[-1][f'greedy_L{lv}']:.3f}" for e in all_evals)
                    + f" | {before_sampled:.3f} | {after_sampled:.3f} |")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall-clock (min, 2 CPU cores, evaluation excluded)")
    axes[0].set_ylabel("held-out accuracy, trained levels")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("GRPO on the embedded task (tiny-grpo, full fine-tuning)")
    fig.tight_layout()
    fig.savefig(curves / "curves.png", dpi=110)
    from dppo_core.tools.bench import describe_machine

    extra = f" --curves-name {curves.name} --set " + " ".join(f"'{o}'" for o in overrides) if overrides else ""
    text = ("# GRPO learning curves, three seeds\n\nCommand: `.venv/bin/python benchmarks/grpo_tiny.py --curves 0 1 2 "
            f"--output benchmarks/results/tiny-grpo{extra}`\n\n"
            "Sampled (T=1, 2 samples per problem) and greedy accuracy are means over the levels the preset trains on "
            "(levels 2-5 for the tiny-grpo preset); 200 held-out problems per level (level 1 has 21, level 2 has 148). "
            "Train time is the sum of step times (evaluation excluded). Machine: "
            f"{describe_machine()}.\n\n"
            "![curves](curves.png)\n\n" + "\n".join(rows) + "\n")
    (curves / "curves.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/tiny-grpo"))
    parser.add_argument("--only", nargs="*", default=None, help="run only these variants")
    parser.add_argument("--summarize", action="store_true", help="only rewrite summary.md from the runs in OUTPUT")
    parser.add_argument("--curves", nargs="*", type=int, default=None, metavar="SEED",
                        help="instead: learning curves of the full-hf variant for these seeds, into OUTPUT/curves")
    parser.add_argument("--curves-name", default="curves", help="subdirectory of OUTPUT for --curves (default curves)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra config overrides for --curves runs, e.g. 'train_levels=[1,2,3,4,5]'")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if args.curves is not None:
        for seed in args.curves:
            run(f"seed-{seed}", [f"seed={seed}", *CURVE_OVERRIDES, *args.set], args.output / args.curves_name)
        print(plot_curves(args.output / args.curves_name, args.set))
        return
    if not args.summarize:
        for name, overrides in VARIANTS.items():
            if args.only is None or name in args.only:
                run(name, overrides, args.output)
    print(summarize(args.output))


if __name__ == "__main__":
    main()
