"""``DPPOTrainer``: the training loop — select prompts, roll out, reward, advantages, update, sync, log.

One step, as data (DESIGN.md section 3; pruning and packing plug in where marked by later chapters):

    prompts ──engine.generate (G each)──► completions ──reward functions──► rewards (P, G)
    rewards ──group_advantages──► A (P, G) ──policy_loss × weights, micro-batched──► optimizer step
    optimizer step ──engine.sync(model)──► the engine samples from the new policy next step

Reproducibility: the prompts and the sampling seed of step ``s`` are functions of ``(seed, s)``, and a
checkpoint holds the weights, optimizer state and step; so a run interrupted and resumed from a
checkpoint takes the same steps as one that was not (on CPU with ``deterministic=True``).

Departures from TRL's GRPOTrainer, and why:
1. One optimizer step per PPO epoch over the whole rollout batch (micro-batches accumulate
   gradients), instead of TRL's steps per micro-batch: the loss normaliser is then the full batch's
   (see :mod:`dppo_core.grpo`), which keeps the pruned estimator of later chapters unbiased.
2. Old log-probs are computed only when ``num_iterations > 1``; with one epoch the ratio is 1.
3. The reference policy for the KL term is the LoRA base with its adapter disabled (no second model);
   only full fine-tuning keeps a frozen copy, and only when ``beta > 0``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.distributed import (
    all_gather_objects,
    all_reduce_gradients,
    all_reduce_max,
    barrier,
    broadcast_parameters,
    init_distributed,
    shard,
)
from dppo_core.grpo import group_advantages, policy_loss, token_logprobs
from dppo_core.pruning import PromptHistory
from dppo_core.rollout import RolloutBatch, SamplingConfig
from dppo_core.tasks import ArithmeticTask, Problem

Callback = Callable[[dict[str, Any]], None]
CHECKPOINT_PREFIX = "checkpoint-"


# --------------------------------------------------------------------------------------------------
# Data: the prompts a step samples from
# --------------------------------------------------------------------------------------------------


class PromptSource:
    """Rows with ``prompt`` (chat messages), ``answer`` and ``id``; a step's prompts are a function of (seed, step)."""

    def __init__(self, rows: Sequence[dict[str, Any]], weights: Sequence[float] | None = None):
        if not rows:
            raise ConfigError("the training dataset is empty: give a task or a jsonl file with at least one row")
        self.rows = list(rows)
        self.weights = list(weights) if weights is not None else None

    def sample(self, seed: int, step: int, n: int) -> list[dict[str, Any]]:
        rng = random.Random(f"prompts:{seed}:{step}")
        return rng.choices(self.rows, weights=self.weights, k=n)

    def pool(self, size: int) -> PromptSource:
        """The first ``size`` rows of one fixed weighted shuffle, as a source sampled uniformly.

        The shuffle is a weighted random permutation (Efraimidis-Spirakis keys log(u) / w, largest first)
        under a fixed seed: the pool is the same for every run seed and method, holds the levels in about
        the proportions of the weights, and a smaller pool is a prefix of a larger one. Rows of weight 0
        are never drawn.
        """
        weights = self.weights or [1.0] * len(self.rows)
        eligible = sum(w > 0 for w in weights)
        if not 1 <= size <= eligible:
            raise ConfigError(f"train_pool_size={size}: the training set has {eligible} prompts"
                              f"{' with non-zero weight' if eligible < len(self.rows) else ''}; give 1 to "
                              f"{eligible}, or null for the whole set")
        rng = random.Random("train-pool")
        keys = [math.log(1.0 - rng.random()) / w if w > 0 else -math.inf for w in weights]
        order = sorted(range(len(self.rows)), key=keys.__getitem__, reverse=True)
        return PromptSource([self.rows[i] for i in order[:size]])


def prompt_key(row: dict[str, Any]) -> str:
    """The id a prompt's history is stored under: the row's ``id``, else its messages as JSON."""
    return str(row["id"]) if row.get("id") is not None else json.dumps(row["prompt"], sort_keys=True)


@dataclass
class PromptSelection:
    """The prompts a step rolls out, drawn from a window of candidates with known inclusion probabilities."""

    rows: list[dict[str, Any]]  # the kept prompts, sent to the rollout engine
    probs: torch.Tensor  # (len(rows),) pi_q of each kept prompt
    window: int  # |B|: the number of candidate prompts the step's objective is over
    indices: list[int]  # position of each kept prompt in the window


def build_prompt_source(config: DPPOConfig) -> PromptSource:
    """The training prompts of ``config.task``; with ``train_pool_size``, the fixed pool of that many."""
    if config.task == "arithmetic":
        task = ArithmeticTask(config.train_levels)
        rows, weights = [], []
        level_w = config.level_weights or [1.0] * len(task.levels)
        for level, w in zip(task.levels, level_w, strict=True):
            problems: list[Problem] = task.train(level)
            rows.extend(p.to_record() for p in problems)
            weights.extend([w / len(problems)] * len(problems))
        source = PromptSource(rows, weights)
    else:
        from dppo_core.tasks import load_benchmark

        records = load_benchmark(config.task)
        if not records:
            raise ConfigError(f"task={config.task!r} has no rows; give a jsonl file with at least one "
                              "problem/answer row, or task='arithmetic'")
        rows = [{"id": r.id, "prompt": [{"role": "user", "content": r.problem}], "answer": r.answer} for r in records]
        source = PromptSource(rows)
    return source.pool(config.train_pool_size) if config.train_pool_size is not None else source


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def resolve_model_path(config: DPPOConfig) -> str:
    if config.model == "tiny":
        from dppo_core.models import warm_start

        return str(warm_start())
    path = Path(config.model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model={config.model!r} is a directory without config.json; pass the directory "
                              "that save_pretrained wrote, a Hub id, or 'tiny'")
        return str(path)
    if config.model.startswith((".", "/", "~")):
        raise ConfigError(f"model={config.model!r} does not exist; pass a model directory, a Hub id, or 'tiny'")
    return config.model  # a Hub id


