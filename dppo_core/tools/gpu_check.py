"""``dppo doctor --gpu``: the paths a GPU user relies on, checked in one command, one line per check.

    dppo doctor --gpu                  # CUDA: Qwen3-1.7B's layers in bf16, a few minutes
    dppo doctor --gpu --shape tiny     # anywhere: the same checks at tiny shapes (what `make test` runs)

Nothing is downloaded: every check builds a model from a Qwen3 configuration (:data:`SHAPES`) with random
weights and the embedded tokenizer, so the vocabulary is that tokenizer's (a few hundred tokens, not
Qwen3's 151,936: the LM head and the log-softmax are much smaller than the real model's). What it checks:

    cuda         the device and its memory (on CPU: says which checks below are skipped)
    packing      packed == padded completion log-probs, loss and gradient, on the route the update takes:
                 ``mask`` (sdpa with a block-diagonal mask; every device) and ``varlen``, with flash-attention's
                 variable-length kernel (CUDA with flash-attn) and with PyTorch's own (``torch_varlen``, CUDA,
                 :mod:`dppo_core.varlen`). A negative control lets attention cross the
                 sequence boundaries of the same rows and must differ by far more than the packed result.
    lean decode  the rollout's lean decode step (:mod:`dppo_core.engines.lean_decode`) against the model's forward:
                 logits over 8 decode steps with left padding and rows leaving.
    qlora        LoRA on a 4-bit NF4 base (bitsandbytes; its CUDA kernels on a GPU): one update step, the
                 adapter moves, the base stays 4-bit, the loss and gradients are finite.
    vllm         an engine colocated with the trainer: the memory it takes (``gpu_memory_utilization``),
                 sleep and wake around an update (CUDA), full-weight and LoRA-adapter sync measured as the
                 log-prob mismatch between engine and trainer after a sync (against a stale-engine control).
    step METHOD  one training step of every method (``DPPOTrainer.train_step``, as ``dppo train`` runs it),
                 with a stand-in reward (:func:`synthetic_reward`: random weights get every answer wrong):
                 time per phase and peak memory.

Each check is a :class:`dppo_core.tools.doctor.Check`: ``OK``, ``FAIL`` (with the reason and what to do) or
``SKIP`` (with why: on CPU, what needs CUDA). :func:`run_gpu_checks` never raises.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dppo_core.shapes import SHAPES, build_shaped_model
from dppo_core.tools.bench.systems import (
    GiB,
    format_step,
    free_cuda,
    peak_memory,
    reset_peak,
    train_steps,
)
from dppo_core.tools.doctor import Check, describe_error, quiet

# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """How close packed and padded must be, and how far the boundary-crossing control must be."""

    logprob_mean: float  # mean |Δ log-prob| over completion tokens
    logprob_max: float
    grad_rel: float  # ||g_packed - g_padded|| / ||g_padded||
    control_ratio: float  # the control's mean |Δ| over the packed result's, at least


FP32 = Tolerance(logprob_mean=1e-5, logprob_max=1e-4, grad_rel=1e-4, control_ratio=100.0)
#: bf16 rounds to 8 bits of mantissa: two layouts (different kernels, different summation orders) differ by
#: about 1% of a logit; crossing a boundary changes what a token attends to, which is far more.
BF16 = Tolerance(logprob_mean=0.03, logprob_max=0.5, grad_rel=0.1, control_ratio=4.0)


def check_device() -> Check:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Check("cuda", "OK", f"{props.name}, {props.total_memory / GiB:.0f} GiB, compute capability "
                                   f"{props.major}.{props.minor}, torch {torch.__version__} "
                                   f"(CUDA {torch.version.cuda})")
    return Check("cuda", "SKIP", "no CUDA device: the checks below run at tiny shapes in float32 on CPU; the "
                                 "varlen kernel, the 4-bit CUDA kernels and vLLM's sleep mode are skipped",
                 "run `dppo doctor --gpu` on a CUDA machine for the GPU paths")


def random_sequences(vocab: int, n: int, prompt: tuple[int, int], completion: tuple[int, int], seed: int = 0):
    """``n`` (prompt ids, completion ids) of random tokens and lengths in the given [lo, hi] ranges."""
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return torch.randint(3, vocab, (length,), generator=gen).tolist()

    return [(draw(*prompt), draw(*completion)) for _ in range(n)]


def boundary_crossing(batch):
    """The same rows with every row one sequence (positions 0..T-1, one sequence id): attention then
    crosses the boundaries between the sequences a row holds. The packing check's negative control."""
    real = batch.seq_ids >= 0
    row_id = torch.arange(batch.num_rows)[:, None].expand_as(batch.seq_ids)
    positions = torch.arange(batch.width)[None].expand_as(batch.seq_ids)
    return replace(batch, seq_ids=torch.where(real, row_id, -1), position_ids=torch.where(real, positions, 0))


