"""Update-phase time per step, packed vs padded, and with each prompt once per group, on the same pruned batch
of real rollouts.

Made with (from the repository root; about 3 minutes on 2 CPU cores):

    DPPO_CACHE_DIR=.cache/dppo .venv/bin/python benchmarks/packing_update.py --output benchmarks/results/packing

Workload: the warm-started tiny model rolls out ``--prompts`` training prompts (levels 2-5, as the
tiny-grpo preset) x ``--num-generations`` completions with ``HFRollout`` (temperature 1, at
most ``--max-tokens`` new tokens); rewards and group advantages as the trainer computes them; then a
seeded random ``--keep`` share of the completions is kept, each with weight 1 / keep (what completion
pruning leaves). One update pass over the kept sequences is timed: forward with gradients, the GRPO
policy loss with the full batch's normaliser, backward, in micro-batches whose gradients accumulate (no
optimizer step, so every repeat does the same work):

    padded   the trainer's path: sequences sorted by length, ``--micro-batch-size`` per micro-batch,
             right-padded (``dppo_core.logprobs.completion_logprobs_with_grad``)
    packed   ``dppo_core.packing.pack_micro_batches``: rows of ``--row-tokens`` tokens (one variant per
             value), ``--micro-batch-tokens // row_tokens`` rows per micro-batch, window ``--window``;
             the packing itself is inside the timed region
    shared   ``--shared``: ``dppo_core.shared_prefix``, each prompt laid out once per segment with its kept
             completions after it; ``shared-packed-B`` packs segments into rows of B tokens (as packed),
             ``shared-padded`` puts one group per row, ``--micro-batch-size // --num-generations`` rows
             per micro-batch; ``shared-segments`` is the default route (segment attention, the model's
             attention switched to ``dppo_core.shared_prefix.NAME`` for the pass): one unpadded row of whole
             segments per micro-batch of at most ``--micro-batch-tokens`` tokens, attention per segment

Repeats run round-robin over the variants (so a change in machine load hits every variant alike) after
one warm-up pass each; median, min and max seconds are reported, with the speed-up over padded of the
median and of the minimum (on a busy machine the minimum is the less noisy of the two). Tokens: ``real`` =
prompt + completion tokens, ``capacity`` = token slots the forward pays for (sum over micro-batches of rows
x width), ``density`` = real / capacity. Also checked: the loss and every gradient of the packed pass equal
the padded pass's.

The density of the kept length distribution as one batch (no micro-batching) is reported as well:
``pad`` (one row per sequence, the longest sets the width), the padded micro-batches, and ``pack`` at
each row budget with window 1 (next fit) and ``--window``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from dppo_core.grpo import group_advantages, policy_loss
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.models import load_model
from dppo_core.packing import PackSequence, pack, pack_micro_batches, packed_completion_logprobs, pad
from dppo_core.rewards import accuracy_reward
from dppo_core.rollout import HFRollout, SamplingConfig
from dppo_core.shared_prefix import NAME as SEGMENTS
from dppo_core.shared_prefix import register, shared_prefix_logprobs, shared_prefix_micro_batches
from dppo_core.tasks import ArithmeticTask
from dppo_core.warm_start import warm_start


def pruned_batch(model, tokenizer, args) -> tuple[list[PackSequence], torch.Tensor, int, dict]:
    """Roll out, reward, advantages; keep a random share. Returns sequences, advantages, the normaliser."""
    task = ArithmeticTask(tuple(args.levels))
    problems = task.sample_train(random.Random(args.seed), args.prompts)
    engine = HFRollout(model, tokenizer)
    t = time.perf_counter()
    batch = engine.generate([p.messages() for p in problems], args.num_generations,
                            SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed))
    rollout_s = time.perf_counter() - t
    g = args.num_generations
    completions = [c for grp in batch.groups for c in grp.completions]
    rewards = torch.tensor(accuracy_reward(None, [c.text for c in completions],
                                           answer=[str(p.answer) for p in problems for _ in range(g)]))
    adv = group_advantages(rewards.view(len(problems), g)).flatten()
    rng = random.Random(f"keep:{args.seed}")
    seqs, kept_adv = [], []
    for k, c in enumerate(completions):
        if rng.random() < args.keep:
            seqs.append(PackSequence(batch.groups[k // g].prompt_ids, c.token_ids, weight=1.0 / args.keep))
            kept_adv.append(adv[k].item())
    info = {"rollout_s": round(rollout_s, 2), "completions": len(completions), "kept": len(seqs),
            "reward_mean": round(rewards.mean().item(), 4),
            "prompt_tokens_mean": round(statistics.mean(len(s.prompt_ids) for s in seqs), 2),
            "completion_tokens_mean": round(statistics.mean(len(s.completion_ids) for s in seqs), 2),
            "completion_tokens_max": max(len(s.completion_ids) for s in seqs),
            "sequence_tokens_min": min(len(s) for s in seqs), "sequence_tokens_max": max(len(s) for s in seqs)}
    return seqs, torch.tensor(kept_adv), len(completions), info


def padded_micro_batches(seqs: list[PackSequence], size: int) -> list[list[int]]:
    """The trainer's micro-batches: indices sorted by sequence length, ``size`` at a time."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]


