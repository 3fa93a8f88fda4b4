"""The transformers engine: :class:`HFRollout` samples with the training model itself, and the log-probs of
given tokens under a transformers model (the reference side of every engine comparison)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from dppo_core.engines.prompt_rows import copy_rows, distinct_rows, prefix_padded, shared_prefix_length
from dppo_core.engines.types import (
    Completion,
    Prompt,
    RolloutBatch,
    RolloutGroup,
    SamplingConfig,
    base_model,
    stop_ids,
)
from dppo_core.models import encode_prompt

# --------------------------------------------------------------------------------------------------
# Log-probs of given tokens under a transformers model (reference side of every comparison)
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                      start: Sequence[int] | None = None, temperature: float = 1.0,
                      batch_size: int = 32) -> list[torch.Tensor]:
    """Log-prob of every token of each sequence given the tokens before it, under ``softmax(logits / T)``.

    Returns one float32 CPU tensor per sequence with the log-probs of tokens ``start[i]:`` (default 1:,
    i.e. every token that has a prefix). ``temperature=0`` is treated as 1 (greedy decoding has no
    temperature-scaled distribution). Works for plain and PEFT-wrapped models.
    """
    if start is None:
        start = [1] * len(sequences)
    for i, (seq, first) in enumerate(zip(sequences, start, strict=True)):
        if not 1 <= first <= len(seq):
            raise ValueError(f"sequence {i}: start={first} must be in [1, {len(seq)}] (its length)")
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
            # (batch, width, vocab)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
            logp = torch.log_softmax(logits.float() / scale, dim=-1)
            # logp[:, t] predicts token t + 1
            # (batch, width-1)
            token_logp = logp[:, :-1].gather(-1, ids[:, 1:, None].to(device)).squeeze(-1).cpu()
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


# --------------------------------------------------------------------------------------------------
# transformers engine
# --------------------------------------------------------------------------------------------------


class HFRollout:
    """Rollouts on the training model itself with transformers (so ``sync`` has nothing to do).

    Two decode loops give the same samples for the same seed (tested; see ``decode``):

    - ``"compact"`` (default): our own loop over the model's forward with a KV cache. Each distinct prompt
      of a chunk is computed once and its keys, values and first logits are copied to its G sequences (a
      GRPO chunk holds every prompt G times). With ``share_prefix`` (default), the tokens all of a chunk's
      distinct prompts start with (a chat template's system message, solved examples; at least
      :data:`~dppo_core.engines.prompt_rows.MIN_SHARED_PREFIX`) are computed once for the chunk, then each
      prompt's own tokens after them: SmolLM2's few-shot prompt shares 72 of its 93 tokens, so an
      evaluation computes about a fifth of the prompt tokens. A sequence that generates a stop token leaves
      the batch at once (its rows of the KV cache are dropped), so every decode step computes only the
      sequences still running and a rollout costs what its tokens cost, not ``batch x (prompt + longest
      completion)``.
    - ``"generate"``: transformers ``generate``, which decodes the whole batch until its longest completion
      ends (finished rows keep being computed and padded). Kept as the reference the compact loop is
      tested against.

    Why the samples agree: for one sample per row, ``torch.multinomial`` draws ``q ~ Exp(1)`` of the
    batch's ``(rows, vocab)`` shape and returns ``argmax(p / q)``. The compact loop draws the noise of
    the *whole* chunk's shape every step, as ``generate`` does, and gives each running sequence its own
    row of it, so a sequence's tokens depend on its own probabilities and noise only, whoever else is
    still running. Conditions (tested on CPU in fp32, on Qwen3 and GPT-2 architectures, with and without
    PEFT):

    - The probabilities are computed on smaller batches (the shared prefix, the distinct prompts, then the
      running sequences).
      Where the kernels round a row differently at another batch size (more likely in bf16 and on a GPU), a
      near tie can flip a token; the log-probs are those of the tokens actually sampled either way.
    - The sampling distribution is ``softmax(logits / T)`` cut to the top-p nucleus, nothing else, as in
      vLLM with explicit sampling parameters. ``generate`` would also apply processors that a model's own
      ``generation_config`` asks for (a repetition penalty, ``min_new_tokens``, suppressed tokens, ...):
      with such a model the two loops differ, and the constructor warns.
    - Models whose cache keeps per-sequence state beyond keys and values (linear-attention or hybrid
      layers) cannot drop rows: their chunks are decoded by ``generate``, with one warning.

    The compact loop's decode steps run :class:`~dppo_core.engines.lean_decode.LeanDecoder` where it supports
    the model (Llama, Qwen2 and Qwen3 models, plain or with PEFT LoRA adapters: the tiny model, full
    fine-tuning and LoRA): the same operations as the model's forward without transformers' per-call machinery
    (mask building, cache concatenation, module calls), bit for bit the forward's logits on CPU in fp32
    (tested); on the bench's prompts 1.13-1.32x the tokens per second of the same loop calling the forward
    (``benchmarks/results/rollout_throughput.md``). Other models (quantised, DoRA or other architectures;
    ``LeanDecoder.unsupported`` says why) are decoded by their own forward, with the same samples.

    Costs it does not remove: every step still draws noise of the chunk's full ``(rows, vocab)`` shape
    (what ``generate`` draws; with a 150k-token vocabulary and 256 rows that is about 150 MB per step; on
    the tiny model's CPU rollouts a noticeable share of the time), and a step in which sequences finish
    copies the KV cache's remaining rows.

    Args:
        model: a causal LM (transformers or PEFT-wrapped).
        tokenizer: its tokenizer (left padding is used for batching).
        batch_size: sequences generated at once; lower it if memory is short (the KV cache of a chunk,
            and with ``decode="generate"`` its per-step scores, ``batch_size * max_tokens * vocab`` floats).
        decode: ``"compact"`` or ``"generate"`` (above).
        lean: let the compact loop use the lean decode step where the model allows it (above); ``False``
            always calls the model's forward.
        share_prefix: let the compact loop compute the prefix a chunk's prompts share once (above);
            ``False`` computes every distinct prompt whole.
    """

    name = "hf"
    DECODE_LOOPS = ("compact", "generate")

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256,
                 decode: Literal["compact", "generate"] = "compact", lean: bool = True,
                 share_prefix: bool = True):
        if decode not in self.DECODE_LOOPS:
            raise ValueError(f"decode must be one of {self.DECODE_LOOPS}, got {decode!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.decode = decode
        self.lean = lean
        self.share_prefix = share_prefix
        self.stop_ids = stop_ids(model, tokenizer)
        if decode == "compact" and (extra := _generation_config_processors(model)):
            warnings.warn(f"the model's generation_config asks for {', '.join(extra)}, which HFRollout's "
                          "compact loop does not apply (it samples softmax(logits / T) within top-p, as vLLM "
                          "does); decode='generate' would apply them", UserWarning, stacklevel=2)
        self._warned_cache = False

    def _lean_decoder(self):
        """A :class:`~dppo_core.engines.lean_decode.LeanDecoder` for the model, or ``None`` where it has
        none."""
        from dppo_core.engines.lean_decode import LeanDecoder

        return LeanDecoder.for_model(self.model)

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
        run_chunk = self._compact_chunk if self.decode == "compact" else self._generate_chunk
        # a seed: its own stream, and the global one left as it was; no seed: the global stream, advanced
        rng = (torch.random.fork_rng(devices=[] if device.type == "cpu" else [device])
               if sampling.seed is not None else contextlib.nullcontext())
        try:
            with rng:
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                for start in range(0, len(jobs), self.batch_size):
                    chunk = jobs[start : start + self.batch_size]
                    for gi, comp in zip(chunk, run_chunk([groups[g].prompt_ids for g in chunk],
                                                         sampling, device, pad_id), strict=True):
                        groups[gi].completions.append(comp)
        finally:
            self.model.train(was_training)
        return RolloutBatch(groups)

    @staticmethod
    def _left_padded(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)  # (batch, width)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompt_ids):  # left padding
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        return input_ids, attention_mask

    def _completion(self, ids: list[int], logprobs: list[float]) -> Completion:
        finish = "length"
        for t, tok in enumerate(ids):
            if tok in self.stop_ids:
                ids, finish = ids[: t + 1], "stop"
                break
        return Completion(token_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=True),
                          logprobs=logprobs[: len(ids)], finish_reason=finish)

    def _compact_chunk(self, prompt_ids: list[list[int]], sampling: SamplingConfig, device, pad_id):
        """Decode one chunk; a sequence leaves the batch (and the KV cache) when it emits a stop token."""
        from transformers import DynamicCache

        cache = DynamicCache(config=getattr(self.model, "config", None))
        if not self._rows_can_leave(cache):
            return self._generate_chunk(prompt_ids, sampling, device, pad_id)
        n = len(prompt_ids)
        # what the forward takes: logits of the last position only (generate asks for that too), position ids
        takes = _forward_parameters(self.model)
        last_only = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}

        def pos(p: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"position_ids": p} if "position_ids" in takes else {}

        stop = torch.tensor(self.stop_ids, dtype=torch.long, device=device)
        rows = torch.arange(n, device=device)  # chunk row of each sequence still running
        tokens: list[torch.Tensor] = []  # per step, (n,) sampled token of every chunk row (pad once finished)
        logps: list[torch.Tensor] = []  # per step, (n,) its log-prob under the sampling distribution
        # a shared prefix only where the forward takes positions (the rest of each prompt sits after padding)
        share = self.share_prefix and "position_ids" in takes
        attention_mask, positions, logits = self._prefill(prompt_ids, cache, device, pad_id, pos, last_only,
                                                          share)
        # the decode steps: the lean step where it reproduces the model's forward exactly, else the forward
        lean = self._lean_decoder() if self.lean else None
        if lean is not None:
            lean.start(cache, attention_mask, sampling.max_tokens)
            del cache  # the buffers hold the prompt's keys and values now
        for _ in range(sampling.max_tokens):
            # (running,) each
            nxt, lp = _draw(logits.to(device=device, dtype=torch.float32), sampling, rows, n)
            tokens.append(torch.full((n,), pad_id, dtype=torch.long, device=device).index_put_((rows,), nxt))
            logps.append(torch.zeros(n, dtype=torch.float32, device=device).index_put_((rows,), lp))
            running = ~torch.isin(nxt, stop)  # (running,)
            # one device-to-host read per step (each is a synchronisation on a GPU)
            finite, any_running, all_running = torch.stack(
                [torch.isfinite(lp).all(), running.any(), running.all()]).tolist()
            if not finite:  # non-finite logits: what torch.multinomial refuses too
                raise RuntimeError("the sampling probabilities contain inf or nan: the model's logits are "
                                   "not finite (a diverged policy, or an overflow in low precision)")
            if not any_running or len(tokens) == sampling.max_tokens:
                break
            if not all_running:  # finished sequences leave the batch and the KV cache
                still = running.nonzero().squeeze(-1)
                rows, nxt, positions = rows[still], nxt[still], positions[still]
                if lean is not None:
                    lean.keep(still)
                else:
                    cache.batch_select_indices(still)
                    attention_mask = attention_mask[still]
            positions = positions[:, -1:] + 1
            if lean is not None:
                logits = lean.step(nxt, positions[:, 0])
            else:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=-1)
                logits = self.model(input_ids=nxt[:, None], attention_mask=attention_mask, **pos(positions),
                                    past_key_values=cache, use_cache=True, **last_only).logits[:, -1]
        new = torch.stack(tokens, dim=1).cpu()  # (n, steps)
        logprobs = torch.stack(logps, dim=1).cpu()
        return [self._completion(new[i].tolist(), logprobs[i].tolist()) for i in range(n)]

    def _prefill(self, prompt_ids: list[list[int]], cache: Any, device, pad_id: int, pos, last_only: dict,
                 share: bool):
        """The chunk's prompts into ``cache``, one row per sequence: every row's attention mask and positions
        (the layout its decode steps continue) and the logits of its first token; ``share``: a prefix all the
        prompts start with is computed once."""
        # the prompt once per distinct prompt: a group's G sequences share it, so its keys, values and first
        # logits are computed once and copied to each of them (the same rows of the same padded batch)
        first, copies = (t.to(device) for t in distinct_rows(prompt_ids))
        shared = shared_prefix_length([prompt_ids[i] for i in first.tolist()]) if share else 0
        # left-padded rows; with a shared prefix [shared prefix | left padding | the rest of the prompt]
        layout = (prefix_padded(prompt_ids, shared, pad_id) if shared
                  else self._left_padded(prompt_ids, pad_id))
        input_ids, attention_mask = (t.to(device) for t in layout)
        # position of each prompt token, counted from its first real token (left pads get 0, as generate does;
        # the padding after a shared prefix is masked whatever its position)
        positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
        if shared:  # the tokens every distinct prompt starts with, once for the chunk
            self.model(input_ids=input_ids[:1, :shared], attention_mask=attention_mask[:1, :shared],
                       **pos(positions[:1, :shared]), past_key_values=cache, use_cache=True, **last_only)
            cache.batch_repeat_interleave(len(first))
        out = self.model(input_ids=input_ids[first, shared:], attention_mask=attention_mask[first],
                         **pos(positions[first, shared:]), past_key_values=cache, use_cache=True, **last_only)
        return attention_mask, positions, copy_rows(out.logits[:, -1], cache, copies)

    def _rows_can_leave(self, cache: Any) -> bool:
        """Whether rows can be dropped from ``cache``; warns once when not (decoding then falls back to
        generate)."""
        if _rows_can_leave(cache):
            return True
        if not self._warned_cache:
            warnings.warn(f"this model's cache layers ({sorted({type(x).__name__ for x in cache.layers})}) "
                          "keep state that rows cannot be dropped from; decoding with transformers generate",
                          UserWarning, stacklevel=4)
            self._warned_cache = True
        return False

    def _generate_chunk(self, prompt_ids: list[list[int]], sampling: SamplingConfig, device, pad_id):
        """Decode one chunk with transformers ``generate`` (every row until the longest ends)."""
        input_ids, attention_mask = self._left_padded(prompt_ids, pad_id)
        width = input_ids.shape[1]
        greedy = sampling.temperature == 0
        # a transformers or PEFT causal LM (both have generate); torch types a module's attributes as Tensor |
        # Module
        out = cast(Any, self.model).generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=sampling.max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            # None while sampling means top_k=50, a truncation vLLM does not make
            top_k=None if greedy else 0,
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
        return [self._completion(new[i].tolist(), logprobs[i].tolist()) for i in range(new.shape[0])]


def _draw(scores: torch.Tensor, sampling: SamplingConfig, rows: torch.Tensor,
          n: int) -> tuple[torch.Tensor, ...]:
    """Each running sequence's next token from its float32 logits ``scores`` (running, vocab), and its
    log-prob under the sampling distribution (after temperature and top-p); greedy at temperature 0."""
    if sampling.temperature == 0:
        nxt = scores.argmax(-1)
    else:
        scores = _process_logits(scores, sampling.temperature, sampling.top_p)
        probs = torch.softmax(scores, dim=-1)
        # torch.multinomial's one-sample draw, argmax(p / q) with q ~ Exp(1), with the noise of the whole
        # chunk's shape (what generate draws) and each running sequence's own row of it
        noise = torch.empty((n, probs.shape[-1]), dtype=probs.dtype, device=scores.device).exponential_(1)
        nxt = (probs / noise[rows]).argmax(-1)
    return nxt, torch.log_softmax(scores, dim=-1).gather(-1, nxt[:, None]).squeeze(-1)


def _forward_parameters(model: torch.nn.Module) -> frozenset[str]:
    """The keyword parameters of the (base) model's forward, e.g. ``logits_to_keep`` and ``position_ids``."""
    import inspect

    return frozenset(inspect.signature(base_model(model).forward).parameters)


def _rows_can_leave(cache: Any) -> bool:
    """Whether every layer of ``cache`` holds only keys and values per row (so rows can be dropped)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)


#: generation_config fields (with their no-op values) whose processors transformers generate applies and
#: the compact loop does not
_IGNORED_GENERATION_FIELDS: dict[str, Any] = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0, "min_new_tokens": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "min_p": None, "typical_p": 1.0, "exponential_decay_length_penalty": None,
}


def _generation_config_processors(model: Any) -> list[str]:
    """The fields of the model's generation_config that would make ``generate`` sample from another
    distribution than ``softmax(logits / T)`` within top-p (temperature, top-k and top-p are set per call)."""
    config = getattr(base_model(model), "generation_config", None)
    if config is None:
        return []
    found = []
    for k, default in _IGNORED_GENERATION_FIELDS.items():
        value = getattr(config, k, default)
        if value is None or value == default or (isinstance(value, (list, tuple, dict)) and not value):
            continue
        found.append(f"{k}={value!r}")
    return found


def _process_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution's logits, as transformers' temperature and top-p warpers make them.

    ``logits / T``, then the tokens outside the nucleus (the smallest set whose probability reaches
    ``top_p``, at least one token) set to ``-inf``.
    """
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:
        ascending, order = torch.sort(logits, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[..., -1:] = False  # keep at least the most likely token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


# --------------------------------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------------------------------