def _loss_and_grad(model, logprobs: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = -(logprobs.float() * mask * adv[:, None]).sum() / mask.sum()
    loss.backward()
    grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
    return loss.item(), torch.cat(grads)


def _compare(tol: Tolerance, mask: torch.Tensor, lp_ref: torch.Tensor, loss_ref: float, g_ref: torch.Tensor,
             lp: torch.Tensor, loss: float, g: torch.Tensor, lp_ctrl: torch.Tensor, control: str) -> tuple[bool, str]:
    """A layout's log-probs, loss and gradient against the padded reference's, and its control's distance."""
    m = mask.bool()
    d = (lp.float() - lp_ref.float())[m].abs()
    d_ctrl = (lp_ctrl.float() - lp_ref.float())[m].abs()
    grad_rel = ((g - g_ref).norm() / g_ref.norm().clamp_min(1e-30)).item()
    ratio = d_ctrl.mean().item() / max(d.mean().item(), 1e-12)
    numbers = (f"mean |Δ log-prob| {d.mean():.1e} (max {d.max():.1e}), loss {loss:.4f} vs {loss_ref:.4f}, gradient "
               f"rel. diff {grad_rel:.1e}; {control} control {d_ctrl.mean():.1e} ({ratio:.3g}x)")
    ok = (d.mean() <= tol.logprob_mean and d.max() <= tol.logprob_max and grad_rel <= tol.grad_rel
          and ratio >= tol.control_ratio and abs(loss - loss_ref) <= max(tol.logprob_mean, 1e-6) * 10)
    return bool(ok), numbers


def packing_case(model, route: str, tol: Tolerance, *, n: int, prompt: tuple[int, int],
                 completion: tuple[int, int], pad_id: int) -> tuple[bool, str]:
    """Packed against padded on ``route`` for one model: (passed, the measured numbers)."""
    from dppo_core.logprobs import completion_logprobs_with_grad
    from dppo_core.packing import PackSequence, pack, packed_completion_logprobs

    vocab = model.get_input_embeddings().weight.shape[0]
    seqs = random_sequences(vocab, n, prompt, completion)
    prompts, comps = [p for p, _ in seqs], [c for _, c in seqs]
    adv = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).device)
    lp_pad, mask = completion_logprobs_with_grad(model, prompts, comps, 1.0, pad_id)
    loss_pad, g_pad = _loss_and_grad(model, lp_pad, mask, adv)
    budget = 2 * max(len(p) + len(c) for p, c in seqs)
    batch = pack([PackSequence(p, c) for p, c in seqs], budget, pad_id=pad_id)
    lp_pack, _ = packed_completion_logprobs(model, batch, attention=route)
    loss_pack, g_pack = _loss_and_grad(model, lp_pack, mask, adv)
    with torch.no_grad():
        lp_ctrl, _ = packed_completion_logprobs(model, boundary_crossing(batch), attention=route)
    ok, numbers = _compare(tol, mask, lp_pad, loss_pad, g_pad, lp_pack, loss_pack, g_pack, lp_ctrl,
                           "boundary-crossing")
    return ok, f"{n} sequences in {batch.num_rows} rows, {numbers}"


