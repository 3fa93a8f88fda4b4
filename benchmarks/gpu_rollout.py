"""Rollout time of the transformers engine on a GPU: our compact decode loop against transformers ``generate``.

Made with (from the repository root, on a CUDA GPU; about 2 minutes):

    python benchmarks/gpu_rollout.py --output benchmarks/results/gpu/rollout

``HFRollout(decode="compact")`` (finished sequences leave the batch and the KV cache; the default) and
``HFRollout(decode="generate")`` (transformers ``generate``, the reference; same samples for the same seed)
each sample ``--max-tokens`` new tokens at temperature 1 for ``B`` arithmetic prompts x 8 completions, B x 8 in
``--batch-sizes``, on Qwen3-1.7B's layers with random weights in bf16 (``--shape``). Random weights rarely
emit the end token, so nearly every completion runs to ``--max-tokens``: this times the decode step, not
early stopping. Calls alternate between the engines after one untimed call each; the median is reported,
with generated tokens per second and milliseconds per decode step (the call's time over its longest
completion). This is the fallback engine of a GPU without vLLM; vLLM (``rollout_engine: vllm``) is what a
GPU run should use.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from dppo_core.rollout import HFRollout, SamplingConfig
from dppo_core.shapes import SHAPES, build_shaped_model
from dppo_core.tasks import ArithmeticTask


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/gpu/rollout"))
    parser.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256], help="sequences per call")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda" and args.shape != "tiny":
        parser.error("no CUDA device: run with --shape tiny (a smoke test) or on a GPU")
    path = build_shaped_model(args.shape, args.cache_dir, dtype=str(dtype).removeprefix("torch."))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    engines = {d: HFRollout(model, tokenizer, decode=d) for d in ("compact", "generate")}
    task = ArithmeticTask((2, 3, 4, 5))
    rows = []
    for b in args.batch_sizes:
        prompts = [p.messages() for p in task.sample_train(random.Random(b), b // args.num_generations)]
        times: dict[str, list[float]] = {d: [] for d in engines}
        meta: dict[str, dict] = {}
        for rep in range(args.repeats + 1):
            for name, engine in engines.items():
                sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, seed=rep)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                batch = engine.generate(prompts, args.num_generations, sampling)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t
                comps = [c for g in batch.groups for c in g.completions]
                meta[name] = {"tokens": sum(len(c.token_ids) for c in comps),
                              "longest": max(len(c.token_ids) for c in comps)}
                if rep:
                    times[name].append(dt)
                print(f"batch {b} {name} call {rep}{' (untimed)' if rep == 0 else ''}: {dt:.2f} s, "
                      f"{meta[name]['tokens']} tokens", flush=True)
        for name in engines:
            med = statistics.median(times[name])
            rows.append({"engine": f"hf-{name}", "batch_size": b, "seconds_median": med,
                         "seconds": times[name], **meta[name], "tokens_per_s_median": meta[name]["tokens"] / med,
                         "ms_per_decode_step": 1000 * med / meta[name]["longest"]})
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"command": "python benchmarks/gpu_rollout.py " + shlex.join(sys.argv[1:]), "device": gpu,
              "torch": torch.__version__, "dtype": str(dtype), "shape": args.shape, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "rows": rows}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "rollout.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Transformers rollouts on {gpu}: compact loop against generate", "",
             f"Command: `{report['command']}`  ",
             f"torch {torch.__version__}, {dtype}, Qwen3 shape {args.shape!r} with random weights; "
             f"{args.max_tokens} new tokens at most, temperature 1; median of {args.repeats} calls.", "",
             "| engine | sequences | seconds (median) | tokens | tokens/s | ms per decode step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['batch_size']} | {r['seconds_median']:.2f} | {r['tokens']} | "
                     f"{r['tokens_per_s_median']:.0f} | {r['ms_per_decode_step']:.1f} |")
    (args.output / "rollout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
