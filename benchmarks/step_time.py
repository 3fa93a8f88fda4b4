"""Training-step time of the cpu-full setting, two versions of the code side by side on one machine.

Made with (from the repository root; about 7 minutes on 2 otherwise idle CPU cores):

    git worktree add /tmp/dppo-before a83d99b     # the code before the compact rollout loop
    DPPO_CACHE_DIR=.cache/dppo .venv/bin/python benchmarks/step_time.py \\
        --before /tmp/dppo-before --methods grpo grpo_skip dppo_paper --before-name dppo_paper=dppo \\
        --output benchmarks/results/step_time

(``--before-name dppo_paper=dppo``: the paper's scheme was called ``dppo`` at a83d99b; today's ``dppo`` is the
variance-aware method, which that code does not have.)

Each *variant* is a version of the package (a directory put first on ``PYTHONPATH``) and the update layout:

    before          the code at ``--before`` (transformers ``generate`` rollouts), the bench's layout
    after           this checkout (the compact rollout loop), the bench's layout
    after-shared    this checkout, with ``shared_prefix: true`` (each prompt once per group in the update)

For each method (``--methods``, default grpo, grpo_skip and dppo) and variant, a worker process builds the
``cpu-baselines`` preset's configuration of that method (seed ``--seed``, no evaluation, no checkpoints) and
runs ``--steps`` training steps with ``DPPOTrainer.train_step``; the first ``--warmup`` are not timed. The
runs of one method see the same prompts and, the compact loop giving the same samples as ``generate``,
the same completions at the first step (later steps differ by floating-point rounding of the update).
``--rounds`` rounds cycle through every (method, variant) pair, so a change in machine load hits all alike.
Reported per pair: the median over the timed steps of all rounds of the step time and of each phase, and
the speed-up of each variant's median step over ``before``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: the Makefile's variables that pin the CPU's floating-point kernels (recorded, not set, here)
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
PHASES = ("rollout", "reward", "prune", "pack", "update", "sync")
VARIANTS = ("before", "after", "after-shared")


def worker(method: str, variant: str, args: argparse.Namespace) -> dict:
    import dppo_core
    from dppo_core.tools.bench.presets import bench_preset, method_config
    from dppo_core.trainer import DPPOTrainer

    with tempfile.TemporaryDirectory() as out:
        config = method_config(bench_preset("cpu-baselines"), method, args.seed, out)
        config = config.with_overrides({"eval_steps": 0, "save_steps": 0, "max_steps": args.steps,
                                        "shared_prefix": variant == "after-shared"})
        trainer = DPPOTrainer(config, progress=False)
        trainer.engine = trainer.make_engine()
        records = [trainer.train_step() for _ in range(args.steps)]
    timed = records[args.warmup:]
    return {"package": str(Path(dppo_core.__file__).parent), "method": method, "variant": variant,
            "steps": [{k: r.get(k) for k in ("step", "step_time", "tokens_generated", "completions_rolled_out",
                                            "sequences_trained", "update_density")
                       + tuple(f"time_{p}" for p in PHASES)} for r in timed]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, help="a checkout of the code to compare against")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/step_time"))
    parser.add_argument("--methods", nargs="+", default=["grpo", "grpo_skip", "dppo"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--before-name", action="append", default=[], metavar="METHOD=NAME",
                        help="run NAME in the 'before' checkout where this one runs METHOD (a method renamed since)")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args)), flush=True)
        return 0
    if "before" in args.variants and (args.before is None or not (args.before / "dppo_core").is_dir()):
        parser.error("the 'before' variant needs --before DIR, a checkout with dppo_core/ in it")
    before_names = dict(kv.split("=", 1) for kv in args.before_name if "=" in kv)
    if len(before_names) != len(args.before_name) or not set(before_names) <= set(args.methods):
        parser.error(f"--before-name takes METHOD=NAME with METHOD one of --methods {args.methods}, "
                     f"got {args.before_name}")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")

    here = Path(__file__).resolve().parents[1]
    passthrough = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    per_pair: dict[tuple[str, str], list[dict]] = {}
    load_before, loads = os.getloadavg(), []
    for round_ in range(args.rounds):
        for method in args.methods:
            for variant in args.variants:
                code = (args.before if variant == "before" else here).resolve()
                env = {**os.environ, "PYTHONPATH": str(code)}
                if "DPPO_CACHE_DIR" in env:  # the worker runs in the code's directory: share one model cache
                    env["DPPO_CACHE_DIR"] = str(Path(env["DPPO_CACHE_DIR"]).resolve())
                print(f"round {round_ + 1}/{args.rounds}: {method} / {variant} ...", flush=True)
                name = before_names.get(method, method) if variant == "before" else method
                proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", name, variant,
                                       *passthrough], capture_output=True, text=True, env=env, cwd=code, check=False)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"worker {method}/{variant} failed (exit {proc.returncode})")
                r = json.loads(lines[-1][len("RESULT "):])
                if Path(r["package"]).resolve() != (code / "dppo_core").resolve():
                    raise SystemExit(f"worker {method}/{variant} imported {r['package']}, not {code / 'dppo_core'}")
                loads.append(round(os.getloadavg()[0], 2))
                print(f"    median step {statistics.median(s['step_time'] for s in r['steps']):.2f} s "
                      f"(load {loads[-1]})", flush=True)
                per_pair.setdefault((method, variant), []).append(r)

    results = []
    for (method, variant), rs in per_pair.items():
        steps = [s for r in rs for s in r["steps"]]
        row = {"method": method, "variant": variant, "timed_steps": len(steps),
               "step_time_median": round(statistics.median(s["step_time"] for s in steps), 3)}
        for p in PHASES:
            row[f"time_{p}_median"] = round(statistics.median(s[f"time_{p}"] or 0.0 for s in steps), 3)
        row["tokens_generated_median"] = statistics.median(s["tokens_generated"] for s in steps)
        row["update_density_median"] = round(statistics.median(s["update_density"] or 0.0 for s in steps), 3)
        row["steps"] = steps
        results.append(row)
    by = {(r["method"], r["variant"]): r for r in results}

    def ratio(m: str, v: str, key: str) -> float:
        return round(by[(m, "before")][key] / by[(m, v)][key], 2)

    speedups = {m: {v: {"step": ratio(m, v, "step_time_median"), "rollout": ratio(m, v, "time_rollout_median"),
                        "update": ratio(m, v, "time_update_median")}
                    for v in args.variants if v != "before" and (m, v) in by}
                for m in args.methods if (m, "before") in by}
    git = subprocess.run(["git", "-C", str(args.before), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=False).stdout.strip() if args.before else None
    import torch

    report = {
        "command": "DPPO_CACHE_DIR=.cache/dppo .venv/bin/python benchmarks/step_time.py " + " ".join(sys.argv[1:]),
        "before_commit": git, "setting": "cpu-baselines preset configuration per method, seed "
                                         f"{args.seed}, {args.steps} steps of which the first {args.warmup} untimed",
        "rounds": args.rounds, "before_names": before_names,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "kernel_variables": {k: os.environ.get(k) for k in KERNEL_VARIABLES},
                    "loadavg_before": [round(x, 2) for x in load_before], "loadavg_1min_per_worker": loads},
        "results": results, "speedup_over_before": speedups,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "step_time.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Step time of the cpu-full setting: the code before and after, side by side", "",
             f"Command: `{report['command']}` (`--before` a checkout of {git or 'the earlier code'}); kernel "
             f"variables {report['machine']['kernel_variables']}", "",
             f"Setting: {report['setting']}; medians over the timed steps of {args.rounds} rounds."
             + "".join(f" `{m}` is `{n}` in the `before` checkout." for m, n in before_names.items()), "",
             "| method | variant | step (s) | rollout | reward | update | tokens generated | update density |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['variant']} | {r['step_time_median']:.2f} | {r['time_rollout_median']:.2f} "
                     f"| {r['time_reward_median']:.2f} | {r['time_update_median']:.2f} | "
                     f"{r['tokens_generated_median']:.0f} | {r['update_density_median']:.2f} |")
    lines += ["", "Speed-up of the median over `before` (step / rollout / update):", ""]
    for m, vs in speedups.items():
        lines.append(f"- {m}: " + "; ".join(f"{v} {x['step']:.2f}x / {x['rollout']:.2f}x / {x['update']:.2f}x"
                                            for v, x in vs.items()))
    lines += ["", f"Machine: {os.cpu_count()} CPUs, torch {torch.__version__}; 1-minute load average per worker "
              f"{loads}."]
    (args.output / "step_time.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(speedups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