def check_packing(model_dir: str | Path, device: torch.device, *, attention: str) -> Check:
    """Packed == padded through ``attention`` ("sdpa": the mask route; "flash_attention_2" and "torch_varlen":
    the varlen route, flash-attn's kernel or PyTorch's own, :mod:`dppo_core.varlen`)."""
    from dppo_core import varlen

    route = "varlen" if attention in ("flash_attention_2", varlen.NAME) else "mask"
    name = f"packing ({route}, {attention})"
    if attention == varlen.NAME:
        if device.type != "cuda":
            return Check(name, "SKIP", "PyTorch's variable-length kernel needs CUDA")
        why = varlen.unavailable_reason(device)
        if why is not None:
            return Check(name, "WARN", f"not available here: {why}; a packed update takes the mask route "
                                       "(exact, slower)", "PyTorch 2.10+ on an Ampere or newer GPU has it")
        varlen.register()
    if attention == "flash_attention_2":
        from dppo_core.policy import flash_attention_available

        if device.type != "cuda":
            return Check(name, "SKIP", "flash-attention's variable-length kernel needs CUDA")
        if not flash_attention_available():
            return Check(name, "WARN", "flash-attn does not import here, so a packed update on this GPU takes the "
                                       "mask route (exact, but attention over whole rows: R·T² scores instead of "
                                       "Σ L²)", "pip install flash-attn --no-build-isolation   (then "
                                                "attn_implementation=auto uses it)")
    big = device.type == "cuda"
    return _layout_check(name, model_dir, device, attention, lambda model, tol: packing_case(
        model, route, tol, n=12 if big else 6, prompt=(40, 200) if big else (4, 20),
        completion=(20, 600) if big else (3, 30), pad_id=model.config.pad_token_id or 0),
        crash_fix="report it with this output",
        fail_fix="packed updates are not exact here: train with packing=false and report this line")


def _layout_check(name: str, model_dir: str | Path, device: torch.device, attention: str,
                  case: Callable[[Any, Tolerance], tuple[bool, str]], crash_fix: str, fail_fix: str) -> Check:
    """Load the model with ``attention`` (bf16 on CUDA, fp32 on CPU) and run ``case(model, tolerance)``."""
    from transformers import AutoModelForCausalLM

    from dppo_core.model_files import quiet_transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = BF16 if dtype == torch.bfloat16 else FP32
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
            model.to(device)
        ok, numbers = case(model, tol)
    except Exception as exc:  # noqa: BLE001
        return Check(name, "FAIL", f"crashed ({describe_error(exc)})", crash_fix)
    finally:
        free_cuda()
    detail = f"{str(dtype).removeprefix('torch.')}: {numbers}"
    if ok:
        return Check(name, "OK", detail)
    return Check(name, "FAIL", f"{detail}; outside the tolerance {asdict(tol)}", fail_fix)


def shared_prefix_case(model, tol: Tolerance, *, groups: int, per_group: int, prompt: tuple[int, int],
                       completion: tuple[int, int], pad_id: int) -> tuple[bool, str]:
    """Segment attention (the shared-prefix update's default route, one unpadded row) against the padded layout
    for one model, with a control that lets each completion read another group's prompt: (passed, numbers)."""
    import dataclasses

    from dppo_core import shared_prefix
    from dppo_core.logprobs import completion_logprobs_with_grad
    from dppo_core.packing import PackSequence

    vocab = model.get_input_embeddings().weight.shape[0]
    draws = random_sequences(vocab, groups * (per_group + 1), prompt, completion)
    seqs = [PackSequence(draws[g * (per_group + 1)][0], draws[g * (per_group + 1) + 1 + i][1])
            for g in range(groups) for i in range(per_group)]  # per_group completions share each prompt
    device = next(model.parameters()).device
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(1)).to(device)
    lp_pad, mask = completion_logprobs_with_grad(model, [s.prompt_ids for s in seqs],
                                                 [s.completion_ids for s in seqs], 1.0, pad_id)
    loss_pad, g_pad = _loss_and_grad(model, lp_pad, mask, adv)
    (idx, batch), = shared_prefix.shared_prefix_micro_batches(seqs, None, 1, pad_id=pad_id, one_row=True)
    order = torch.tensor(idx, device=device)

    def in_input_order(b) -> torch.Tensor:
        lp = shared_prefix.shared_prefix_logprobs(model, b)[0]
        return torch.zeros_like(lp_pad).index_copy(0, order, lp.to(lp_pad.dtype))

    lp_seg = in_input_order(batch)
    loss_seg, g_seg = _loss_and_grad(model, lp_seg, mask, adv)
    # the control: the same row, each segment's completions attributed to the next segment (so its prompt)
    wrong = dataclasses.replace(batch, segments=batch.segments[1:] + batch.segments[:1])
    with torch.no_grad():
        lp_ctrl = in_input_order(wrong)
    ok, numbers = _compare(tol, mask, lp_pad, loss_pad, g_pad, lp_seg, loss_seg, g_seg, lp_ctrl, "other-prompt")
    return ok, (f"{len(seqs)} sequences in {groups} groups, {batch.real_tokens} tokens in one row (unshared "
                f"{batch.unshared_tokens}), {numbers}")