def make_padded(model, seqs, adv, num_sequences, pad_id, size):
    mbs = padded_micro_batches(seqs, size)
    weights = torch.tensor([s.weight for s in seqs])

    def run() -> float:
        total = 0.0
        for idx in mbs:
            logp, mask = completion_logprobs_with_grad(model, [seqs[i].prompt_ids for i in idx],
                                                       [seqs[i].completion_ids for i in idx], 1.0, pad_id)
            loss, _ = policy_loss(logp, adv[idx], mask, weights=weights[idx], loss_type="grpo",
                                  num_sequences=num_sequences)
            loss.backward()
            total += loss.item()
        return total

    capacity = sum(len(idx) * max(len(seqs[i]) for i in idx) for idx in mbs)
    return run, {"micro_batches": len(mbs), "capacity": capacity}


def make_packed(model, seqs, adv, num_sequences, pad_id, row_tokens, rows_per_mb, window):
    def run() -> float:
        total = 0.0
        for idx, batch in pack_micro_batches(seqs, row_tokens, rows_per_mb, window, oversize="own_row", pad_id=pad_id):
            logp, mask = packed_completion_logprobs(model, batch)
            loss, _ = policy_loss(logp, adv[idx], mask, weights=batch.weights, loss_type="grpo",
                                  num_sequences=num_sequences)
            loss.backward()
            total += loss.item()
        return total

    mbs = pack_micro_batches(seqs, row_tokens, rows_per_mb, window, oversize="own_row", pad_id=pad_id)
    return run, {"micro_batches": len(mbs), "capacity": sum(b.capacity for _, b in mbs),
                 "rows": sum(b.num_rows for _, b in mbs), "max_width": max(b.width for _, b in mbs)}


def make_shared(model, seqs, adv, num_sequences, pad_id, row_tokens, rows_per_mb, window, segments=False):
    """Each prompt once per segment; ``row_tokens=None``: one segment (group) per row; ``segments``: segment
    attention over one unpadded row per micro-batch of at most ``row_tokens`` tokens."""
    def batches():
        return shared_prefix_micro_batches(seqs, row_tokens, rows_per_mb, window, pad_id=pad_id, one_row=segments)

    def run() -> float:
        total = 0.0
        before = model.config._attn_implementation
        if segments:
            model.set_attn_implementation(SEGMENTS)
        try:
            for idx, batch in batches():
                logp, mask = shared_prefix_logprobs(model, batch)
                w = torch.tensor([seqs[i].weight for i in idx])
                loss, _ = policy_loss(logp, adv[idx], mask, weights=w, loss_type="grpo",
                                      num_sequences=num_sequences)
                loss.backward()
                total += loss.item()
        finally:
            model.set_attn_implementation(before)
        return total

    mbs = batches()
    return run, {"micro_batches": len(mbs), "capacity": sum(b.capacity for _, b in mbs),
                 "rows": sum(b.num_rows for _, b in mbs), "laid_out_tokens": sum(b.real_tokens for _, b in mbs)}


