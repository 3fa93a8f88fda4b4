"""Which of DPPO's levers buys what: variants of the ``dppo`` method against ``grpo`` and ``grpo_skip``, same runs.

Made with (from the repository root; each run 1.5-3 minutes on 2 CPU cores, the baselines once per seed):

    DPPO_CACHE_DIR=.cache/dppo ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/ablate_dppo.py --output benchmarks/results/ablation --seeds 0

For each seed, ``grpo`` and ``grpo_skip`` run once (``OUTPUT/baselines``); each variant is then ``dppo bench
--preset PRESET --methods grpo grpo_skip dppo`` into ``OUTPUT/VARIANT`` with those two baseline runs copied in
(``--resume`` keeps them), so every variant is compared with the same baseline runs, from the same session and
machine. A variant is a list of ``dppo.KEY=VALUE`` overrides on top of the paper's configuration
(:data:`BASE`, :data:`VARIANTS`). ``ablation.json`` and ``ablation.md`` hold, per variant: seconds per step,
tokens trained and rolled out per step, Kish effective sample size per step, the mean held-out accuracy over
the evaluations after step 0 (learning per step), the final accuracy, time to the preset's target against
``grpo_skip`` and ``grpo`` (mean of the per-seed ratios), and the worst accuracy difference to ``grpo_skip`` at
equal training time from a quarter of its run on. ``--summarize`` only re-reads the runs.

On the tuning seed (0, not among cpu-baselines' reported seeds) this is how a variant is chosen; the chosen
one is then measured on the reported seeds by ``dppo bench --preset cpu-baselines``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from dppo_core.tools.bench.summary import accuracy_at_time

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_lr import score  # noqa: E402  (the tuning rule: mean sampled accuracy after step 0)

#: Every variant starts from the paper's configuration (what the dppo method was when these runs were made,
#: today's ``dppo_paper``: paper prompt scheme at rate 0.8, proportional completion scheme at 0.5, floors 0.2,
#: systematic fixed-size sampling in a random order, packing), set on the dppo method so that the runs are
#: what they were whatever dppo's defaults are now; then the variant's own overrides.
BASE: list[str] = ["dppo.prompt_prune_rate=0.8", "dppo.prompt_scheme=paper", "dppo.dense_prompts=false",
                   "dppo.completion_scheme=proportional", "dppo.length_exponent=0.5",
                   "dppo.fixed_size_design=systematic", "dppo.posterior_half_life=20"]
#: Overrides of BASE. ``posterior-dense-length1-sorted`` is today's default dppo.
VARIANTS: dict[str, list[str]] = {
    "paper": [],  # the paper's configuration as it is (today's dppo_paper)
    "completions-only": ["dppo.prompt_prune_rate=0"],
    "posterior-dense": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5", "dppo.dense_prompts=true"],
    "posterior-dense-length-sorted": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5",
                                      "dppo.dense_prompts=true", "dppo.completion_scheme=length",
                                      "dppo.fixed_size_design=sorted"],
    "posterior-0.3": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.3"],
    "length-sorted": ["dppo.prompt_prune_rate=0", "dppo.completion_scheme=length", "dppo.fixed_size_design=sorted"],
    "sorted": ["dppo.prompt_prune_rate=0", "dppo.fixed_size_design=sorted"],
    "pivotal": ["dppo.prompt_prune_rate=0", "dppo.fixed_size_design=pivotal"],
    "posterior-dense-length1-sorted": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5",
                                       "dppo.dense_prompts=true", "dppo.completion_scheme=length",
                                       "dppo.length_exponent=1.0", "dppo.fixed_size_design=sorted"],
    "posterior-dense-length1-sorted-c0.75": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5",
                                             "dppo.dense_prompts=true", "dppo.completion_scheme=length",
                                             "dppo.length_exponent=1.0", "dppo.fixed_size_design=sorted",
                                             "dppo.completion_prune_rate=0.75"],
    "length1-sorted": ["dppo.prompt_prune_rate=0", "dppo.completion_scheme=length", "dppo.length_exponent=1.0",
                       "dppo.fixed_size_design=sorted"],
    "paper-dense": ["dppo.prompt_prune_rate=0.5", "dppo.dense_prompts=true"],
    "proportional-dense": ["dppo.prompt_scheme=proportional", "dppo.prompt_prune_rate=0.5", "dppo.dense_prompts=true"],
    "posterior-dense-sorted": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5", "dppo.dense_prompts=true",
                               "dppo.fixed_size_design=sorted"],
    "posterior-dense-24": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5", "dppo.dense_prompts=true",
                           "dppo.prompts_per_step=24"],
    "posterior-dense-c0.7": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5", "dppo.dense_prompts=true",
                             "dppo.completion_prune_rate=0.7", "dppo.fixed_size_design=sorted"],
    "posterior-dense-ess48": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5", "dppo.dense_prompts=true",
                              "dppo.completion_prune_rate=0.75", "dppo.completion_target_ess=48",
                              "dppo.fixed_size_design=sorted"],
    "posterior-dense-rate0.3": ["dppo.prompt_scheme=posterior", "dppo.prompt_prune_rate=0.5",
                                "dppo.dense_prompts=true", "dppo.completion_prune_rate=0.3",
                                "dppo.fixed_size_design=sorted"],
}
BASELINES = ("grpo", "grpo_skip")


def run_bench(preset: str, seed: int, methods: list[str], output: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "dppo_core.tools.cli", "bench", "--preset", preset, "--seeds", str(seed),
           "--methods", *methods, "--output-dir", str(output), "--resume", *overrides]
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=os.environ.copy())


def per_step(run_dir: Path) -> dict[str, float]:
    """Means over a run's steps of what its metrics.jsonl logs (seconds, tokens, ESS)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_time" in r]

    def mean(*keys: str) -> float | None:
        for k in keys:
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            if vals:
                return statistics.fmean(vals)
        return None

    return {"step_s": mean("step_time"), "tokens_trained": mean("tokens_trained"),
            "tokens_generated": mean("tokens_generated"), "weight_ess": mean("weight_ess"),
            "prompts_rolled_out": mean("prompts_rolled_out"), "prompts_candidates": mean("prompts_candidates"),
            "zero_std_groups": mean("zero_std_groups"), "grad_norm": mean("grad_norm")}