def check_shared_prefix(model_dir: str | Path, device: torch.device) -> Check:
    """The shared-prefix update through segment attention equals the padded layout (log-probs, loss, gradient)."""
    from dppo_core import shared_prefix

    shared_prefix.register()
    big = device.type == "cuda"
    return _layout_check("shared prefix (segment attention)", model_dir, device, shared_prefix.NAME,
                         lambda model, tol: shared_prefix_case(
                             model, tol, groups=4 if big else 3, per_group=4 if big else 3,
                             prompt=(40, 200) if big else (4, 20), completion=(20, 400) if big else (3, 30),
                             pad_id=model.config.pad_token_id or 0),
                         crash_fix="train with shared_prefix=false and report this line",
                         fail_fix="the shared-prefix update is not exact here: train with shared_prefix=false and "
                                  "report this line")


def check_lean_decode(model_dir: str | Path, device: torch.device) -> Check:
    """The rollout's lean decode step gives the model's forward logits (bit for bit on CPU in fp32; on CUDA in
    bf16 the same operations, so equal unless a kernel rounds the strided key buffers differently)."""
    from dppo_core.engines.lean_decode import compare_with_forward

    def case(model, tol: Tolerance) -> tuple[bool, str]:
        model.eval()
        worst, rows = compare_with_forward(model, steps=8, leave={3: [0, 1, 3, 4], 5: [1, 2, 3]})
        exact = "bit for bit" if worst == 0 else f"max |Δ logit| {worst:.3g}"
        # bit for bit in fp32; in bf16 a logit difference within the layouts' tolerance
        return worst == 0 or (tol is BF16 and worst <= tol.logprob_max), f"{rows} logit rows, {exact}"

    return _layout_check("lean decode step", model_dir, device, "sdpa", case,
                         crash_fix="run rollouts with HFRollout(..., lean=False) and report this line",
                         fail_fix="the lean decode step differs from the forward here: run rollouts with "
                                  "HFRollout(..., lean=False) and report this line")


def correction_summary(model: torch.nn.Module, batch, cap: float = 2.0) -> tuple[float, str]:
    """The engine's mismatch on ``batch`` and what ``rollout_correction`` would do with it: (mean token weight,
    one line with max |log π − log μ| and, per level, the mean weight and the share of tokens truncated at C)."""
    from dppo_core.grpo import truncated_importance_weights
    from dppo_core.rollout import completion_logprobs

    train = completion_logprobs(model, batch)
    rows = [(lp.float().cpu(), torch.tensor(c.logprobs, dtype=torch.float32))
            for g, lps in zip(batch.groups, train, strict=True) for c, lp in zip(g.completions, lps, strict=True)
            if c.length]
    logp = torch.nn.utils.rnn.pad_sequence([r[0] for r in rows], batch_first=True)
    mu = torch.nn.utils.rnn.pad_sequence([r[1] for r in rows], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r[0])) for r in rows], batch_first=True).bool()
    parts = [f"max |log π − log μ| {(logp - mu).abs()[mask].max().item():.2e} over {int(mask.sum())} tokens"]
    means = {}
    for level in ("token", "sequence"):
        w = truncated_importance_weights(logp, mu, cap, level=level, mask=mask)[mask]
        means[level] = w.mean().item()
        parts.append(f"{level} weights mean {means[level]:.4f}, {(w >= cap).float().mean().item():.1%} truncated "
                     f"at C={cap:g}")
    return means["token"], "; ".join(parts)


def check_rollout_correction(model_dir: str | Path, device: torch.device) -> Check:
    """The transformers engine's mismatch with the training forward (on CUDA in bf16 the decode's kernels and
    batch shapes differ from the update's), and the weights ``rollout_correction`` would give it."""
    from dppo_core.models import load_model
    from dppo_core.rollout import HFRollout, SamplingConfig

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        with quiet():
            model, tokenizer = load_model(model_dir, device=device, dtype=dtype)
        model.eval()
        batch = HFRollout(model, tokenizer).generate(_prompts(8 if cuda else 4), 4,
                                                     SamplingConfig(max_tokens=64 if cuda else 16, seed=0))
        mean, detail = correction_summary(model, batch)
    except Exception as exc:  # noqa: BLE001
        return Check("rollout correction (hf)", "FAIL", f"crashed ({describe_error(exc)})",
                     "report it with this output")
    finally:
        free_cuda()
    ok = abs(mean - 1) <= 0.05  # the engine is the policy itself: its weights stay near 1
    return Check("rollout correction (hf)", "OK" if ok else "FAIL", f"{str(dtype).removeprefix('torch.')}: {detail}",
                 "" if ok else "the rollout's log-probs are far from the update's: set rollout_correction=token and "
                               "report this line")


