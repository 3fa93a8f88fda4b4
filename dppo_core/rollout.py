"""Rollout engines: sample G completions per prompt, return them in one structure, keep them in sync.

The trainer and the evaluator see only :class:`RolloutBatch` and two methods, ``generate`` and ``sync``;
which engine sits behind them does not matter.

- :class:`HFRollout`: the training model itself, batched, CPU or GPU. Always available; the reference for
  correctness. Its default loop drops a sequence from the batch (and the KV cache) as soon as it ends, so a
  rollout costs what its tokens cost; ``decode="generate"`` runs transformers ``generate`` instead, with
  the same samples for the same seed.
- :class:`~dppo_core.engines.vllm.VLLMRollout` (import it from :mod:`dppo_core.engines.vllm`, which imports
  vLLM only when an engine starts): vLLM colocated in the training process (in-process engine, no worker
  processes), ``n = G`` samples per prompt request. After each optimizer step ``sync(model)`` pushes the new
  policy into it: full weights through ``reload_weights`` (validated first, restored on failure), or the LoRA
  adapter as a new ``LoRARequest``. On a GPU it sleeps between rollouts so training gets the memory back.
- :func:`make_rollout_engine` picks one (``"auto"``: vLLM when it imports and starts, else transformers,
  with one warning).

Train/inference mismatch. The engine samples token :math:`y_t` from its own copy of the policy,
:math:`\\mu(y_t) = \\mathrm{softmax}(z^{\\text{engine}}_t / T)`, while the trainer computes
:math:`\\pi(y_t) = \\mathrm{softmax}(z^{\\text{train}}_t / T)`. Different kernels, precisions and batch
shapes make :math:`\\log\\pi - \\log\\mu \\ne 0` even with identical weights. :func:`logprob_mismatch`
measures it; :func:`truncated_importance_weights` gives the TIS correction
:math:`w_t = \\min(\\exp(\\log\\pi_t - \\log\\mu_t), C)`, which the trainer multiplies into the loss
(``rollout_correction``; on by default with vLLM).

Departures from what TRL / verl do, and why:
1. Log-probs returned by both engines are of the *processed* sampling distribution (after temperature and
   top-p), which is what the TIS ratio needs; vLLM's default is the raw distribution, so the engine is
   started with ``logprobs_mode="processed_logprobs"``.
2. Seeds: prompt ``i`` of a call with seed ``s`` gets its own seed ``mix(s, i)`` (numpy ``SeedSequence``)
   and vLLM gives its G samples ``mix(s, i) + j``, so every sample has its own stream (one shared seed
   would give two copies of a prompt identical samples; ``s + i`` would make calls with seeds ``s`` and
   ``s + 1`` share samples) and a call is reproducible as a whole. HF and vLLM use different random
   number generators: the same seed gives the same samples within an engine, not across engines.
3. Text is decoded by our tokenizer in both engines (vLLM's detokenizer is switched off), so the two
   return byte-identical text for identical token ids.
4-5. The vLLM engine's own (weight-push validation; no prompt log-probs with LoRA on CPU) are in
   :mod:`dppo_core.engines.vllm`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from dppo_core.engines.hf import (
    HFRollout,
    LogprobMismatch,
    completion_logprobs,
    logprob_mismatch,
    sequence_logprobs,
)
from dppo_core.engines.types import (
    Completion,
    Prompt,
    RolloutBatch,
    RolloutEngine,
    RolloutGroup,
    SamplingConfig,
    base_model,
    is_peft_model,
)
from dppo_core.grpo import truncated_importance_weights

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["Completion", "HFRollout", "LogprobMismatch", "Prompt", "RolloutBatch", "RolloutEngine",
           "RolloutGroup", "SamplingConfig", "completion_logprobs", "is_peft_model", "logprob_mismatch",
           "make_rollout_engine", "sequence_logprobs", "truncated_importance_weights"]


def _model_path_of(model: Any) -> str | None:
    if model is None:
        return None
    return getattr(getattr(base_model(model), "config", None), "_name_or_path", None) or None


def make_rollout_engine(
    kind: Literal["auto", "hf", "vllm"] = "auto",
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    model_path: str | Path | None = None,
    lora: bool | None = None,
    require: bool = False,
    **engine_kwargs: Any,
) -> RolloutEngine:
    """Build a rollout engine (:class:`HFRollout` or :class:`~dppo_core.engines.vllm.VLLMRollout`); the
    trainer then only calls ``generate`` and ``sync``.

    Args:
        kind: ``"hf"`` (transformers), ``"vllm"``, or ``"auto"`` (vLLM when it imports and starts, else
            transformers).
        model: the training model (needed for ``"hf"`` and for the fallback; also tells ``model_path``
            and ``lora`` when they are not given).
        tokenizer: the training tokenizer (loaded from ``model_path`` when missing).
        model_path: checkpoint directory vLLM starts from; default: where ``model`` was loaded from.
        lora: serve LoRA adapters in vLLM; default: whether ``model`` is a PEFT model.
        require: with ``kind="vllm"``, raise if vLLM is missing or fails to start, instead of falling back
            to transformers with a warning.
        **engine_kwargs: passed to :class:`~dppo_core.engines.vllm.VLLMRollout` (e.g. ``max_lora_rank``,
            ``kv_cache_memory_bytes``).
    """
    if kind not in ("auto", "hf", "vllm"):
        raise ValueError(f"kind must be 'auto', 'hf' or 'vllm', got {kind!r}")
    model_path = model_path or _model_path_of(model)
    if tokenizer is None:
        if model_path is None:
            raise ValueError("pass tokenizer=, or model_path= to load it from")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        tokenizer.padding_side = "left"

    def fallback() -> HFRollout:
        nonlocal model
        if model is None:
            if model_path is None:
                raise ValueError("pass model= (or model_path= to load it from) for the transformers engine")
            from dppo_core.models import load_model

            model, _ = load_model(model_path)
        return HFRollout(model, tokenizer)

    if kind == "hf":
        return fallback()
    if model_path is None:
        raise ValueError("vLLM needs model_path= (the checkpoint directory), or a model loaded from one")
    if lora is None:
        lora = is_peft_model(model)
    if lora and "max_lora_rank" not in engine_kwargs and is_peft_model(model):
        # vLLM serves LoRA adapters: each config is a LoraConfig
        engine_kwargs["max_lora_rank"] = max(cast("LoraConfig", c).r for c in model.peft_config.values())
    try:
        from dppo_core.engines.vllm import VLLMRollout

        return VLLMRollout(model_path, tokenizer, lora=lora, **engine_kwargs)
    except Exception as err:  # ImportError or any start failure: fall back or re-raise
        if kind == "vllm" and require:
            raise RuntimeError(f"vLLM was required (require=True) but could not start: {type(err).__name__}: "
                               f"{err}") from err
        warnings.warn(f"vLLM could not start ({type(err).__name__}: {err}); falling back to transformers "
                      "(HFRollout), which on a GPU is slower. Pass kind='vllm', require=True to raise "
                      "instead.", RuntimeWarning, stacklevel=2)
        return fallback()

