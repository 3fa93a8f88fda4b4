"""The rollout engines in ``dppo doctor --gpu`` (:mod:`dppo_core.tools.gpu_check`): how far each engine's
log-probs are from the training forward's, and what ``rollout_correction`` would weigh them by
(:func:`correction_summary`).

    rollout correction (hf)  the transformers engine against the update (:func:`check_rollout_correction`).
    vllm                     an engine colocated with the trainer (:func:`check_vllm`): the memory it takes
                             and gives back asleep (CUDA), full-weight and LoRA-adapter sync measured as the
                             log-prob mismatch after a sync, against a stale engine (weights moved by
                             :func:`perturb`) as the control.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from dppo_core.tools.bench.systems import GiB, free_cuda
from dppo_core.tools.doctor import Check, describe_error, quiet


def correction_summary(model: torch.nn.Module, batch, cap: float = 2.0) -> tuple[float, str]:
    """The engine's mismatch on ``batch`` and what ``rollout_correction`` would do with it: (mean token
    weight, one line with max |log π − log μ| and, per level, the mean weight and the share of tokens
    truncated at C)."""
    from dppo_core.grpo import truncated_importance_weights
    from dppo_core.rollout import completion_logprobs

    train = completion_logprobs(model, batch)
    rows = [(lp.float().cpu(), torch.tensor(c.logprobs, dtype=torch.float32))
            for g, lps in zip(batch.groups, train, strict=True)
            for c, lp in zip(g.completions, lps, strict=True)
            if c.length]
    logp = torch.nn.utils.rnn.pad_sequence([r[0] for r in rows], batch_first=True)
    mu = torch.nn.utils.rnn.pad_sequence([r[1] for r in rows], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r[0])) for r in rows], batch_first=True).bool()
    parts = [f"max |log π − log μ| {(logp - mu).abs()[mask].max().item():.2e} over {int(mask.sum())} tokens"]
    means = {}
    for level in ("token", "sequence"):
        w = truncated_importance_weights(logp, mu, cap, level=level, mask=mask)[mask]
        means[level] = w.mean().item()
        parts.append(f"{level} weights mean {means[level]:.4f}, {(w >= cap).float().mean().item():.1%} "
                     f"truncated at C={cap:g}")
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
    return Check("rollout correction (hf)", "OK" if ok else "FAIL",
                 f"{str(dtype).removeprefix('torch.')}: {detail}",
                 "" if ok else "the rollout's log-probs are far from the update's: set "
                               "rollout_correction=token and report this line")


def _prompts(n: int) -> list[list[dict[str, str]]]:
    from dppo_core.tasks import ArithmeticTask

    return [p.messages() for p in ArithmeticTask().test_set(1)[:n]]


def perturb(model: torch.nn.Module, scale: float = 0.02, seed: int = 1) -> None:
    """Move every weight by N(0, scale²): what an optimizer step does, exaggerated so a stale engine shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))


def check_vllm(model_dir: str | Path, device: torch.device) -> list[Check]:
    """A colocated engine: memory, sleep/wake (CUDA), full-weight and LoRA sync measured by log-prob
    mismatch."""
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
                                "" if released >= 0.5 * taken else "vLLM's sleep mode is not releasing "
                                "memory: check vllm's version (enable_sleep_mode needs CUDA)"))
        else:
            checks.append(Check("vllm sleep/wake", "SKIP",
                                "sleep mode needs CUDA (on CPU the engine stays awake)"))
        in_step = logprob_mismatch(model, batch)
        perturb(model)
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
                            f"any update, {stale.mean_abs:.1e} after an update without sync, "
                            f"{synced.mean_abs:.1e} after a {sync_s:.2f} s sync (max {synced.max_abs:.1e}, "
                            f"{synced.num_tokens} tokens)",
                            "" if ok else "weights do not reach the engine: report this line"))
        engine.close()
        engine = None
        del model
        free_cuda()
        checks.append(_check_vllm_lora(model_dir, device, dtype, tol, sampling, prompts, kwargs))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check("vllm", "FAIL", f"crashed ({describe_error(exc)})",
                            "run `dppo doctor` for vLLM's install"))
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
