"""The update's layouts in ``dppo doctor --gpu`` (:mod:`dppo_core.tools.gpu_check`): each must give what the
padded layout gives, within a :class:`Tolerance` (fp32 on CPU, bf16 on CUDA), and a negative control must not.

    packing       packed == padded completion log-probs, loss and gradient, on the route the update takes
                  (:func:`check_packing`: the mask route, flash-attention's varlen kernel, PyTorch's own); the
                  control lets attention cross the sequence boundaries of the same rows
                  (:func:`boundary_crossing`).
    shared prefix segment attention (each prompt once per group) == padded (:func:`check_shared_prefix`); the
                  control gives each completion another group's prompt.
    lean decode   the rollout's lean decode step == the model's forward logits (:func:`check_lean_decode`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dppo_core.tools.bench.systems import free_cuda
from dppo_core.tools.doctor import Check, describe_error


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


def _loss_and_grad(model, logprobs: torch.Tensor, mask: torch.Tensor,
                   adv: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = -(logprobs.float() * mask * adv[:, None]).sum() / mask.sum()
    loss.backward()
    grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
    return loss.item(), torch.cat(grads)


def _compare(tol: Tolerance, mask: torch.Tensor, lp_ref: torch.Tensor, loss_ref: float, g_ref: torch.Tensor,
             lp: torch.Tensor, loss: float, g: torch.Tensor, lp_ctrl: torch.Tensor,
             control: str) -> tuple[bool, str]:
    """A layout's log-probs, loss and gradient against the padded reference's, and its control's distance."""
    m = mask.bool()
    d = (lp.float() - lp_ref.float())[m].abs()
    d_ctrl = (lp_ctrl.float() - lp_ref.float())[m].abs()
    grad_rel = ((g - g_ref).norm() / g_ref.norm().clamp_min(1e-30)).item()
    ratio = d_ctrl.mean().item() / max(d.mean().item(), 1e-12)
    numbers = (f"mean |Δ log-prob| {d.mean():.1e} (max {d.max():.1e}), loss {loss:.4f} vs {loss_ref:.4f}, "
               f"gradient rel. diff {grad_rel:.1e}; {control} control {d_ctrl.mean():.1e} ({ratio:.3g}x)")
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
            return Check(name, "WARN", "flash-attn does not import here, so a packed update on this GPU "
                                       "takes the mask route (exact, but attention over whole rows: R·T² "
                                       "scores instead of Σ L²)",
                         "pip install flash-attn --no-build-isolation   (then "
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
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                         attn_implementation=attention)
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
    """Segment attention (the shared-prefix update's default route, one unpadded row) against the padded
    layout for one model, with a control that lets each completion read another group's prompt: (passed,
    numbers)."""
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
    ok, numbers = _compare(tol, mask, lp_pad, loss_pad, g_pad, lp_seg, loss_seg, g_seg, lp_ctrl,
                           "other-prompt")
    return ok, (f"{len(seqs)} sequences in {groups} groups, {batch.real_tokens} tokens in one row (unshared "
                f"{batch.unshared_tokens}), {numbers}")


def check_shared_prefix(model_dir: str | Path, device: torch.device) -> Check:
    """The shared-prefix update through segment attention equals the padded layout (log-probs, loss,
    gradient)."""
    from dppo_core import shared_prefix

    shared_prefix.register()
    big = device.type == "cuda"
    return _layout_check("shared prefix (segment attention)", model_dir, device, shared_prefix.NAME,
                         lambda model, tol: shared_prefix_case(
                             model, tol, groups=4 if big else 3, per_group=4 if big else 3,
                             prompt=(40, 200) if big else (4, 20), completion=(20, 400) if big else (3, 30),
                             pad_id=model.config.pad_token_id or 0),
                         crash_fix="train with shared_prefix=false and report this line",
                         fail_fix="the shared-prefix update is not exact here: train with "
                                  "shared_prefix=false and report this line")


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
