"""Update-pass time on a GPU by layout and attention kernel, on Qwen3-1.7B's layers with MATH-like lengths.

Made with (from the repository root, on a CUDA GPU; about 2 minutes, the model's build included):

    python benchmarks/gpu_attention.py --output benchmarks/results/gpu/attention

The same pruned batch is trained (forward with gradients, the GRPO loss, backward; no optimizer step, so
every repeat does the same work) in each of these layouts:

    padded          the trainer's path without packing: sequences sorted by length, ``--micro-batch-size``
                    per micro-batch, right-padded (sdpa)
    packed-mask     packed rows of ``--row-tokens`` tokens, ``--rows-per-micro-batch`` per micro-batch, with
                    a block-diagonal mask (sdpa): attention over whole rows, R·T² scores
    packed-varlen   the same rows flattened, sequence boundaries given to PyTorch's variable-length flash
                    kernel (``attn_implementation="torch_varlen"``, :mod:`dppo_core.varlen`): Σ L² scores
    shared-mask     each prompt once per segment of its group (:mod:`dppo_core.shared_prefix`), packed into
                    the same rows, with its mask (sdpa)

Model: Qwen3-1.7B's layer shapes with random weights in bf16 (``--shape``;
:func:`dppo_core.shapes.build_shaped_model`), every parameter trained. Batch: ``--groups`` prompts x
``--num-generations`` completions of random tokens, prompt lengths uniform in ``--prompt-tokens`` and
completion lengths uniform in ``--completion-tokens`` (a MATH rollout's range at 1,024 new tokens), then a
seeded random ``--keep`` share kept with weight 1 / keep (what completion pruning leaves). Repeats run
round-robin over the layouts after one warm-up pass each; the median, min and max are reported with the
peak memory torch allocated. Each layout's loss and gradient are compared with the padded pass's (bf16: they
agree to rounding, not exactly).

With ``--shape tiny`` it runs on a CPU in float32 (a smoke test: ``packed-varlen`` is skipped there, the
kernel being CUDA-only).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing_update import grads_of, make_packed, make_padded, make_shared  # noqa: E402

from dppo_core import varlen  # noqa: E402
from dppo_core.packing import PackSequence  # noqa: E402
from dppo_core.shapes import SHAPES, build_shaped_model  # noqa: E402


def workload(vocab: int, args) -> tuple[list[PackSequence], torch.Tensor, int, dict]:
    """Random prompts and completions with the given length ranges; a random ``keep`` share kept."""
    rng = random.Random(args.seed)
    seqs, adv, total = [], [], 0
    for _ in range(args.groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_tokens))]
        group_adv = [rng.gauss(0.0, 1.0) for _ in range(args.num_generations)]
        for a in group_adv:
            total += 1
            completion = [rng.randrange(3, vocab) for _ in range(rng.randint(*args.completion_tokens))]
            if rng.random() < args.keep:
                seqs.append(PackSequence(prompt, completion, weight=1.0 / args.keep))
                adv.append(a)
    info = {"groups": args.groups, "num_generations": args.num_generations, "completions": total,
            "kept": len(seqs), "keep": args.keep, "prompt_tokens": list(args.prompt_tokens),
            "completion_tokens": list(args.completion_tokens),
            "real_tokens": sum(len(s) for s in seqs),
            "completion_tokens_kept": sum(len(s.completion_ids) for s in seqs)}
    return seqs, torch.tensor(adv), total, info


def load(path: Path, attention: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if attention == varlen.NAME:
        varlen.register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention).to(device)
    model.train(False)  # no dropout; gradients still flow
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/gpu/attention"))
    parser.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES))
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(60, 250))
    parser.add_argument("--completion-tokens", type=int, nargs=2, default=(30, 1024))
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="padded: sequences per micro-batch")
    parser.add_argument("--row-tokens", type=int, default=4096)
    parser.add_argument("--rows-per-micro-batch", type=int, default=2)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda" and args.shape != "tiny":
        parser.error("no CUDA device: run with --shape tiny (a smoke test) or on a GPU")
    model_dir = build_shaped_model(args.shape, args.cache_dir, dtype=str(dtype).removeprefix("torch."))
    sdpa = load(model_dir, "sdpa", device, dtype)
    pad_id = sdpa.config.pad_token_id or 0
    seqs, adv, total, info = workload(sdpa.get_input_embeddings().weight.shape[0], args)
    adv = adv.to(device)

    variants: dict[str, tuple] = {}
    variants["padded"] = (sdpa, *make_padded(sdpa, seqs, adv, total, pad_id, args.micro_batch_size))
    variants["packed-mask"] = (sdpa, *make_packed(sdpa, seqs, adv, total, pad_id, args.row_tokens,
                                                  args.rows_per_micro_batch, args.window))
    skipped = {}
    if varlen.available(device):
        vl = load(model_dir, varlen.NAME, device, dtype)
        variants["packed-varlen"] = (vl, *make_packed(vl, seqs, adv, total, pad_id, args.row_tokens,
                                                      args.rows_per_micro_batch, args.window))
    else:
        skipped["packed-varlen"] = f"torch_varlen needs CUDA and PyTorch 2.10+ ({device.type}, {torch.__version__})"
    variants["shared-mask"] = (sdpa, *make_shared(sdpa, seqs, adv, total, pad_id, args.row_tokens,
                                                  args.rows_per_micro_batch, args.window))

    # correctness first: every layout's loss and gradient against the padded pass
    ref_loss, ref_grads = grads_of(sdpa, variants["padded"][1])
    ref_norm = torch.sqrt(sum((g.float() ** 2).sum() for g in ref_grads.values())).item()
    checks = {}
    for name, (model, run, _) in variants.items():
        if name == "padded":
            continue
        loss, grads = grads_of(model, run)
        diff = torch.sqrt(sum(((grads[n].float() - g.float()) ** 2).sum() for n, g in ref_grads.items())).item()
        checks[name] = {"loss": loss, "loss_padded": ref_loss, "grad_rel_diff": diff / max(ref_norm, 1e-30)}
        model.zero_grad(set_to_none=True)
        print(f"{name}: loss {loss:.5f} vs padded {ref_loss:.5f}, gradient rel. diff {diff / ref_norm:.2e}",
              flush=True)
    del ref_grads
    sdpa.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {n: [] for n in variants}
    peaks: dict[str, float] = {}
    for rep in range(args.repeats + 1):  # the first round is the warm-up
        for name, (model, run, _) in variants.items():
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t = time.perf_counter()
            run()
            sync(device)
            if rep:
                times[name].append(time.perf_counter() - t)
            if device.type == "cuda":
                peaks[name] = torch.cuda.max_memory_allocated(device) / 1024**3
        print(f"round {rep}{' (warm-up)' if rep == 0 else ''}: " +
              ", ".join(f"{n} {times[n][-1]:.3f} s" for n in variants if rep), flush=True)

    base = statistics.median(times["padded"])
    rows = []
    for name, (_, _, meta) in variants.items():
        med = statistics.median(times[name])
        rows.append({"name": name, **meta, "real_tokens": info["real_tokens"],
                     "density": info["real_tokens"] / meta["capacity"] if name != "shared-mask" else
                     meta["laid_out_tokens"] / meta["capacity"],
                     "seconds_median": med, "seconds_min": min(times[name]), "seconds_max": max(times[name]),
                     "speedup_vs_padded": base / med, "peak_allocated_gib": peaks.get(name),
                     **({"check": checks[name]} if name in checks else {})})
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {"command": "python benchmarks/gpu_attention.py " + shlex.join(sys.argv[1:]),
              "device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": str(dtype),
              "shape": args.shape, "workload": info, "repeats": args.repeats, "variants": rows, "skipped": skipped,
              "row_tokens": args.row_tokens, "rows_per_micro_batch": args.rows_per_micro_batch,
              "micro_batch_size": args.micro_batch_size}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "attention.json").write_text(json.dumps(report, indent=2) + "\n")
    w = info
    lines = [f"# Update-pass time by layout and attention kernel ({gpu})", "",
             f"Command: `{report['command']}`  ",
             f"torch {torch.__version__} (CUDA {torch.version.cuda}), {dtype}, Qwen3 shape {args.shape!r} with "
             f"random weights, every parameter trained.  ",
             f"Batch: {w['groups']} prompts x {w['num_generations']} completions (prompts {w['prompt_tokens'][0]}-"
             f"{w['prompt_tokens'][1]} tokens, completions {w['completion_tokens'][0]}-{w['completion_tokens'][1]}), "
             f"{w['kept']} kept at random ({w['real_tokens']} tokens). One pass = forward with gradients + GRPO loss "
             f"+ backward; {args.repeats} timed repeats each, round-robin, after a warm-up.", "",
             "| layout | micro-batches | token slots | density | seconds (median) | min - max | vs padded "
             "| peak GiB | loss rel. to padded | gradient rel. diff |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("check")
        peak = "-" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.1f}"
        loss_ratio = "-" if c is None else f"{c['loss'] / c['loss_padded']:.5f}"
        grad_diff = "-" if c is None else f"{c['grad_rel_diff']:.1e}"
        lines.append(f"| {r['name']} | {r['micro_batches']} | {r['capacity']} | {r['density']:.3f} | "
                     f"{r['seconds_median']:.3f} | {r['seconds_min']:.3f} - {r['seconds_max']:.3f} | "
                     f"{r['speedup_vs_padded']:.2f}x | {peak} | {loss_ratio} | {grad_diff} |")
    for name, why in skipped.items():
        lines.append(f"\n{name} skipped: {why}")
    (args.output / "attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
