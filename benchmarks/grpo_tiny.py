"""GRPO on the embedded task: held-out accuracy before and after, for each rollout engine and update mode.

Made with (from the repository root, 2 CPU cores, about 9 minutes per variant):

    .venv/bin/python benchmarks/grpo_tiny.py --output benchmarks/results/tiny-grpo

Each variant is ``dppo train --preset tiny-grpo`` with the overrides listed in VARIANTS; its metrics.jsonl,
eval.jsonl and config.json are kept under OUTPUT/NAME (checkpoints and the final model are not), and
OUTPUT/summary.md tabulates the first and last evaluation. ``--summarize`` only rewrites the summary from
runs already in OUTPUT.
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
}
KEEP = ("metrics.jsonl", "eval.jsonl", "config.json")


def run(name: str, overrides: list[str], output: Path) -> None:
    work = output / f".{name}-run"
    cmd = [sys.executable, "-m", "dppo_core.cli", "train", "--preset", "tiny-grpo", "--output-dir", str(work), *overrides]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    (output / name).mkdir(parents=True, exist_ok=True)
    for f in KEEP:
        shutil.copy(work / f, output / name / f)
    shutil.rmtree(work)


def summarize(output: Path) -> str:
    lines = ["# GRPO on the embedded task (tiny-grpo preset)", "",
             "Command: `.venv/bin/python benchmarks/grpo_tiny.py --output benchmarks/results/tiny-grpo` "
             "(each variant is `dppo train --preset tiny-grpo` plus the overrides shown).", "",
             "Held-out problems of the trained levels (2-5; 200 per level, level 2 has 148): greedy accuracy and "
             "sampled accuracy at T=1 (2 samples per problem), mean over levels ± standard error; "
             "train time is the sum of step times (evaluation excluded).", "",
             "| variant | overrides | steps | train time | greedy before | greedy after | sampled before | sampled after "
             "| worked-steps share (sampled) |",
             "|---|---|---|---|---|---|---|---|---|"]
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
                     f"{acc(last, 'sampled')} | {first['sampled_steps_share']:.2f} → {last['sampled_steps_share']:.2f} |")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/tiny-grpo"))
    parser.add_argument("--only", nargs="*", default=None, help="run only these variants")
    parser.add_argument("--summarize", action="store_true", help="only rewrite summary.md")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        for name, overrides in VARIANTS.items():
            if args.only is None or name in args.only:
                run(name, overrides, args.output)
    print(summarize(args.output))


if __name__ == "__main__":
    main()