def worst_gap(runs: list[dict], method: str, baseline: str = "grpo_skip", points: int = 16) -> float | None:
    """The lowest accuracy difference method - baseline at equal training time, over t from a quarter of the
    baseline's run to its end (each seed's curves interpolated; the mean over seeds at each t)."""
    by = {(r["method"], r["seed"]): r for r in runs}
    seeds = sorted(s for m, s in by if m == method and (baseline, s) in by)
    if not seeds:
        return None
    gaps = []
    for k in range(points + 1):
        diffs = []
        for s in seeds:
            t = by[(baseline, s)]["wall_s"] * (0.25 + 0.75 * k / points)
            ours, theirs = by[(method, s)]["curve"], by[(baseline, s)]["curve"]
            diffs.append(accuracy_at_time(ours, t) - accuracy_at_time(theirs, t))
        gaps.append(statistics.fmean(diffs))
    return min(gaps)


def collect(output: Path, variants: list[str], seeds: list[int]) -> dict:
    table = {}
    for name in variants:
        bench = output / name / "bench.json"
        if not bench.exists():
            continue
        data = json.loads(bench.read_text())
        m = data["methods"]["dppo"]
        steps = [per_step(output / name / "runs" / "dppo" / f"seed-{s}") for s in seeds
                 if (output / name / "runs" / "dppo" / f"seed-{s}" / "metrics.jsonl").exists()]
        row = {"overrides": VARIANTS.get(name, []),
               "mean_accuracy": score(m["curve"]),
               "final_accuracy": m["accuracy"]["after"], "wall_s": m["wall_s"], "ess_per_step": m.get("ess_per_step"),
               "tokens": m["tokens"], "time_to_target_s": m.get("time_to_target_s"),
               "reached": m.get("time_to_target_reached"),
               "worst_gap_vs_grpo_skip": worst_gap(data["runs"], "dppo")}
        for key in steps[0] if steps else {}:
            vals = [s[key] for s in steps if s[key] is not None]
            row[key] = statistics.fmean(vals) if vals else None
        for ref in BASELINES:
            iv = (data.get("speedup_intervals") or {}).get(ref, {}).get("dppo", {}).get("time_to_target")
            row[f"time_to_target_vs_{ref}"] = None if iv is None else iv["mean"]
            st = (data.get("speedup_intervals") or {}).get(ref, {}).get("dppo", {}).get("step_time")
            row[f"step_time_vs_{ref}"] = None if st is None else st["mean"]
        table[name] = row
    first = output / variants[0] / "bench.json"
    base = json.loads(first.read_text()) if first.exists() else None
    refs = {}
    if base:
        for ref in BASELINES:
            r = base["methods"][ref]
            refs[ref] = {"mean_accuracy": score(r["curve"]),
                         "final_accuracy": r["accuracy"]["after"], "wall_s": r["wall_s"],
                         "ess_per_step": r.get("ess_per_step"), "time_to_target_s": r.get("time_to_target_s")}
    return {"variants": table, "baselines": refs}


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def write(output: Path, args, result: dict, command: str, note: str | None = None) -> None:
    report = {"command": command, **({"note": note} if note else {}), "preset": args.preset, "seeds": args.seeds,
              **result}
    (output / "ablation.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# DPPO ablation on {args.preset}, seeds {', '.join(map(str, args.seeds))}", "",
             f"Command: `{command}`", "", *([note, ""] if note else []),
             "Per variant (overrides of the paper's configuration, `BASE` in the script): mean held-out accuracy "
             "over the evaluations after "
             "step 0 (learning per step; the baselines' in the last rows), training seconds, Kish effective sample "
             "size and prompts rolled out per step, time to the target against grpo_skip and grpo (per-seed "
             "ratios, mean), and the worst accuracy difference to grpo_skip at equal training time from a quarter of "
             "grpo_skip's run to its end (negative: behind at some budget). One seed: an evaluation point's "
             "standard error is about 0.017, so differences in mean "
             "accuracy under about 0.02 are within noise; time-to-target ratios on one seed are noisier still.", "",
             "| variant | mean acc. | final | train s | ESS/step | prompts/step | all-equal groups | "
             "step speedup vs grpo_skip | time to target vs grpo_skip | vs grpo | worst gap at equal time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["variants"].items():
        lines.append(f"| {name} | {fmt(r['mean_accuracy'])} | {fmt(r['final_accuracy'])} | {fmt(r['wall_s'], '.0f')} | "
                     f"{fmt(r['ess_per_step'], '.1f')} | {fmt(r.get('prompts_rolled_out'), '.1f')} | "
                     f"{fmt(r.get('zero_std_groups'), '.2f')} | "
                     f"{fmt(r['step_time_vs_grpo_skip'], '.2f')}x | {fmt(r['time_to_target_vs_grpo_skip'], '.2f')}x | "
                     f"{fmt(r['time_to_target_vs_grpo'], '.2f')}x | {fmt(r['worst_gap_vs_grpo_skip'], '+.3f')} |")
    for ref, r in result["baselines"].items():
        lines.append(f"| ({ref}) | {fmt(r['mean_accuracy'])} | {fmt(r['final_accuracy'])} | "
                     f"{fmt(r['wall_s'], '.0f')} | "
                     f"{fmt(r['ess_per_step'], '.1f')} | | | | | | |")
    lines += ["", "Overrides:", ""]
    lines += [f"- `{n}`: `{' '.join(VARIANTS.get(n, [])) or '(none)'}`" for n in result["variants"]]
    (output / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/ablation"))
    parser.add_argument("--preset", default="cpu-baselines")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--summarize", action="store_true")
    args = parser.parse_args()
    command = "python benchmarks/ablate_dppo.py " + shlex.join(sys.argv[1:])
    previous = args.output / "ablation.json"
    note = None
    if args.summarize and previous.exists():  # keep what the runs were made with, and what was said of them
        command = json.loads(previous.read_text())["command"]
        note = json.loads(previous.read_text()).get("note")
    args.output.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        for seed in args.seeds:
            run_bench(args.preset, seed, list(BASELINES), args.output / "baselines", [])
            for name in args.variants:
                for ref in BASELINES:  # the same baseline runs in every variant's comparison
                    src = args.output / "baselines" / "runs" / ref / f"seed-{seed}"
                    dst = args.output / name / "runs" / ref / f"seed-{seed}"
                    if not dst.exists():
                        shutil.copytree(src, dst)
                run_bench(args.preset, seed, ["grpo", "grpo_skip", "dppo"], args.output / name, BASE + VARIANTS[name])
    write(args.output, args, collect(args.output, args.variants, args.seeds), command, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