def check_qlora(model_dir: str | Path, device: torch.device) -> Check:
    """One update step of LoRA on a 4-bit NF4 base, through the package's own loader."""
    import importlib.util

    from dppo_core.config import DPPOConfig
    from dppo_core.logprobs import completion_logprobs_with_grad
    from dppo_core.policy import load_policy

    if importlib.util.find_spec("bitsandbytes") is None:
        return Check("qlora", "SKIP", "bitsandbytes is not installed (update_mode=qlora4/qlora8 need it)",
                     'pip install "bitsandbytes>=0.48"')
    try:
        reset_peak(device)
        t0 = time.perf_counter()
        config = DPPOConfig(model=str(model_dir), update_mode="qlora4", lora_r=8, lora_alpha=16, device=device.type)
        with quiet():
            model, tokenizer = load_policy(config, str(model_dir), device)
            import bitsandbytes as bnb
        quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        if not quantized:
            return Check("qlora", "FAIL", "no bitsandbytes Linear4bit layer after loading with qlora4", "report it")
        weight = quantized[0].weight
        where = f"{len(quantized)} Linear4bit layers, weights {weight.dtype} on {weight.device}"
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        vocab = model.get_input_embeddings().weight.shape[0]
        seqs = random_sequences(vocab, 8, (8, 40), (8, 64) if device.type == "cuda" else (4, 16))
        with quiet():
            lp, mask = completion_logprobs_with_grad(model, [p for p, _ in seqs], [c for _, c in seqs], 1.0,
                                                     tokenizer.pad_token_id or 0)
            loss = -(lp.float() * mask).sum() / mask.sum()
            loss.backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        moved = sum(not torch.equal(p.detach(), lora[n]) for n, p in model.named_parameters() if n in lora)
        frozen_base = all(not p.requires_grad for p in (m.weight for m in quantized))
        seconds = time.perf_counter() - t0
        memory = peak_memory(device)
    except Exception as exc:  # noqa: BLE001
        return Check("qlora", "FAIL", f"crashed ({describe_error(exc)})",
                     "check bitsandbytes against its CUDA build: python -m bitsandbytes")
    finally:
        free_cuda()
    detail = (f"{where}; loss {loss.item():.4f}, {moved} of {len(lora)} adapter tensors moved, "
              f"{seconds:.1f} s to load and step, {memory}")
    if not (torch.isfinite(loss) and grads_finite and moved and frozen_base):
        return Check("qlora", "FAIL", f"{detail}; expected a finite loss and gradients, moved adapters and a "
                                      "frozen base", "report it with this output")
    return Check("qlora", "OK", detail)


def _prompts(n: int) -> list[list[dict[str, str]]]:
    from dppo_core.tasks import ArithmeticTask

    return [p.messages() for p in ArithmeticTask().test_set(1)[:n]]


