"""Rollout throughput on CPU: the three engines across batch sizes and completion-length spreads.

Made with (from the repository root; about 10-16 minutes on 2 otherwise idle CPU cores):

    DPPO_CACHE_DIR=.cache/dppo VLLM_LOGGING_LEVEL=WARNING \\
        .venv/bin/python benchmarks/rollout_throughput.py --output benchmarks/results/rollout_throughput.json

Engines:

- ``hf``: :class:`~dppo_core.rollout.HFRollout`'s default compact loop (a finished sequence leaves the
  batch and the KV cache at once), whose decode steps run the lean step (:mod:`dppo_core.engines.lean_decode`).
- ``hf-forward``: the same loop with ``lean=False``: every decode step is a call of the model's forward
  (the same samples, bit for bit on CPU in fp32).
- ``hf-generate``: the same engine with ``decode="generate"`` (transformers ``generate``: every row is
  computed until the batch's longest completion ends). It gives the same samples as ``hf``.
- ``vllm``: :class:`~dppo_core.engines.vllm.VLLMRollout`, in-process, fp32, eager.

Workloads (``--spreads``), both on the embedded tiny model's architecture (2.3M parameters), temperature 1,
at most ``--max-tokens`` new tokens, ``batch_size / 8`` prompts x 8 samples in one ``generate`` call (what one
GRPO step asks for, ``batch_size`` is in sequences):

- ``train``: the warm-started model on training prompts of levels 2-5 (the cpu-full bench's setting):
  completions stop where the model ends its answer, from a few tokens to ``max_tokens``, so a static batch
  pads a lot.
- ``full``: the untrained model, whose completions rarely stop early (a random model seldom samples the end
  token): nearly every sequence runs ``max_tokens``, little spread.

Throughput is generated tokens (stop tokens included) per wall-clock second of the call. Each (spread,
engine) measurement runs in a fresh subprocess (vLLM pins CPU threads for the whole process): one warm-up
call per batch size, then ``--repeats`` timed calls with different seeds; ``--rounds`` rounds cycle through
all pairs, so a change in machine load hits every pair alike. Reported per (spread, engine, batch size): the
median over rounds x repeats, and per engine how much its time per token varies across batch sizes and
spreads (max / min of the medians), and a cost model: each call's seconds fitted as a fixed cost per decode step
plus a cost per generated token, with the fixed cost that a 15% variation would allow (``--summarize``
recomputes it from a result file's runs). Machine load is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("hf", "hf-forward", "hf-generate", "vllm")
SPREADS = ("train", "full")
NUM_GENERATIONS = 8
#: the Makefile's variables that pin the CPU's floating-point kernels (recorded, not set, here)
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def worker(spread: str, engine_name: str, args: argparse.Namespace) -> dict:
    """One (spread, engine) measurement over every batch size; runs in its own process."""
    if engine_name == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    from dppo_core.models import TinyModelConfig, build_tiny_model, load_model
    from dppo_core.rollout import HFRollout, SamplingConfig
    from dppo_core.tasks import ArithmeticTask
    from dppo_core.warm_start import WarmStartConfig, warm_start

    if spread == "train":
        path = warm_start(WarmStartConfig(), cache_dir=args.cache_dir)
    else:
        path = build_tiny_model(TinyModelConfig(), args.cache_dir)
    model, tokenizer = load_model(path)
    task = ArithmeticTask(levels=[2, 3, 4, 5])
    problems = task.sample_train(random.Random(0), max(args.batch_sizes) // NUM_GENERATIONS)
    prompts = [p.messages() for p in problems]
    t0 = time.perf_counter()
    if engine_name == "vllm":
        from dppo_core.engines.vllm import VLLMRollout

        engine = VLLMRollout(path, tokenizer)
    else:
        engine = HFRollout(model, tokenizer, decode="generate" if engine_name == "hf-generate" else "compact",
                           lean=engine_name == "hf")
    start_s = time.perf_counter() - t0

    def run(batch_size: int, seed: int) -> dict:
        s = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, seed=seed)
        t = time.perf_counter()
        batch = engine.generate(prompts[: batch_size // NUM_GENERATIONS], NUM_GENERATIONS, s)
        seconds = time.perf_counter() - t
        lengths = [n for group in batch.lengths() for n in group]
        return {"seconds": round(seconds, 4), "tokens": batch.num_generated_tokens,
                "tokens_per_s": round(batch.num_generated_tokens / seconds, 1),
                "mean_length": round(statistics.mean(lengths), 2), "max_length": max(lengths)}

    rows = []
    for batch_size in args.batch_sizes:
        run(batch_size, seed=1000)  # warm-up at this shape
        runs = [run(batch_size, seed=i) for i in range(args.repeats)]
        rows.append({"spread": spread, "engine": engine_name, "batch_size": batch_size, "runs": runs})
    return {"start_s": round(start_s, 2), "torch_threads": torch.get_num_threads(), "rows": rows}


def summarize(per_pair: dict[tuple[str, str], list[dict]]) -> tuple[list[dict], dict]:
    """Rows of medians per (spread, engine, batch size), and per engine the spread of its time per token."""
    results = []
    for (spread, engine_name), workers in per_pair.items():
        for i, first in enumerate(workers[0]["rows"]):
            runs = [run for w in workers for run in w["rows"][i]["runs"]]
            tps = [run["tokens_per_s"] for run in runs]
            median = statistics.median(tps)
            results.append({
                "spread": spread, "engine": engine_name, "batch_size": first["batch_size"],
                "tokens_per_s_median": round(median, 1), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                "us_per_token_median": round(1e6 / median, 1),
                "mean_length": round(statistics.mean(run["mean_length"] for run in runs), 1),
                "max_length_mean": round(statistics.mean(run["max_length"] for run in runs), 1),
                "start_s_median": round(statistics.median(w["start_s"] for w in workers), 2),
                "runs": runs,
            })
    variation = {}
    for engine_name in sorted({r["engine"] for r in results}):
        times = {(r["spread"], r["batch_size"]): r["us_per_token_median"]
                 for r in results if r["engine"] == engine_name}
        by_spread = {s: [t for (sp, _), t in times.items() if sp == s] for s in {sp for sp, _ in times}}
        by_batch = {b: [t for (_, bs), t in times.items() if bs == b] for b in {bs for _, bs in times}}
        variation[engine_name] = {
            # max / min of the median time per generated token over all (spread, batch size) cells
            "all": round(max(times.values()) / min(times.values()), 3),
            "across_batch_sizes": {s: round(max(v) / min(v), 3) for s, v in sorted(by_spread.items())},
            "across_spreads": {str(b): round(max(v) / min(v), 3) for b, v in sorted(by_batch.items())},
        }
    return results, variation


def cost_model(results: list[dict]) -> dict:
    """Per engine, a least-squares fit of each call's seconds = f x decode steps + c x generated tokens (steps:
    the call's longest completion), and the largest fixed cost per step f for which the fitted time per token,
    c + f x steps / tokens, would vary by at most 15% over the measured cells (at the fitted c)."""
    import numpy as np

    model = {}
    # generate computes every row until the longest completion ends: its cost does not follow the tokens
    for engine_name in sorted({r["engine"] for r in results} - {"hf-generate"}):
        rows = [r for r in results if r["engine"] == engine_name]
        runs = [run for r in rows for run in r["runs"]]
        x = np.array([[run["max_length"], run["tokens"]] for run in runs], dtype=float)
        y = np.array([run["seconds"] for run in runs])
        (fixed, per_token), *_ = np.linalg.lstsq(x, y, rcond=None)
        r2 = 1 - ((y - x @ np.array([fixed, per_token])) ** 2).sum() / ((y - y.mean()) ** 2).sum()
        steps_per_token = {}
        for r in rows:
            steps_per_token.setdefault(r["spread"], []).append(
                statistics.mean(run["max_length"] for run in r["runs"]) / statistics.mean(
                    run["tokens"] for run in r["runs"]))

        # (c + f hi) <= 1.15 (c + f lo)  <=>  f <= 0.15 c / (hi - 1.15 lo), hi and lo the extreme steps per token;
        # None where hi <= 1.15 lo: any fixed cost keeps the variation within 15%
        needed = {s: (round(float(0.15 * per_token / (max(v) - 1.15 * min(v))), 6)
                      if max(v) > 1.15 * min(v) else None) for s, v in sorted(steps_per_token.items())}
        model[engine_name] = {
            "fixed_s_per_step": round(float(fixed), 6), "s_per_token": round(float(per_token), 8),
            "r2": round(float(r2), 3), "fixed_s_per_step_for_1_15": needed,
        }
    return model


def write_markdown(report: dict, path: Path) -> None:
    """The results as Markdown tables, next to the JSON."""
    w = report["workload"]
    lines = ["# Rollout throughput on CPU: compact transformers loop (lean step and forward), transformers "
             "`generate`, vLLM", "",
             f"Command: `{report['command']}`", "",
             f"Workload: batch size / {NUM_GENERATIONS} prompts x {NUM_GENERATIONS} samples in one call, at most "
             f"{w['max_tokens']} new tokens, temperature 1; {w['statistic']}. `train`: the warm-started tiny "
             "model on training prompts of levels 2-5 (completions stop where the answer ends); `full`: the "
             "untrained tiny model (completions rarely stop early).", "",
             "| spread | engine | batch size | tokens/s (median) | min - max | µs per token (of the median) "
             "| mean / longest length |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(report["results"], key=lambda r: (r["spread"], ENGINES.index(r["engine"]), r["batch_size"])):
        lines.append(f"| {r['spread']} | {r['engine']} | {r['batch_size']} | {r['tokens_per_s_median']:.0f} | "
                     f"{r['tokens_per_s_min']:.0f} - {r['tokens_per_s_max']:.0f} | {r['us_per_token_median']:.0f} | "
                     f"{r['mean_length']:.1f} / {r['max_length_mean']:.1f} |")
    lines += ["", "Time per generated token, max / min of the medians (1.15 would be a 15% variation):", "",
              "| engine | over every cell | across batch sizes, per spread | across spreads, per batch size |",
              "|---|---|---|---|"]
    for engine_name, v in report["time_per_token_variation"].items():
        lines.append(f"| {engine_name} | {v['all']:.2f} | "
                     + ", ".join(f"{s}: {x:.2f}" for s, x in v["across_batch_sizes"].items()) + " | "
                     + ", ".join(f"{b}: {x:.2f}" for b, x in v["across_spreads"].items()) + " |")
    if report.get("cost_model"):
        lines += ["", "Cost model, per engine (not `generate`, which computes every row to the longest completion): "
                  "each call's seconds fitted as f x decode steps (its longest completion) + c x generated tokens "
                  "(least squares over every timed call), and the largest f at which the fitted time per token "
                  "would vary by at most 15% across batch sizes, per spread:", "",
                  "| engine | f, ms per decode step | c, µs per token | R² | f for at most 15% |",
                  "|---|---|---|---|---|"]
        for engine_name, m in report["cost_model"].items():
            need = ", ".join(f"{s}: {v * 1e3:.2f} ms" if v is not None else f"{s}: any"
                             for s, v in m["fixed_s_per_step_for_1_15"].items())
            lines.append(f"| {engine_name} | {m['fixed_s_per_step'] * 1e3:.2f} | {m['s_per_token'] * 1e6:.1f} | "
                         f"{m['r2']:.3f} | {need} |")
    for key, title in (("speedup_hf_over_generate", "Speed-up of the compact loop over `generate`"),
                       ("speedup_lean", "Speed-up of the lean decode step over the model's forward in the same loop"),
                       ("speedup_vllm_over_hf", "vLLM over the compact loop")):
        if report.get(key):
            lines += ["", f"{title} (median tokens/s, spread/batch size): "
                      + ", ".join(f"{k}: {v:.2f}" for k, v in report[key].items()) + "."]
    m = report["machine"]
    lines += ["", f"Machine: {m['cpus']} CPUs, torch {m['torch']}, vLLM {m['vllm']}; 1-minute load average "
              f"{m['loadavg_before'][0]} before, {m['loadavg_after'][0]} after; kernel variables "
              f"{m['kernel_variables']}."]
    if report.get("note"):
        lines += ["", report["note"]]
    path.write_text("\n".join(lines) + "\n")


def speedups(results: list[dict], faster: str, slower: str) -> dict[str, float]:
    by = {(r["spread"], r["engine"], r["batch_size"]): r["tokens_per_s_median"] for r in results}
    return {f"{s}/{b}": round(by[(s, faster, b)] / by[(s, slower, b)], 2)
            for (s, e, b) in sorted(by) if e == faster and (s, slower, b) in by}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/rollout_throughput.json"))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--spreads", nargs="+", default=list(SPREADS), choices=SPREADS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 64, 128, 256],
                        help=f"sequences per call, multiples of {NUM_GENERATIONS}")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per batch size per worker process")
    parser.add_argument("--rounds", type=int, default=3, help="worker processes per (spread, engine) pair")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--summarize", action="store_true",
                        help="only recompute the cost model and the Markdown from the runs in --output")
    parser.add_argument("--worker", nargs=2, metavar=("SPREAD", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(b < NUM_GENERATIONS or b % NUM_GENERATIONS for b in args.batch_sizes):
        parser.error(f"--batch-sizes must be multiples of {NUM_GENERATIONS} (prompts x {NUM_GENERATIONS} samples), "
                     f"got {args.batch_sizes}")

    if args.summarize:  # the cost model and the Markdown again, from the runs already in --output
        report = json.loads(args.output.read_text())
        report["cost_model"] = cost_model(report["results"])
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        write_markdown(report, args.output.with_suffix(".md"))
        return 0
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args)), flush=True)
        return 0

    passthrough = ["--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
                   "--batch-sizes", *map(str, args.batch_sizes)]
    if args.cache_dir:
        passthrough += ["--cache-dir", str(args.cache_dir)]
    load_before = os.getloadavg()
    per_pair: dict[tuple[str, str], list[dict]] = {}
    loads = []
    for round_ in range(args.rounds):  # rounds interleave the pairs, so load changes hit all of them alike
        for spread in args.spreads:
            for engine_name in args.engines:
                print(f"round {round_ + 1}/{args.rounds}: {spread} / {engine_name} ...", flush=True)
                proc = subprocess.run([sys.executable, __file__, "--worker", spread, engine_name, *passthrough],
                                      capture_output=True, text=True, check=False)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"worker {spread}/{engine_name} failed (exit {proc.returncode})")
                r = json.loads(lines[-1][len("RESULT "):])
                loads.append(round(os.getloadavg()[0], 2))
                medians = [f"{row['batch_size']}: {statistics.median(x['tokens_per_s'] for x in row['runs']):.0f}"
                           for row in r["rows"]]
                print("    " + ", ".join(medians) + f" tokens/s (load {loads[-1]})", flush=True)
                per_pair.setdefault((spread, engine_name), []).append(r)

    results, variation = summarize(per_pair)
    import torch

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    report = {
        "command": "DPPO_CACHE_DIR=.cache/dppo VLLM_LOGGING_LEVEL=WARNING .venv/bin/python "
                   "benchmarks/rollout_throughput.py " + " ".join(a for a in sys.argv[1:]),
        "workload": {"batch_sizes": args.batch_sizes, "num_generations": NUM_GENERATIONS,
                     "max_tokens": args.max_tokens, "temperature": 1.0, "repeats": args.repeats,
                     "rounds": args.rounds, "spreads": args.spreads,
                     "statistic": "median over rounds x repeats timed calls, each after a warm-up call at its shape"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "vllm": vllm_version,
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()], "loadavg_1min_per_worker": loads,
                    "kernel_variables": {k: os.environ.get(k) for k in KERNEL_VARIABLES}},
        "results": results,
        "time_per_token_variation": variation,
        "cost_model": cost_model(results),
        "speedup_hf_over_generate": speedups(results, "hf", "hf-generate"),
        "speedup_vllm_over_hf": speedups(results, "vllm", "hf"),
        "speedup_lean": speedups(results, "hf", "hf-forward"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if max(loads) > (os.cpu_count() or 1):  # ours adds ~1
        report["note"] = ("The machine was shared with other jobs during this run (1-minute load average above "
                          "the core count, see loadavg_1min_per_worker): read the medians as rough; rerun on an "
                          "idle machine for firm numbers.")
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, args.output.with_suffix(".md"))
    print(json.dumps(report["time_per_token_variation"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