def grads_of(model, run) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = run()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def density_table(seqs: list[PackSequence], args) -> dict:
    real = sum(len(s) for s in seqs)
    mbs = padded_micro_batches(seqs, args.micro_batch_size)
    cap_mb = sum(len(idx) * max(len(seqs[i]) for i in idx) for idx in mbs)
    out = {"real_tokens": real,
           "pad_one_batch": pad(seqs).stats(),
           f"padded_sorted_micro_batches_of_{args.micro_batch_size}": {"capacity": cap_mb,
                                                                       "density": round(real / cap_mb, 4)},
           "pack": {}}
    for b in args.row_tokens:
        for w in sorted({1, args.window}):
            out["pack"][f"row_tokens={b},window={w}"] = pack(seqs, b, w, oversize="own_row").stats()
    return out


def write_markdown(report: dict, path: Path) -> None:
    w = report["workload"]
    lines = ["# Update-phase time: padded, packed, shared prefix (same pruned batch)", "",
             f"Command: `{report['command']}`", "",
             f"Workload: warm-started tiny model, {w['prompts']} prompts x {w['num_generations']} completions "
             f"(levels {w['levels']}, at most {w['max_tokens']} new tokens), {w['kept']} of {w['completions']} kept "
             f"at random (keep {w['keep']}); prompt {w['prompt_tokens_mean']} tokens and completion "
             f"{w['completion_tokens_mean']} tokens on average (at most {w['completion_tokens_max']}). "
             f"One pass = forward with grad + GRPO loss + backward over all kept sequences; "
             f"{report['repeats']} timed repeats per variant, round-robin, after a warm-up; "
             f"torch {report['machine']['torch']}, torch.set_num_threads({report['threads']}).", "",
             "| variant | row budget | rows / micro-batch | micro-batches | real tokens | capacity | density "
             "| seconds (median) | min - max | speed-up (median) | speed-up (min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in report["variants"]:
        lines.append(f"| {v['name']} | {v.get('row_tokens', '-')} | {v.get('rows_per_micro_batch', '-')} | "
                     f"{v['micro_batches']} | {v['real_tokens']} | {v['capacity']} | {v['density']:.3f} | "
                     f"{v['seconds_median']:.3f} | {v['seconds_min']:.3f} - {v['seconds_max']:.3f} | "
                     f"{v['speedup']:.2f}x | {v['speedup_min']:.2f}x |")
    d = report["density"]
    lines += ["", "Density of the kept length distribution as one batch:", "",
              "| layout | density |", "|---|---|",
              f"| pad (one row per sequence, one batch) | {d['pad_one_batch']['density']:.3f} |"]
    for k, v in d.items():
        if k.startswith("padded_sorted"):
            lines.append(f"| {k.replace('_', ' ')} | {v['density']:.3f} |")
    for k, v in d["pack"].items():
        lines.append(f"| pack {k} | {v['density']:.3f} (budget density {v['budget_density']:.3f}) |")
    m = report["machine"]
    lines += ["", f"Every other variant's loss and gradients equal the padded pass's (largest gradient difference "
              f"{report['max_grad_abs_diff']:.2e} against a largest gradient entry of {report['max_grad_abs']:.2e}; "
              f"loss difference {report['max_loss_abs_diff']:.2e} on a loss of {report['loss']:.4f}).", "",
              f"Machine: {m['cpus']} CPUs ({m['platform']}); 1-minute load average {m['loadavg_before'][0]} before, "
              f"{m['loadavg_after'][0]} after (a shared machine: timings are noisy, re-run on a quiet one).", ""]
    if report.get("note"):
        lines += [report["note"], ""]
    path.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/packing"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--levels", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--keep", type=float, default=0.5, help="share of completions kept (random, seeded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batch-size", type=int, default=64, help="padded: sequences per micro-batch")
    parser.add_argument("--row-tokens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                        help="packed: row budgets to compare (one variant each)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096,
                        help="packed: rows per micro-batch = max(1, this // row budget)")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--note", default="", help="a line added to the Markdown summary")
    parser.add_argument("--shared", action="store_true",
                        help="also time the shared-prefix layout (each prompt once per group), packed and padded")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    load_before = os.getloadavg()
    model, tokenizer = load_model(warm_start())
    pad_id = tokenizer.pad_token_id
    seqs, adv, num_sequences, info = pruned_batch(model, tokenizer, args)
    print(f"rollout: {info}", flush=True)
    model.train()

    runs = {}
    run, meta = make_padded(model, seqs, adv, num_sequences, pad_id, args.micro_batch_size)
    runs["padded"] = (run, {"name": f"padded ({args.micro_batch_size} per micro-batch, sorted)", **meta})
    for b in args.row_tokens:
        rpm = max(1, args.micro_batch_tokens // b)
        run, meta = make_packed(model, seqs, adv, num_sequences, pad_id, b, rpm, args.window)
        runs[f"packed-{b}"] = (run, {"name": f"packed (window {args.window})", "row_tokens": b,
                                     "rows_per_micro_batch": rpm, **meta})

    if args.shared:
        rpm = max(1, args.micro_batch_size // args.num_generations)
        run, meta = make_shared(model, seqs, adv, num_sequences, pad_id, None, rpm, args.window)
        runs["shared-padded"] = (run, {"name": "shared prefix, one group per row", "rows_per_micro_batch": rpm,
                                       **meta})
        for b in args.row_tokens:
            rpm = max(1, args.micro_batch_tokens // b)
            run, meta = make_shared(model, seqs, adv, num_sequences, pad_id, b, rpm, args.window)
            runs[f"shared-packed-{b}"] = (run, {"name": f"shared prefix, packed (window {args.window})",
                                                "row_tokens": b, "rows_per_micro_batch": rpm, **meta})
        register()
        run, meta = make_shared(model, seqs, adv, num_sequences, pad_id, args.micro_batch_tokens, 1, args.window,
                                segments=True)
        runs["shared-segments"] = (run, {"name": "shared prefix, segment attention (one unpadded row per "
                                                 "micro-batch)", "row_tokens": args.micro_batch_tokens,
                                         "rows_per_micro_batch": 1, **meta})

    # correctness first: same loss and gradients
    ref_loss, ref_grads = grads_of(model, runs["padded"][0])
    max_grad, max_loss = 0.0, 0.0
    grad_scale = max(g.abs().max().item() for g in ref_grads.values())
    for key, (run, _) in runs.items():
        if key == "padded":
            continue
        loss, grads = grads_of(model, run)
        max_loss = max(max_loss, abs(loss - ref_loss))
        max_grad = max(max_grad, max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()))
    print(f"packed vs padded: max loss diff {max_loss:.2e} (loss {ref_loss:.4f}), max grad diff {max_grad:.2e} "
          f"(largest gradient entry {grad_scale:.2e})", flush=True)

    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(args.repeats + 1):  # the first round is the warm-up
        for key, (run, _) in runs.items():
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            run()
            dt = time.perf_counter() - t
            if rep > 0:
                times[key].append(dt)
        if rep > 0:
            print(f"round {rep}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)

    real = sum(len(s) for s in seqs)
    base, base_min = statistics.median(times["padded"]), min(times["padded"])
    variants = []
    for key, (_, meta) in runs.items():
        med = statistics.median(times[key])
        laid = meta.get("laid_out_tokens", real)  # the shared layout carries fewer tokens than `real`
        variants.append({"key": key, **meta, "real_tokens": laid, "density": round(laid / meta["capacity"], 4),
                         "seconds": [round(x, 4) for x in times[key]], "seconds_median": round(med, 4),
                         "seconds_min": round(min(times[key]), 4), "seconds_max": round(max(times[key]), 4),
                         "speedup": round(base / med, 3), "speedup_min": round(base_min / min(times[key]), 3)})
    report = {
        "command": "DPPO_CACHE_DIR=.cache/dppo .venv/bin/python benchmarks/packing_update.py "
                   + shlex.join(sys.argv[1:]),
        "workload": {"prompts": args.prompts, "num_generations": args.num_generations, "max_tokens": args.max_tokens,
                     "levels": args.levels, "keep": args.keep, "seed": args.seed, **info},
        "threads": args.threads, "repeats": args.repeats, "window": args.window,
        "micro_batch_tokens": args.micro_batch_tokens,
        "variants": variants,
        "density": density_table(seqs, args),
        "max_grad_abs_diff": max_grad, "max_grad_abs": grad_scale, "max_loss_abs_diff": max_loss,
        "loss": ref_loss,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "note": args.note,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "update_time.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, args.output / "update_time.md")
    print((args.output / "update_time.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