def _perturb(model: torch.nn.Module, scale: float = 0.02, seed: int = 1) -> None:
    """Move every weight by N(0, scale²): what an optimizer step does, exaggerated so a stale engine shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))


def check_vllm(model_dir: str | Path, device: torch.device) -> list[Check]:
    """A colocated engine: memory, sleep/wake (CUDA), full-weight and LoRA sync measured by log-prob mismatch."""
    import importlib.util

    from dppo_core.models import load_model
    from dppo_core.rollout import SamplingConfig, logprob_mismatch

    if importlib.util.find_spec("vllm") is None:
        return [Check("vllm", "SKIP", "vLLM is not installed (rollout_engine=vllm needs it)",
                      'pip install -e ".[vllm]"')]
    from dppo_core.engines.vllm import VLLMRollout

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    # bf16 on both sides: vLLM's kernels and transformers' differ by about 1% of a logit
    tol = 0.05 if cuda else 1e-4
    sampling = SamplingConfig(max_tokens=64 if cuda else 16, seed=0)
    prompts = _prompts(8 if cuda else 4)
    kwargs: dict[str, Any] = {"gpu_memory_utilization": 0.3} if cuda else {"kv_cache_memory_bytes": 1 << 27}
    checks: list[Check] = []
    engine = None
    try:
        with quiet():
            model, tokenizer = load_model(model_dir, device=device, dtype=dtype)
        free0 = torch.cuda.mem_get_info(device)[0] if cuda else 0
        t0 = time.perf_counter()
        with quiet():
            engine = VLLMRollout(model_dir, tokenizer, seed=0, **kwargs)
        start_s = time.perf_counter() - t0
        batch = engine.generate(prompts, 2, sampling)  # on CUDA the engine sleeps after generating
        if cuda:
            free_asleep = torch.cuda.mem_get_info(device)[0]
            engine._wake(("weights", "kv_cache"))
            free_awake = torch.cuda.mem_get_info(device)[0]
            engine._sleep()
            taken = free0 - free_awake
            released = free_asleep - free_awake
            detail = (f"the engine takes {taken / GiB:.1f} GiB awake (gpu_memory_utilization 0.3 of "
                      f"{torch.cuda.get_device_properties(device).total_memory / GiB:.0f} GiB), sleep gives "
                      f"{released / GiB:.1f} GiB back to training")
            checks.append(Check("vllm sleep/wake", "OK" if released >= 0.5 * taken else "FAIL", detail,
                                "" if released >= 0.5 * taken else "vLLM's sleep mode is not releasing memory: "
                                "check vllm's version (enable_sleep_mode needs CUDA)"))
        else:
            checks.append(Check("vllm sleep/wake", "SKIP", "sleep mode needs CUDA (on CPU the engine stays awake)"))
        in_step = logprob_mismatch(model, batch)
        _perturb(model)
        stale = logprob_mismatch(model, batch)
        t1 = time.perf_counter()
        engine.sync(model)
        sync_s = time.perf_counter() - t1
        synced_batch = engine.generate(prompts, 2, sampling)
        synced = logprob_mismatch(model, synced_batch)
        ok = synced.mean_abs <= tol and stale.mean_abs >= 5 * max(synced.mean_abs, 1e-7)
        checks.append(Check("vllm rollout correction", "OK", correction_summary(model, synced_batch)[1]))
        checks.append(Check("vllm weight sync", "OK" if ok else "FAIL",
                            f"started in {start_s:.0f} s; mean |engine - trainer log-prob| "
                            f"{in_step.mean_abs:.1e} before "
                            f"any update, {stale.mean_abs:.1e} after an update without sync, {synced.mean_abs:.1e} "
                            f"after a {sync_s:.2f} s sync (max {synced.max_abs:.1e}, {synced.num_tokens} tokens)",
                            "" if ok else "weights do not reach the engine: report this line"))
        engine.close()
        engine = None
        del model
        free_cuda()
        checks.append(_check_vllm_lora(model_dir, device, dtype, tol, sampling, prompts, kwargs))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("vllm", "FAIL", f"crashed ({describe_error(exc)})", "run `dppo doctor` for vLLM's install"))
    finally:
        if engine is not None:
            engine.close()
        free_cuda()
    return checks


def _check_vllm_lora(model_dir, device, dtype, tol, sampling, prompts, kwargs) -> Check:
    from peft import LoraConfig, get_peft_model

    from dppo_core.engines.vllm import VLLMRollout
    from dppo_core.models import load_model
    from dppo_core.rollout import logprob_mismatch

    with quiet():
        base, tokenizer = load_model(model_dir, device=device, dtype=dtype)
        engine = VLLMRollout(model_dir, tokenizer, lora=True, max_lora_rank=8, seed=0, **kwargs)
    try:
        torch.manual_seed(0)
        peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]))
        engine.sync(peft_model)
        batch = engine.generate(prompts, 2, sampling)
        synced = logprob_mismatch(peft_model, batch)
        with peft_model.disable_adapter():
            without = logprob_mismatch(peft_model, batch)
    finally:
        engine.close()
    ok = synced.mean_abs <= tol and without.mean_abs >= 5 * max(synced.mean_abs, 1e-7)
    return Check("vllm adapter sync", "OK" if ok else "FAIL",
                 f"mean |engine - trainer log-prob| with the adapter synced {synced.mean_abs:.1e} (max "
                 f"{synced.max_abs:.1e}); the trainer without the adapter {without.mean_abs:.1e}",
                 "" if ok else "the adapter does not reach the engine: report this line")


#: Every method of ours (TRL's peers are not this package's training path).
STEP_METHODS = ("grpo", "grpo_skip", "grpo_half", "dppo", "pods", "cppo", "greso")


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def step_overrides(device: torch.device, model_dir: str | Path) -> dict[str, Any]:
    """What the step checks change on the ``gpu-systems`` bench preset: the model, on CPU tiny sizes, and
    transformers rollouts where vLLM is not installed (the ``vllm`` check says so)."""
    out: dict[str, Any] = {"model": str(model_dir), "device": device.type, "max_steps": 1}
    if not vllm_installed():
        out["rollout_engine"] = "hf"
    if device.type != "cuda":
        out.update(prompts_per_step=4, num_generations=4, max_completion_length=16, micro_batch_size=8,
                   max_tokens_per_row=64, rollout_engine="hf", train_pool_size=16)
    return out


def check_steps(model_dir: str | Path, device: torch.device, methods: Sequence[str] = STEP_METHODS,
                on_result: Callable[[Check], None] | None = None) -> list[Check]:
    """One ``train_step`` of each method on the ``gpu-systems`` configuration (tiny sizes on CPU)."""
    from dppo_core.tools.bench.presets import bench_preset, method_config

    preset = bench_preset("gpu-systems")
    checks, engine = [], None
    with tempfile.TemporaryDirectory(prefix="dppo-doctor-gpu-") as tmp:
        for method in methods:
            name = f"step {method}"
            try:
                config = method_config(preset, method, 0, tmp).with_overrides(step_overrides(device, model_dir))
                (record,), engine = train_steps(method, config, 1, engine)
                finite = all(torch.isfinite(torch.tensor(float(record[k])))
                             for k in ("loss", "grad_norm") if k in record)
                if device.type == "cuda" and config.rollout_engine == "hf":  # vLLM is not installed
                    name = f"step {method} (hf rollouts)"
                check = (Check(name, "OK", format_step(record)) if finite else
                         Check(name, "FAIL", f"non-finite loss or gradient norm: {format_step(record)}", "report it"))
            except Exception as exc:  # noqa: BLE001
                check = Check(name, "FAIL", f"crashed ({describe_error(exc)})", "report it with this output")
            checks.append(check)
            if on_result is not None:
                on_result(check)
    if engine is not None and hasattr(engine, "close"):
        engine.close()
    free_cuda()
    return checks


def run_gpu_checks(shape: str | None = None, cache_dir: str | Path | None = None,
                   on_result: Callable[[Check], None] | None = None,
                   methods: Sequence[str] = STEP_METHODS) -> list[Check]:
    """Every check of ``dppo doctor --gpu``; never raises. ``shape``: a key of :data:`SHAPES`; default
    ``qwen3-1.7b`` on CUDA and ``tiny`` on CPU."""
    results: list[Check] = []

    def emit(check: Check) -> None:
        results.append(check)
        if on_result is not None:
            on_result(check)

    emit(check_device())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = shape or ("qwen3-1.7b" if device.type == "cuda" else "tiny")
    try:
        t0 = time.perf_counter()
        with quiet():
            model_dir = build_shaped_model(shape, cache_dir, dtype="bfloat16" if device.type == "cuda" else "float32")
        emit(Check("model", "OK", f"Qwen3 layers of shape {shape!r} ({asdict(SHAPES[shape])}), random weights, "
                                  f"embedded tokenizer; built or found in {time.perf_counter() - t0:.0f} s"))
    except Exception as exc:  # noqa: BLE001
        emit(Check("model", "FAIL", f"could not build the {shape!r} model ({describe_error(exc)})",
                   "set DPPO_CACHE_DIR to a writable directory with room"))
        return results
    for attention in ("sdpa", "flash_attention_2", "torch_varlen"):
        emit(check_packing(model_dir, device, attention=attention))
    emit(check_shared_prefix(model_dir, device))
    emit(check_lean_decode(model_dir, device))
    emit(check_rollout_correction(model_dir, device))
    emit(check_qlora(model_dir, device))
    for check in check_vllm(model_dir, device):
        emit(check)
    check_steps(model_dir, device, methods, on_result=emit)
    return results
