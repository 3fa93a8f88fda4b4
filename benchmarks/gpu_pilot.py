"""What a pilot's second engine call costs: one call of G completions per prompt against a pilot of k per prompt and
a second call of G - k for a share of the prompts (the continued groups), on the transformers engine.

Made with (from the repository root; about 2 minutes on a CUDA GPU, seconds on a CPU with ``--shape tiny``):

    python benchmarks/gpu_pilot.py --output benchmarks/results/gpu/DIR/pilot

``HFRollout`` samples at temperature 1 from a Qwen3-shaped model with random weights (``--shape``; bf16 on a GPU),
which rarely emits its end token, so nearly every completion runs to ``--max-tokens``: each call costs its decode
steps, the case where a second call costs most. For each continued share f in ``--shares``: one call of
``--prompts`` x G (``full``), against a call of ``--prompts`` x k then one of round(f x prompts) x (G - k)
(``pilot``); calls alternate after one untimed call each, and the median of ``--repeats`` is reported with the
tokens generated. Where the time follows the tokens (a CPU, a large batch), the pilot saves what its tokens save;
where it follows the decode steps (a GPU engine at a batch far below its capacity), the second call costs about as
much as the first and the pilot cannot save time, only tokens.
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


def timed(engine: HFRollout, prompts: list, n: int, max_tokens: int, seed: int, device: torch.device
          ) -> tuple[float, int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    batch = engine.generate(prompts, n, SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=seed))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t, batch.num_generated_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--pilot-size", type=int, default=2)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda" and args.shape != "tiny":
        parser.error("no CUDA device: run with --shape tiny (a smoke test) or on a GPU")
    path = build_shaped_model(args.shape, None, dtype=str(dtype).removeprefix("torch."))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    engine = HFRollout(model, tokenizer)
    prompts = [p.messages() for p in ArithmeticTask((2, 3, 4, 5)).sample_train(random.Random(0), args.prompts)]
    g, k = args.num_generations, args.pilot_size
    rows = []
    for share in args.shares:
        rest = prompts[: round(share * len(prompts))]
        full_s, pilot_s, tokens = [], [], {}
        for rep in range(args.repeats + 1):
            f, tokens["full"] = timed(engine, prompts, g, args.max_tokens, rep, device)
            p1, t1 = timed(engine, prompts, k, args.max_tokens, rep, device)
            p2, t2 = timed(engine, rest, g - k, args.max_tokens, rep + 1000, device) if rest else (0.0, 0)
            tokens["pilot"] = t1 + t2
            print(f"continued {share:.2f} call {rep}{' (untimed)' if rep == 0 else ''}: full {f:.2f} s, pilot "
                  f"{p1:.2f} + {p2:.2f} s", flush=True)
            if rep:
                full_s.append(f)
                pilot_s.append(p1 + p2)
        full, pilot = statistics.median(full_s), statistics.median(pilot_s)
        rows.append({"continued_share": share, "full_s": full, "pilot_s": pilot, "time_ratio": pilot / full,
                     "full_tokens": tokens["full"], "pilot_tokens": tokens["pilot"],
                     "token_ratio": tokens["pilot"] / tokens["full"], "full_s_all": full_s, "pilot_s_all": pilot_s})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"command": "python benchmarks/gpu_pilot.py " + shlex.join(sys.argv[1:]), "device": name,
              "torch": torch.__version__, "dtype": str(dtype), "shape": args.shape, "prompts": args.prompts,
              "num_generations": g, "pilot_size": k, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "rows": rows}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "pilot.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# A pilot's two engine calls against one, transformers engine on {name}", "",
             f"Command: `{report['command']}`  ",
             f"torch {torch.__version__}, {dtype}, Qwen3 shape {args.shape!r} with random weights; {args.prompts} "
             f"prompts, G = {g}, pilot k = {k}, {args.max_tokens} new tokens at most; median of {args.repeats}.", "",
             "| continued share | one call (s) | pilot + rest (s) | time ratio | tokens ratio |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['continued_share']:.2f} | {r['full_s']:.2f} | {r['pilot_s']:.2f} | {r['time_ratio']:.2f} | "
                     f"{r['token_ratio']:.2f} |")
    (args.output / "pilot.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
