"""``dppo doctor --gpu``: the paths a GPU user relies on, checked in one command, one line per check.

    dppo doctor --gpu                  # CUDA: Qwen3-1.7B's layers in bf16, a few minutes
    dppo doctor --gpu --shape tiny     # anywhere: the same checks at tiny shapes (what `make test` runs)

Nothing is downloaded: every check builds a model from a Qwen3 configuration (:data:`SHAPES`) with random
weights and the embedded tokenizer, so the vocabulary is that tokenizer's (a few hundred tokens, not
Qwen3's 151,936: the LM head and the log-softmax are much smaller than the real model's). What it checks:

    cuda         the device and its memory (on CPU: says which checks below are skipped)
    packing      packed == padded completion log-probs, loss and gradient, on the route the update takes:
                 ``mask`` (sdpa with a block-diagonal mask; every device) and ``varlen``, with
                 flash-attention's variable-length kernel (CUDA with flash-attn) and with PyTorch's own
                 (``torch_varlen``, CUDA, :mod:`dppo_core.varlen`). A negative control lets attention cross
                 the sequence boundaries of the same rows and must differ by far more than the packed result.
    lean decode  the rollout's lean decode step (:mod:`dppo_core.engines.lean_decode`) against the model's
                 forward: logits over 8 decode steps with left padding and rows leaving.
    qlora        LoRA on a 4-bit NF4 base (bitsandbytes; its CUDA kernels on a GPU): one update step, the
                 adapter moves, the base stays 4-bit, the loss and gradients are finite.
    vllm         an engine colocated with the trainer: the memory it takes (``gpu_memory_utilization``),
                 sleep and wake around an update (CUDA), full-weight and LoRA-adapter sync measured as the
                 log-prob mismatch between engine and trainer after a sync (against a stale-engine control).
    step METHOD  one training step of every method (``DPPOTrainer.train_step``, as ``dppo train`` runs it),
                 with a stand-in reward (:func:`dppo_core.tools.bench.systems.synthetic_reward`: random
                 weights get every answer wrong): time per phase and peak memory.

This module holds the device, QLoRA and step checks and :func:`run_gpu_checks`; the layouts' exactness
(packing, the shared prefix's segment attention, the lean decode step) is
:mod:`dppo_core.tools.gpu_check_layouts`, the rollout engines' (rollout correction, vLLM)
:mod:`dppo_core.tools.gpu_check_rollouts`.

Each check is a :class:`dppo_core.tools.doctor.Check`: ``OK``, ``FAIL`` (with the reason and what to do) or
``SKIP`` (with why: on CPU, what needs CUDA). :func:`run_gpu_checks` never raises.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
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
from dppo_core.tools.gpu_check_layouts import (
    check_lean_decode,
    check_packing,
    check_shared_prefix,
    random_sequences,
)
from dppo_core.tools.gpu_check_rollouts import check_rollout_correction, check_vllm


def check_device() -> Check:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Check("cuda", "OK", f"{props.name}, {props.total_memory / GiB:.0f} GiB, compute capability "
                                   f"{props.major}.{props.minor}, torch {torch.__version__} "
                                   f"(CUDA {torch.version.cuda})")
    return Check("cuda", "SKIP", "no CUDA device: the checks below run at tiny shapes in float32 on CPU; the "
                                 "varlen kernel, the 4-bit CUDA kernels and vLLM's sleep mode are skipped",
                 "run `dppo doctor --gpu` on a CUDA machine for the GPU paths")


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
        config = DPPOConfig(model=str(model_dir), update_mode="qlora4", lora_r=8, lora_alpha=16,
                            device=device.type)
        with quiet():
            model, tokenizer = load_policy(config, str(model_dir), device)
            import bitsandbytes as bnb
        quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        if not quantized:
            return Check("qlora", "FAIL", "no bitsandbytes Linear4bit layer after loading with qlora4",
                         "report it")
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
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                           if p.grad is not None)
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
                config = method_config(preset, method, 0, tmp).with_overrides(
                    step_overrides(device, model_dir))
                (record,), engine = train_steps(method, config, 1, engine)
                finite = all(torch.isfinite(torch.tensor(float(record[k])))
                             for k in ("loss", "grad_norm") if k in record)
                if device.type == "cuda" and config.rollout_engine == "hf":  # vLLM is not installed
                    name = f"step {method} (hf rollouts)"
                check = (Check(name, "OK", format_step(record)) if finite else
                         Check(name, "FAIL", f"non-finite loss or gradient norm: {format_step(record)}",
                               "report it"))
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
            model_dir = build_shaped_model(shape, cache_dir,
                                           dtype="bfloat16" if device.type == "cuda" else "float32")
        emit(Check("model", "OK", f"Qwen3 layers of shape {shape!r} ({asdict(SHAPES[shape])}), random "
                                  "weights, embedded tokenizer; built or found in "
                                  f"{time.perf_counter() - t0:.0f} s"))
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