def disable_4bit_cpu_bf16_path(model: torch.nn.Module) -> int:
    """Work around bitsandbytes' CPU 4-bit kernel losing autograd after an eval-mode forward.

    bitsandbytes 0.50 repacks 4-bit weights for its AVX512-BF16 inference kernel on the first no-grad
    forward (e.g. ``generate``); the training path then has no autograd kernel and LoRA silently stops
    learning. Turning that fast path off on every ``Linear4bit`` keeps training correct. Returns the
    number of modules changed.
    """
    n = 0
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def check_causal(model: torch.nn.Module, model_path: str) -> None:
    """Refuse a model whose first position sees the second (e.g. BERT loaded as ``BertLMHeadModel``).

    AutoModelForCausalLM accepts some encoders without an error; training one would be silently wrong.
    """
    device = next(model.parameters()).device
    with torch.no_grad():  # one call per sequence: same shapes and kernels, so a causal model gives equal rows
        first = [model(input_ids=torch.tensor([[1, t]], device=device), use_cache=False).logits[0, 0].float()
                 for t in (2, 3)]
    if (first[0] - first[1]).abs().max() > 1e-4 * torch.stack(first).abs().max() + 1e-6:
        raise ConfigError(f"model={model_path!r} ({type(model).__name__}) is not causal: its output at a position "
                          "depends on later tokens; pass a decoder-only causal LM (e.g. Qwen3)")


def load_policy(config: DPPOConfig, model_path: str, device: torch.device):
    """The trainable policy for ``config.update_mode`` and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_core.models import quiet_transformers

    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model={model_path!r}: its tokenizer or config could not be loaded ({exc}); pass "
                              "a directory written by save_pretrained, a Hub id, or 'tiny'") from exc
        tokenizer.padding_side = "left"
        kwargs: dict[str, Any] = {"dtype": torch.float32 if device.type == "cpu" else torch.bfloat16}
        if config.update_mode in ("qlora4", "qlora8"):
            from transformers import BitsAndBytesConfig

            if config.update_mode == "qlora4":
                kwargs["quantization_config"] = BitsAndBytesConfig(
                    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=kwargs["dtype"])
            else:
                kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
            if device.type == "cuda":
                kwargs["device_map"] = {"": device.index or 0}
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model={model_path!r} could not be loaded as a causal LM: {str(exc).splitlines()[0]}; pass a "
                              "decoder-only model (e.g. Qwen3) saved with save_pretrained, or 'tiny'") from exc
    if "quantization_config" not in kwargs:
        model.to(device)
        check_causal(model, model_path)
    if config.update_mode == "full":
        return model, tokenizer
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if config.update_mode == "qlora4" and device.type == "cpu":
        disable_4bit_cpu_bf16_path(model)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------
# The update's forward pass
# --------------------------------------------------------------------------------------------------


@dataclass
class Sequences:
    """The completions an update trains on (flattened over prompts), with their per-sequence terms."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: torch.Tensor  # (N,)
    weights: torch.Tensor  # (N,) 1 for GRPO; 1 / keep probability for DPPO
    num_sequences: int  # |B| G: the normaliser of grpo / dr_grpo (the full candidate batch)
    pruned_tokens: int = 0  # completion tokens rolled out but not trained on
    origin: list[tuple[int, int]] | None = None  # (group, completion) in the rollout batch of each sequence
    # data parallel: this rank holds a share of the step's sequences; these are the whole step's totals
    total_tokens: int | None = None
    total_rolled_out_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    @property
    def rolled_out_tokens(self) -> int:
        """Completion tokens of every rolled-out completion, kept or pruned: the ``dapo`` normaliser.

        Dividing by the kept tokens instead would inflate a pruned loss by 1 / (kept share); with this
        count ``dapo`` stays unbiased under completion pruning (still a ratio estimator under prompt
        pruning, since the tokens of prompts never rolled out are unknown).
        """
        return self.num_tokens + self.pruned_tokens

    @property
    def global_num_tokens(self) -> int:
        return self.num_tokens if self.total_tokens is None else self.total_tokens

    @property
    def global_rolled_out_tokens(self) -> int:
        return self.rolled_out_tokens if self.total_rolled_out_tokens is None else self.total_rolled_out_tokens


