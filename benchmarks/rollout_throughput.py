"""Rollout throughput, transformers ``generate`` vs vLLM (in-process), on the tiny model and a ~25M one.

Made with (from the repository root; about 10 minutes on 2 otherwise idle CPU cores):

    DPPO_CACHE_DIR=.cache/dppo VLLM_LOGGING_LEVEL=WARNING \\
        .venv/bin/python benchmarks/rollout_throughput.py --output benchmarks/results/rollout_throughput.json

Workload per run: ``--prompts`` task prompts x ``--num-generations`` samples each, at most ``--max-tokens``
new tokens, temperature 1, one ``generate`` call (what one GRPO step asks for). Throughput is generated
tokens (stop tokens included) per wall-clock second of that call. Each (model, engine) measurement runs
in a fresh subprocess (vLLM pins CPU threads for the whole process, which would skew a later transformers
run): one warm-up call, then ``--repeats`` timed calls with different seeds. ``--rounds`` rounds cycle
through all pairs, so a change in machine load hits every pair alike; the median over all timed calls
is reported. Also measured: engine start time and full-weight sync time (``VLLMRollout.sync``).

Both models are built locally like the embedded one (untrained weights, so completions are random text
and rarely stop early: the workload is close to prompts x G x max_tokens). Machine load is recorded
before and after, since the development machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

MODELS = {
    # the embedded default, ~2.3M parameters
    "tiny": {},
    # same recipe, ~25M parameters: 8 layers of width 512, GQA 8 query / 2 key-value heads
    "25M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64),
}


def worker(model_name: str, engine_name: str, args: argparse.Namespace) -> dict:
    """One (model, engine) measurement; runs in its own process."""
    if engine_name == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    from dppo_core.models import TinyModelConfig, build_tiny_model, count_parameters, load_model
    from dppo_core.rollout import HFRollout, SamplingConfig, VLLMRollout
    from dppo_core.tasks import ArithmeticTask

    config = TinyModelConfig(**MODELS[model_name])
    path = build_tiny_model(config, args.cache_dir)
    model, tokenizer = load_model(path)
    prompts = [p.messages() for p in ArithmeticTask().test_set(args.prompts)[: args.prompts]]
    t0 = time.perf_counter()
    if engine_name == "hf":
        engine = HFRollout(model, tokenizer)
    else:
        engine = VLLMRollout(path, tokenizer)
    start_s = time.perf_counter() - t0

    def run(seed: int) -> tuple[float, int]:
        s = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, seed=seed)
        t = time.perf_counter()
        batch = engine.generate(prompts, args.num_generations, s)
        return time.perf_counter() - t, batch.num_generated_tokens

    run(seed=1000)  # warm-up
    runs = [run(seed=i) for i in range(args.repeats)]
    tps = [n / s for s, n in runs]
    result = {
        "model": model_name,
        "engine": engine_name,
        "parameters": count_parameters(model),
        "model_config": asdict(config),
        "start_s": round(start_s, 2),
        "runs": [{"seconds": round(s, 3), "tokens": n, "tokens_per_s": round(n / s, 1)} for s, n in runs],
        "tokens_per_s_median": round(statistics.median(tps), 1),
        "torch_threads": torch.get_num_threads(),
    }
    if engine_name == "vllm":
        sync_s = []
        for _ in range(3):
            t = time.perf_counter()
            engine.sync(model)
            sync_s.append(time.perf_counter() - t)
        result["full_sync_s_median"] = round(statistics.median(sync_s), 4)
    return result


def write_markdown(report: dict, path: Path) -> None:
    """The results as a Markdown table, next to the JSON."""
    lines = ["# Rollout throughput: transformers `generate` vs vLLM (in-process, CPU)", "",
             f"Command: `{report['command']}`", "",
             f"Workload: {report['workload']['prompts']} prompts x {report['workload']['num_generations']} samples, "
             f"at most {report['workload']['max_tokens']} new tokens, temperature 1; "
             f"{report['workload']['statistic']}.", "",
             "| model | parameters | engine | tokens/s (median) | min - max | start (s) | full sync (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        sync = r.get("full_sync_s_median")
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['engine']} | "
                     f"{r['tokens_per_s_median']:.0f} | "
                     f"{r['tokens_per_s_min']:.0f} - {r['tokens_per_s_max']:.0f} | {r['start_s_median']:.1f} | "
                     f"{'' if sync is None else f'{sync:.3f}'} |")
    m = report["machine"]
    lines += ["", f"vLLM / transformers speed-up: {report['speedup_vllm_over_hf']}.", "",
              f"Machine: {m['cpus']} CPUs, torch {m['torch']}, vLLM {m['vllm']}; 1-minute load average "
              f"{m['loadavg_before'][0]} before, {m['loadavg_after'][0]} after."]
    if report.get("note"):
        lines += ["", report["note"]]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/rollout_throughput.json"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per worker process")
    parser.add_argument("--rounds", type=int, default=3, help="worker processes per (model, engine) pair")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args)), flush=True)
        return 0

    passthrough = ["--prompts", str(args.prompts), "--num-generations", str(args.num_generations),
                   "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    if args.cache_dir:
        passthrough += ["--cache-dir", str(args.cache_dir)]
    load_before = os.getloadavg()
    per_pair: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):  # rounds interleave the pairs, so load changes hit all of them alike
        for model_name in args.models:
            for engine_name in args.engines:
                print(f"round {round_ + 1}/{args.rounds}: {model_name} / {engine_name} ...", flush=True)
                proc = subprocess.run([sys.executable, __file__, "--worker", model_name, engine_name, *passthrough],
                                      capture_output=True, text=True, check=False)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"worker {model_name}/{engine_name} failed (exit {proc.returncode})")
                r = json.loads(lines[-1][len("RESULT "):])
                r["loadavg_1min"] = round(os.getloadavg()[0], 2)
                print(f"    {r['tokens_per_s_median']:.0f} tokens/s ({r['parameters'] / 1e6:.1f}M parameters, "
                      f"load {r['loadavg_1min']})", flush=True)
                per_pair.setdefault((model_name, engine_name), []).append(r)

    results = []
    for (_, engine_name), rs in per_pair.items():
        runs = [run for r in rs for run in r["runs"]]
        merged = {k: v for k, v in rs[0].items() if k not in ("runs", "tokens_per_s_median", "start_s",
                                                               "full_sync_s_median", "loadavg_1min")}
        merged.update(
            tokens_per_s_median=round(statistics.median(run["tokens_per_s"] for run in runs), 1),
            tokens_per_s_min=min(run["tokens_per_s"] for run in runs),
            tokens_per_s_max=max(run["tokens_per_s"] for run in runs),
            start_s_median=round(statistics.median(r["start_s"] for r in rs), 2),
            runs=runs,
            loadavg_1min_per_round=[r["loadavg_1min"] for r in rs],
        )
        if engine_name == "vllm":
            merged["full_sync_s_median"] = round(statistics.median(r["full_sync_s_median"] for r in rs), 4)
        results.append(merged)

    speedups = {}
    for m in args.models:
        by = {r["engine"]: r for r in results if r["model"] == m}
        if "hf" in by and "vllm" in by:
            speedups[m] = round(by["vllm"]["tokens_per_s_median"] / by["hf"]["tokens_per_s_median"], 2)

    import torch
    import vllm

    report = {
        "command": "DPPO_CACHE_DIR=.cache/dppo VLLM_LOGGING_LEVEL=WARNING .venv/bin/python "
                   "benchmarks/rollout_throughput.py " + " ".join(a for a in sys.argv[1:]),
        "workload": {"prompts": args.prompts, "num_generations": args.num_generations,
                     "max_tokens": args.max_tokens, "temperature": 1.0, "repeats": args.repeats,
                     "rounds": args.rounds,
                     "statistic": "median over rounds x repeats timed calls, each process after one warm-up call"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "vllm": vllm.__version__,
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "results": results,
        "speedup_vllm_over_hf": speedups,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if max(m for r in results for m in r["loadavg_1min_per_round"]) > (os.cpu_count() or 1):  # ours adds ~1
        report["note"] = ("The machine was shared with other jobs during this run (1-minute load average above "
                          "the core count, see loadavg_1min_per_round): single calls varied several-fold, so "
                          "read the medians as rough; rerun on an idle machine for firm numbers.")
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, args.output.with_suffix(".md"))
    print(json.dumps(speedups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