def completion_logprobs_with_grad(model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                                  temperature: float, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion given its prompt, padded to (N, T_max), and the mask.

    Sequences are right-padded into one (N, L) batch; the logits at position t predict token t+1.
    """
    device = next(model.parameters()).device
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(lengths)
    t_max = max(len(c) for c in completion_ids)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)  # (N, L)
    attn = torch.zeros_like(ids)
    gather_pos = torch.zeros((len(lengths), t_max), dtype=torch.long)  # (N, T) positions predicting each token
    targets = torch.full((len(lengths), t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), t_max))
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        seq = list(p) + list(c)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        gather_pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        targets[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        mask[i, : len(c)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits  # (N, L, V)
    picked = logits.gather(1, gather_pos.to(device)[..., None].expand(-1, -1, logits.shape[-1]))  # (N, T, V)
    return token_logprobs(picked, targets.to(device), temperature), mask.to(device)


# --------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------


class DPPOTrainer:
    """Runs the loop of DESIGN.md section 3 for a :class:`DPPOConfig`.

    Args:
        config: the run's settings.
        reward_funcs: TRL-style reward functions ``fn(prompts, completions, **columns) -> list[float]``,
            summed; default: :func:`dppo_core.rewards.accuracy_reward` (1 if the boxed answer is right).
        callbacks: called with each step's metrics dict (and with ``{"event": "eval", ...}`` after each
            evaluation), e.g. to draw live curves in a notebook.
        prompt_source: override the prompts (default: from ``config.task``).
    """

    def __init__(self, config: DPPOConfig, *, reward_funcs: Sequence[Callable] | None = None,
                 callbacks: Sequence[Callback] = (), prompt_source: PromptSource | None = None,
                 progress: bool = True):
        from dppo_core.rewards import accuracy_reward

        self.config = config
        self.reward_funcs = list(reward_funcs) if reward_funcs else [accuracy_reward]
        self.callbacks = list(callbacks)
        self.output_dir = Path(config.output_dir)
        if config.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        # data parallel when launched by torchrun / accelerate launch (WORLD_SIZE > 1): see dppo_core.distributed
        self.dist = init_distributed(config.device)
        self.progress = progress and self.dist.is_main
        self.device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if config.device == "auto" else config.device))
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        torch.manual_seed(config.seed)
        self.model_path = resolve_model_path(config)
        self.model, self.tokenizer = load_policy(config, self.model_path, self.device)
        self.prompts = prompt_source or build_prompt_source(config)
        base_config = (self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model).config
        self.context_length = getattr(base_config, "max_position_embeddings", None)
        if self.context_length and config.max_completion_length >= self.context_length:
            raise ConfigError(f"max_completion_length={config.max_completion_length}: the model's context is "
                              f"{self.context_length} tokens, which must hold the prompt too; lower it")
        self.ref_model = None
        if config.beta > 0 and config.update_mode == "full":
            from dppo_core.models import load_model

            self.ref_model, _ = load_model(self.model_path, device=self.device)
            self.ref_model.requires_grad_(False).eval()
        params = [p for p in self.model.parameters() if p.requires_grad]
        broadcast_parameters(params, self.dist)  # every rank starts from rank 0's trainable weights
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(0.9, 0.99),
                                           weight_decay=config.weight_decay)
        self.step = 0
        self.engine = None
        self._tb = None
        self._stop_requested = False
        self._reward_means: dict[str, float] = {}
        self._prompt_lengths: dict[str, int] = {}
        self.history = PromptHistory()  # what each prompt's last rollouts showed (prompt pruning reads it)

    # --- helpers ----------------------------------------------------------------------------------
    def _lr(self, step: int) -> float:
        c = self.config
        return c.learning_rate * min(1.0, (step + 1) / c.warmup_steps) if c.warmup_steps else c.learning_rate

    def _make_engine(self):
        from dppo_core.rollout import make_rollout_engine

        kind = self.config.rollout_engine
        if kind == "hf":
            return make_rollout_engine("hf", model=self.model, tokenizer=self.tokenizer)
        # "vllm" demands vLLM (an error if it cannot start); "auto" falls back to transformers with a warning
        return make_rollout_engine(kind, model=self.model, tokenizer=self.tokenizer, model_path=self.model_path,
                                   require=kind == "vllm", seed=self.config.seed)

    def _emit(self, record: dict[str, Any], filename: str = "metrics.jsonl") -> None:
        if not self.dist.is_main:  # data parallel: rank 0 logs for the job
            return
        # one write of one whole line, handed to the OS at once (the file is closed, hence flushed, per
        # record): a crash loses at most the line being written, and a cut-off last line is dropped on resume
        with open(self.output_dir / filename, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(("eval/" if filename != "metrics.jsonl" else "train/") + k, v,
                                        record.get("step", self.step))
        for cb in self.callbacks:
            cb(record)

    # --- one step ---------------------------------------------------------------------------------
    def select_prompts(self, step: int, candidates: list[dict[str, Any]] | None = None) -> PromptSelection:
        """The step's candidate window and which of its prompts to roll out (prompt pruning, before rollout).

        Without prompt pruning: ``prompts_per_step`` prompts, all kept. With it, each candidate q gets an
        inclusion probability pi_q from its history (``dppo``) or the GRESO skip rule (``greso``) and is
        kept by an independent draw (or a fixed-size one); with ``dense_prompts`` the window extends
        ahead in the dataset until about ``prompts_per_step`` prompts are expected to be kept.
        ``candidates`` replaces the dataset's draw for this step (the window is then exactly these).
        """
        from dppo_core import pruning

        c = self.config
        k = c.prompts_per_step
        if candidates is not None:
            stream, k = list(candidates), len(candidates)
            dense = False
        else:
            dense = c.dense_prompts
            n = k * (c.prompt_window_factor if dense else 1)
            stream = self.prompts.sample(c.seed, step, n if c.pruning in ("dppo", "greso") else k)
        if c.pruning not in ("dppo", "greso") or c.prompt_prune_rate == 0:
            rows = stream[:k]
            ones = torch.ones(k, dtype=torch.float64)
            return PromptSelection(rows, ones, k, list(range(k)))
        ids = [prompt_key(r) for r in stream]

        def probs_for(ids_, budget=None):
            if c.pruning == "greso":
                return pruning.greso_keep_probs(self.history, ids_, c.prompt_prune_rate, step=step,
                                                max_age=c.history_max_age)
            return pruning.prompt_keep_probs(self.history, ids_, c.prompt_prune_rate, scheme=c.prompt_scheme,
                                             min_keep_prob=c.min_prompt_keep_prob, step=step,
                                             max_age=c.history_max_age, budget=budget)

        probs = probs_for(ids)
        window = k
        if dense:
            window = pruning.dense_window(probs, k)
            # DPPO: rescale the window's probabilities so that exactly k prompts are expected
            probs = probs_for(ids[:window], budget=k if c.pruning == "dppo" else None)
        keep = pruning.sample_keep(probs, pruning.step_generator(c.seed, step, "prompts"), c.fixed_size_sampling)
        kept = keep.nonzero().flatten().tolist()
        return PromptSelection([stream[i] for i in kept], probs[kept], window, kept)

    def rollout(self, step: int, rows: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], RolloutBatch]:
        """Sample ``num_generations`` completions for each prompt of ``rows`` (default: the step's selection)."""
        c = self.config
        if rows is None:
            rows = self.select_prompts(step).rows
        if self.context_length:
            from dppo_core.models import encode_prompt

            limit = self.context_length - c.max_completion_length
            for r in rows:
                key = prompt_key(r)
                if key not in self._prompt_lengths:  # each prompt is tokenised for this check once per run
                    self._prompt_lengths[key] = len(encode_prompt(self.tokenizer, r["prompt"]))
                n = self._prompt_lengths[key]
                if n > limit:
                    raise ConfigError(f"prompt {r.get('id')!r} has {n} tokens, more than the model's context "
                                      f"({self.context_length}) minus max_completion_length "
                                      f"({c.max_completion_length}); shorten or drop it, or lower max_completion_length")
        seed = (c.seed * 1_000_003 + step) % (2**31)
        if self.dist.rank:  # each rank samples its own prompts from its own stream
            seed = int(np.random.SeedSequence([seed, self.dist.rank]).generate_state(1)[0]) >> 1
        sampling = SamplingConfig(max_tokens=c.max_completion_length, temperature=c.temperature, top_p=c.top_p,
                                  seed=seed)
        return rows, self.engine.generate([r["prompt"] for r in rows], c.num_generations, sampling)

    def score(self, rows: list[dict[str, Any]], batch: RolloutBatch) -> torch.Tensor:
        """Rewards of shape (P, G): the sum of the reward functions."""
        g = self.config.num_generations
        prompts = [r["prompt"] for r in rows for _ in range(g)]
        completions = [c.text for grp in batch.groups for c in grp.completions]
        columns = {k: [r[k] for r in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
        total = torch.zeros(len(completions))
        self._reward_means = {}
        for fn in self.reward_funcs:
            try:
                scores = fn(prompts=prompts, completions=completions, **columns)
            except Exception as exc:
                raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} raised {type(exc).__name__}: "
                                 f"{exc}; it is called as fn(prompts, completions, **columns) with columns "
                                 f"{sorted(columns)}, and must return one float per completion") from exc
            if len(scores) != len(completions):
                raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned {len(scores)} "
                                 f"scores for {len(completions)} completions")
            values = torch.tensor([math.nan if s is None else float(s) for s in scores])
            if not torch.isfinite(values).all():
                raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned a NaN or infinite "
                                 "score; return a finite float for every completion")
            total += values
            self._reward_means[f"reward_{getattr(fn, '__name__', 'fn')}"] = values.mean().item()
        return total.view(len(rows), g)

    def build_sequences(self, batch: RolloutBatch, advantages: torch.Tensor,
                        selection: PromptSelection | None = None, step: int | None = None,
                        group_offset: int = 0) -> Sequences:
        """The completions to train on, with their weights and the loss normaliser (completion pruning).

        ``none``: every completion, weight 1, normaliser P*G. ``dppo``: completion (q, i) is kept with
        p_qi from |A| (:func:`dppo_core.pruning.completion_keep_probs`) and weighted 1 / (pi_q p_qi); the
        normaliser is |B|*G over the whole candidate window, so the loss is an unbiased estimate of the
        full-batch GRPO loss. ``cppo``: the top-k by |A| per group, weight 1, normalised by the number
        kept (biased). ``greso``: every completion of the kept prompts, weight 1 (biased).
        Completions without tokens have a zero loss and are skipped.

        Data parallel: ``advantages`` (and ``selection``) cover the whole step, so the keep draws are those
        of a single process; ``batch`` holds this rank's groups, rows ``group_offset ...`` of ``advantages``.
        """
        from dppo_core import pruning

        c = self.config
        num_prompts, g = advantages.shape
        step = self.step if step is None else step
        prompt_probs = selection.probs if selection is not None else torch.ones(num_prompts, dtype=torch.float64)
        window = selection.window if selection is not None else num_prompts
        weights = torch.ones(num_prompts, g, dtype=torch.float64)
        keep = torch.ones(num_prompts, g, dtype=torch.bool)
        num_sequences = num_prompts * g
        if c.pruning == "dppo":
            if c.completion_prune_rate > 0 or (c.drop_zero_advantage and c.beta == 0):
                probs = pruning.completion_keep_probs(
                    advantages, c.completion_prune_rate, scheme=c.completion_scheme,
                    min_keep_prob=c.min_completion_keep_prob, beta=c.beta, drop_zero=c.drop_zero_advantage)
            else:
                probs = torch.ones(num_prompts, g, dtype=torch.float64)
            keep = pruning.sample_keep(probs, pruning.step_generator(c.seed, step, "completions"),
                                       c.fixed_size_sampling)
            weights = pruning.importance_weights(prompt_probs, probs, keep)
            num_sequences = window * g
        elif c.pruning == "cppo":
            keep = pruning.cppo_keep(advantages, c.completion_prune_rate)
            num_sequences = int(keep.sum())
        prompt_ids, completion_ids, adv, w, origin = [], [], [], [], []
        pruned_tokens = 0
        for gi, grp in enumerate(batch.groups, start=group_offset):
            for ci, comp in enumerate(grp.completions):
                if not keep[gi, ci] or not comp.token_ids:
                    pruned_tokens += len(comp.token_ids)
                    continue
                prompt_ids.append(grp.prompt_ids)
                completion_ids.append(comp.token_ids)
                adv.append(advantages[gi, ci].item())
                w.append(float(weights[gi, ci]))
                origin.append((gi, ci))
        return Sequences(prompt_ids, completion_ids, torch.tensor(adv), torch.tensor(w, dtype=torch.float32),
                         num_sequences=num_sequences, pruned_tokens=pruned_tokens, origin=origin)

    @contextlib.contextmanager
    def _reference(self):
        """Yields a callable giving reference log-probs: the base with the adapter off, or the frozen copy."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.model.disable_adapter():
                yield self.model

    def micro_batches(self, seqs: Sequences) -> tuple[list[list[int]], Callable, dict[str, float]]:
        """Split the sequences into micro-batches; returns their indices, a forward ``f(model, k)`` and layout stats.

        Padded (default): ``micro_batch_size`` sequences per micro-batch, sorted by length so that
        neighbours waste little padding. Packed (``packing: true``): whole sequences back to back in rows of
        at most ``max_tokens_per_row`` tokens (:mod:`dppo_core.packing`), ``packing_rows_per_micro_batch``
        rows per micro-batch, with a block-diagonal attention mask. The loss is a sum over sequences with
        a constant normaliser, so either layout gives the same loss and gradient.
        """
        c = self.config
        pad = self.tokenizer.pad_token_id
        lengths = [len(p) + len(q) for p, q in zip(seqs.prompt_ids, seqs.completion_ids, strict=True)]
        # micro-batches of similar lengths waste less padding (the loss is a sum, so the order is free)
        order = sorted(range(len(seqs)), key=lambda i: lengths[i])
        padded = [order[i : i + c.micro_batch_size] for i in range(0, len(order), c.micro_batch_size)]
        padded_capacity = sum(len(idx) * max(lengths[i] for i in idx) for idx in padded)
        real = sum(lengths)
        if not c.packing:
            def forward(m, k):
                idx = padded[k]
                return completion_logprobs_with_grad(m, [seqs.prompt_ids[i] for i in idx],
                                                     [seqs.completion_ids[i] for i in idx], c.temperature, pad)

            return padded, forward, {"update_rows": len(seqs), "update_capacity": padded_capacity,
                                     "update_density": real / max(1, padded_capacity), "padding_avoided": 0}
        from dppo_core.packing import PackSequence, pack_micro_batches, packed_completion_logprobs

        items = [PackSequence(list(p), list(q), 1.0) for p, q in zip(seqs.prompt_ids, seqs.completion_ids, strict=True)]
        packed = pack_micro_batches(items, c.max_tokens_per_row, c.packing_rows_per_micro_batch,
                                    window=c.packing_window, oversize="own_row", pad_id=pad)

        def forward(m, k):
            return packed_completion_logprobs(m, packed[k][1], c.temperature)

        capacity = sum(b.capacity for _, b in packed)
        return [idx for idx, _ in packed], forward, {
            "update_rows": sum(b.num_rows for _, b in packed), "update_capacity": capacity,
            "update_density": real / max(1, capacity), "padding_avoided": padded_capacity - capacity}

    def update(self, seqs: Sequences) -> dict[str, float]:
        """One optimizer step per PPO epoch over ``seqs`` (micro-batches accumulate gradients).

        Data parallel: each rank backpropagates its share (possibly none) with the step's global
        normalisers, the gradients are summed over ranks before clipping, and the stats are the job's.
        """
        c = self.config
        model = self.model
        t_pack = time.perf_counter()
        mbs, forward, layout = self.micro_batches(seqs)
        layout["time_pack"] = time.perf_counter() - t_pack  # micro-batch layout (padding or packing)
        old, ref = {}, {}
        with torch.no_grad():
            if c.num_iterations > 1:
                model.eval()
                for k in range(len(mbs)):
                    old[k] = forward(model, k)[0]
            if c.beta > 0:
                with self._reference() as ref_model:
                    ref_model.eval()
                    for k in range(len(mbs)):
                        ref[k] = forward(ref_model, k)[0]
        model.train()
        stats = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0}
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr(self.step)
        for _epoch in range(c.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for k, idx in enumerate(mbs):
                logp, mask = forward(model, k)
                loss, st = policy_loss(
                    logp, seqs.advantages[idx].to(logp.device), mask, old_logprobs=old.get(k), ref_logprobs=ref.get(k),
                    weights=seqs.weights[idx].to(logp.device), beta=c.beta, epsilon=c.epsilon,
                    epsilon_high=c.epsilon_high, loss_type=c.loss_type, num_sequences=seqs.num_sequences,
                    max_completion_length=c.max_completion_length, num_tokens=seqs.global_rolled_out_tokens)
                loss.backward()
                share = mask.sum().item() / max(1, seqs.global_num_tokens) / c.num_iterations
                stats["loss"] += loss.item() / c.num_iterations
                stats["clip_fraction"] += st["clip_fraction"].item() * share
                stats["kl"] += st["kl"].item() * share
            params = [p for p in model.parameters() if p.requires_grad]
            all_reduce_gradients(params, self.dist)
            norm = torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm if c.max_grad_norm > 0 else float("inf"))
            stats["grad_norm"] += norm.item() / c.num_iterations
            self.optimizer.step()
        stats.update(layout)
        if self.dist.enabled:  # the job's totals: sums over ranks (grad_norm is the same on every rank)
            ranks = all_gather_objects(stats, self.dist)
            summed = {k: sum(r[k] for r in ranks) for k in ("loss", "clip_fraction", "kl", "update_rows",
                                                             "update_capacity", "padding_avoided")}
            real = sum(r["update_density"] * r["update_capacity"] for r in ranks)
            stats.update(summed, update_density=real / max(1, summed["update_capacity"]))
        return stats

    def train_step(self) -> dict[str, Any]:
        """One step: select (prune prompts), roll out, reward, advantages, prune completions, update, sync."""
        from dppo_core.pruning import effective_sample_size

        c = self.config
        zero_stats = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "update_rows": 0,
                      "update_capacity": 0, "update_density": 0.0, "padding_avoided": 0, "time_pack": 0.0}
        t0 = time.perf_counter()
        selection = self.select_prompts(self.step)
        t_select = time.perf_counter() - t0
        record: dict[str, Any] = {"prompts_candidates": selection.window, "prompts_rolled_out": len(selection.rows)}
        if not selection.rows:
            # every candidate was pruned: the estimate of this step's loss is exactly 0 (a valid draw of
            # an unbiased estimator), so there is nothing to roll out or train; the step is counted
            self.step += 1
            record.update(step=self.step, skipped=1, **zero_stats, reward_mean=None, lr=self._lr(self.step - 1),
                          tokens_generated=0, tokens_trained=0, sequences_trained=0, time_prune=t_select,
                          step_time=time.perf_counter() - t0)
            return record
        t1 = time.perf_counter()
        # data parallel: this rank rolls out and scores its contiguous share of the kept prompts (all of
        # them in a single process) and owns those groups
        mine = shard(len(selection.rows), self.dist)
        if len(mine):
            rows, batch = self.rollout(self.step, selection.rows[mine.start : mine.stop])
        else:
            rows, batch = [], RolloutBatch([])
        t2 = time.perf_counter()
        rewards = self.score(rows, batch) if rows else torch.zeros(0, c.num_generations)
        lengths = [c_.length for g in batch.groups for c_ in g.completions]
        reward_means = dict(self._reward_means) if rows else {}
        if self.dist.enabled:  # every rank gets every group's rewards (cheap), in global order
            ranks = all_gather_objects((rewards, lengths, reward_means, len(rows)), self.dist)
            rewards = torch.cat([r[0] for r in ranks])
            lengths = [n for r in ranks for n in r[1]]
            reward_means = {k: sum(r[2].get(k, 0.0) * r[3] for r in ranks) / len(selection.rows)
                            for k in ranks[0][2]}
        adv = group_advantages(rewards, c.scale_rewards)  # per group (one process's numbers on every rank)
        self.history.update([prompt_key(r) for r in selection.rows], rewards, adv, self.step)
        t3 = time.perf_counter()
        seqs = self.build_sequences(batch, adv, selection, group_offset=mine.start)
        weights = seqs.weights
        if self.dist.enabled:
            ranks = all_gather_objects((seqs.num_tokens, seqs.rolled_out_tokens, seqs.pruned_tokens,
                                        seqs.weights), self.dist)
            seqs.total_tokens = sum(r[0] for r in ranks)
            seqs.total_rolled_out_tokens = sum(r[1] for r in ranks)
            pruned_tokens = sum(r[2] for r in ranks)
            weights = torch.cat([r[3] for r in ranks])
        else:
            pruned_tokens = seqs.pruned_tokens
        t4 = time.perf_counter()
        # every rank takes part in the update if any rank has something to train (the gradient all-reduce)
        stats = self.update(seqs) if len(weights) else zero_stats
        t5 = time.perf_counter()
        self.engine.sync(self.model)
        t6 = time.perf_counter()
        self.step += 1
        mean_len = sum(lengths) / len(lengths)
        zero_std = (rewards.std(dim=1) == 0).float().mean().item()
        record.update({
            "step": self.step,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            **reward_means,
            "zero_std_groups": zero_std,
            "completion_length": mean_len,
            "completion_length_max": max(lengths),
            **stats,
            "lr": self._lr(self.step - 1),
            "tokens_generated": sum(lengths),
            "tokens_trained": seqs.global_num_tokens,
            "sequences_trained": len(weights),
            "completions_rolled_out": len(lengths),
            # rollout tokens saved is an estimate (pruned prompts were never generated): this step's mean length
            "tokens_saved_rollout_est": round((selection.window - len(selection.rows)) * c.num_generations * mean_len),
            "tokens_saved_update": pruned_tokens,
            "weight_ess": effective_sample_size(weights) if len(weights) else 0.0,
            "weight_max": float(weights.max()) if len(weights) else 0.0,
            "time_prune": t_select + (t4 - t3), "time_rollout": t2 - t1, "time_reward": t3 - t2,
            "time_update": t5 - t4 - stats["time_pack"], "time_sync": t6 - t5, "step_time": t6 - t0,
        })
        return record

    # --- evaluation -------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Greedy and sampled accuracy on held-out problems of the training levels (embedded task only)."""
        from dppo_core.evaluate import evaluate_task
        from dppo_core.rollout import HFRollout

        c = self.config
        if c.task != "arithmetic":
            return {"step": self.step}
        levels = c.eval_levels or c.train_levels
        task = ArithmeticTask(levels)  # built once per evaluation, not once per level
        problems = [p for lvl in levels for p in task.test(lvl, c.eval_problems_per_level)]
        engine = self.engine if self.engine is not None else HFRollout(self.model, self.tokenizer)
        greedy = evaluate_task(engine, problems, temperature=0.0, max_tokens=c.max_completion_length, seed=c.seed)
        sampled = evaluate_task(engine, problems, temperature=1.0, samples_per_problem=c.eval_samples,
                                max_tokens=c.max_completion_length, seed=c.seed)
        record = {"step": self.step}
        trained = [lvl for lvl in c.train_levels if lvl in levels] or list(levels)
        for name, ev in (("greedy", greedy), ("sampled", sampled)):
            # the headline accuracy is over the trained levels; every evaluated level is logged
            mean, se = ev.mean_over(trained)
            record[f"{name}_accuracy"] = mean
            record[f"{name}_stderr"] = se
            record[f"{name}_steps_share"] = sum(ev.levels[lvl].steps_share for lvl in trained) / len(trained)
            for lvl in levels:
                record[f"{name}_L{lvl}"] = ev.levels[lvl].accuracy
                record[f"{name}_L{lvl}_stderr"] = ev.levels[lvl].stderr
        return record

    # --- checkpoints ------------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        if not self.output_dir.is_dir():
            return []
        found = []
        for d in self.output_dir.glob(f"{CHECKPOINT_PREFIX}*"):
            if d.is_dir() and (d / "trainer_state.json").is_file() and d.name[len(CHECKPOINT_PREFIX):].isdigit():
                found.append(d)
        return sorted(found, key=lambda d: int(d.name[len(CHECKPOINT_PREFIX):]))

    def save_checkpoint(self, keep: int = 2) -> Path:
        """Write model/adapter, optimizer and step to ``checkpoint-<step>`` atomically (temp dir, then rename)."""
        target = self.output_dir / f"{CHECKPOINT_PREFIX}{self.step}"
        if target.exists():
            return target
        # temp dirs of a run killed while writing or deleting a checkpoint: never checkpoints, remove them
        for stale in self.output_dir.glob(f".tmp-{CHECKPOINT_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{CHECKPOINT_PREFIX}", dir=self.output_dir))
        try:
            from dppo_core.models import quiet_transformers

            with quiet_transformers():
                self.model.save_pretrained(tmp / "model")
                self.tokenizer.save_pretrained(tmp / "model")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            state = {"step": self.step, "config": self.config.to_dict(), "model_path": self.model_path,
                     "torch_rng": torch.get_rng_state().tolist()}
            (tmp / "prompt_history.json").write_text(json.dumps(self.history.state_dict()))
            (tmp / "trainer_state.json").write_text(json.dumps(state))
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        for old in self.checkpoints()[:-keep]:
            # moved out of sight first (one atomic rename), then deleted: a crash during the deletion leaves
            # a temp dir, never a half-deleted checkpoint-N that --resume could pick
            trash = Path(tempfile.mkdtemp(prefix=f".tmp-{CHECKPOINT_PREFIX}", dir=self.output_dir))
            with contextlib.suppress(OSError):
                os.rename(old, trash / old.name)
            shutil.rmtree(trash, ignore_errors=True)
        return target

    def load_checkpoint(self, path: Path) -> None:
        state_file = path / "trainer_state.json"
        try:
            state = json.loads(state_file.read_text())
            step = int(state["step"])
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"checkpoint {path} is incomplete or corrupt ({exc}); delete it to resume from "
                              "the one before, or start without --resume") from exc
        history = None  # parsed before any state is loaded, so a corrupt file leaves the trainer as it was
        history_file = path / "prompt_history.json"
        if history_file.is_file():
            try:
                history = PromptHistory.from_state_dict(json.loads(history_file.read_text()))
            except ValueError as exc:
                raise ConfigError(f"checkpoint {path}: prompt_history.json is corrupt ({exc}); delete the "
                                  "checkpoint to resume from the one before") from exc
        from safetensors.torch import load_file

        weights = {}
        try:
            for f in sorted((path / "model").glob("*.safetensors")):
                weights.update(load_file(f))
        except Exception as exc:  # a truncated or overwritten file: safetensors raises its own error types
            raise ConfigError(f"checkpoint {path}: its model weights cannot be read ({type(exc).__name__}: {exc}); "
                              "delete the checkpoint to resume from the one before") from exc
        if not weights:
            raise ConfigError(f"checkpoint {path} has no model weights (*.safetensors); delete it and resume again")
        try:  # read before any state is loaded, so a damaged file leaves the trainer as it was
            optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
        except Exception as exc:
            raise ConfigError(f"checkpoint {path}: optimizer.pt is missing or cannot be read ({type(exc).__name__}: "
                              f"{exc}); delete the checkpoint to resume from the one before") from exc
        if self.config.update_mode == "full":
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
            if self.model.config.tie_word_embeddings:  # save_pretrained drops the tied copy
                missing = [m for m in missing if m != "lm_head.weight"]
            if missing or unexpected:
                raise ConfigError(f"checkpoint {path} does not match the model (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]}); was it written with another model or update_mode?")
        else:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, weights)
        self.optimizer.load_state_dict(optimizer_state)
        if history is not None:
            self.history = history
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.step = step
        if self.dist.is_main:  # a run killed while writing or deleting a checkpoint left these: not checkpoints
            for stale in self.output_dir.glob(f".tmp-{CHECKPOINT_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _truncate_logs(self) -> None:
        """Drop log lines of steps after the resumed checkpoint (they will be run again).

        Also dropped: a line cut off by a crash (a run killed mid-write; it does not parse), and, when the
        run resumes at ``max_steps``, the final evaluation (it is run again). Records without a step are
        kept. The file is replaced atomically, so a crash here loses nothing.
        """
        final = self.step >= self.config.max_steps
        for name in ("metrics.jsonl", "eval.jsonl"):
            f = self.output_dir / name
            if not f.exists():
                continue
            text = f.read_text(errors="replace")
            kept = []
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # blank, or cut off by a crash
                    continue
                step = record.get("step") if isinstance(record, dict) else None
                if isinstance(step, (int, float)):
                    if step > self.step or (final and name == "eval.jsonl" and step == self.step):
                        continue  # will be run and logged again
                kept.append(line)
            new = "".join(line + "\n" for line in kept)
            if new != text:
                tmp = f.with_name(f".tmp-{name}")
                tmp.write_text(new)
                os.replace(tmp, f)

    # --- the loop ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _stop_on_signal(self):
        """While training, the first SIGINT/SIGTERM asks to stop after the current step; a second one aborts."""
        self._stop_requested = False

        def request_stop(signum, frame):
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            print("\nstopping after this step (press Ctrl-C again to abort without a checkpoint)", flush=True)

        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, request_stop)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def train(self, resume: bool = False) -> dict[str, Any]:
        """Run until ``max_steps``.

        Ctrl-C (or SIGTERM) finishes the current step, writes a checkpoint of it and raises
        ``KeyboardInterrupt``; ``train(resume=True)`` continues from there. A second Ctrl-C stops at once,
        without a checkpoint (the last one written stays valid).
        """
        from tqdm.auto import tqdm

        c = self.config
        main = self.dist.is_main  # data parallel: rank 0 writes every file; all ranks load a checkpoint
        if main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        barrier(self.dist)
        if resume and self.checkpoints():
            self.load_checkpoint(self.checkpoints()[-1])
            if main:
                self._truncate_logs()
        elif main:  # a fresh run in this directory: an earlier run's logs and checkpoints are replaced
            for name in ("metrics.jsonl", "eval.jsonl"):
                (self.output_dir / name).unlink(missing_ok=True)
            stale = self.checkpoints()
            if stale:
                print(f"starting afresh in {self.output_dir}: removing {len(stale)} checkpoint(s) of an earlier run "
                      "(use --resume to continue it instead)", flush=True)
                for old in stale:
                    shutil.rmtree(old, ignore_errors=True)
        barrier(self.dist)
        if main:
            (self.output_dir / "config.json").write_text(c.to_json())
        if c.tensorboard and main:
            from torch.utils.tensorboard import SummaryWriter

            # on resume, drop the events of steps that will be run again
            self._tb = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=self.step + 1 if self.step else None)
        if self.engine is None:
            self.engine = self._make_engine()
        self.engine.sync(self.model)
        if self.step == 0:
            self._evaluate_and_log()
        bar = tqdm(total=c.max_steps, initial=self.step, desc="train", disable=not self.progress)
        last: dict[str, Any] = {}
        with self._stop_on_signal():
            while self.step < c.max_steps:
                last = self.train_step()
                self._emit(last)
                bar.update(1)
                bar.set_postfix(reward="skipped" if last.get("skipped") else f"{last['reward_mean']:.3f}",
                                step_s=f"{last['step_time']:.2f}")
                # evaluate before checkpointing: a crash in between loses neither (resume redoes both)
                if c.eval_steps and self.step % c.eval_steps == 0 and self.step < c.max_steps:
                    self._evaluate_and_log()
                if c.save_steps and self.step % c.save_steps == 0:
                    self._save_checkpoint_all_ranks()
                # data parallel: a stop asked of any rank (torchrun forwards signals to each) stops them all
                if all_reduce_max(float(self._stop_requested), self.dist) > 0:
                    bar.close()
                    path = self._save_checkpoint_all_ranks()
                    if main:
                        print(f"\nstopped: checkpoint of step {self.step} written to {path}; continue with --resume")
                    raise KeyboardInterrupt
        bar.close()
        self._save_checkpoint_all_ranks()
        final = self._evaluate_and_log()
        if main:
            self._save_final()
        if self._tb is not None:
            self._tb.close()
        barrier(self.dist)
        return {"step": self.step, "last": last, "eval": final}

    def _save_final(self) -> None:
        """Write ``final/`` (model and tokenizer) atomically: a temp dir, renamed into place."""
        from dppo_core.models import quiet_transformers

        tmp = Path(tempfile.mkdtemp(prefix=".tmp-final-", dir=self.output_dir))
        try:
            with quiet_transformers():
                self.model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
            target = self.output_dir / "final"
            if target.exists():  # out of the way first: "final" is never half-written (at worst absent until resume)
                old = Path(tempfile.mkdtemp(prefix=".tmp-final-old-", dir=self.output_dir))
                os.rename(target, old / "final")
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _save_checkpoint_all_ranks(self) -> Path:
        """Rank 0 writes the checkpoint (the weights are the same on every rank); the others wait for it."""
        path = self.save_checkpoint() if self.dist.is_main else self.output_dir / f"{CHECKPOINT_PREFIX}{self.step}"
        barrier(self.dist)
        return path

    def _evaluate_and_log(self) -> dict[str, Any]:
        """Evaluate on rank 0 and log it (other ranks wait at a barrier and get ``{}``)."""
        result: dict[str, Any] = {}
        if self.dist.is_main:
            result = self.evaluate()
            self._emit({"event": "eval", **result}, "eval.jsonl")
        barrier(self.dist)
        return result


