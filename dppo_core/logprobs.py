"""Completion log-probabilities for the update: one home for how a batch of sequences is laid out and run.

Padded (:func:`completion_logprobs_with_grad`: one right-padded sequence per row, micro-batches of similar
lengths) or packed (:func:`dppo_core.packing.packed_completion_logprobs`: whole sequences back to back in
token-budget rows with a block-diagonal mask). Both return ``(logprobs, mask)`` of shape (N, T_max) for
the same sequences, equal to float tolerance, so the loss does not depend on the layout. The rollout
engines' own log-probs (for the train/inference mismatch) are in :mod:`dppo_core.rollout`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dppo_core.grpo import token_logprobs, truncated_importance_weights

if TYPE_CHECKING:
    from dppo_core.config import DPPOConfig


@dataclass
class Sequences:
    """The completions an update trains on (flattened over prompts), with their per-sequence terms."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: torch.Tensor  # (N,)
    weights: torch.Tensor  # (N,) float64: 1 for GRPO; 1 / keep probability for DPPO (cast to the loss's
                           # dtype)
    num_sequences: int  # |B| G: the normaliser of grpo / dr_grpo (the full candidate batch)
    pruned_tokens: int = 0  # completion tokens rolled out but not trained on
    origin: list[tuple[int, int]] | None = None  # (group, completion) in the rollout batch of each sequence
    engine_logprobs: list[list[float]] | None = None  # per token, the engine's sampling log-probs (log mu)
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
        count ``dapo`` stays unbiased under completion pruning (a ratio estimator under prompt
        pruning, since the tokens of prompts never rolled out are unknown).
        """
        return self.num_tokens + self.pruned_tokens

    @property
    def global_num_tokens(self) -> int:
        return self.num_tokens if self.total_tokens is None else self.total_tokens

    @property
    def global_rolled_out_tokens(self) -> int:
        return (self.rolled_out_tokens if self.total_rolled_out_tokens is None
                else self.total_rolled_out_tokens)


def engine_logprob_grid(seqs: Sequences, idx: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """The engine's log-probs of micro-batch ``idx``'s tokens laid out like its ``(logprobs, mask)``: (N, T),
    row i holding sequence ``idx[i]``'s tokens from column 0, zeros on padding; float32, or ``like``'s
    float64."""
    if seqs.engine_logprobs is None:
        raise ValueError("these Sequences carry no engine log-probs; build them from a RolloutBatch "
                         "(DPPOTrainer.sequences) to correct for the engine")
    grid = torch.zeros(like.shape, dtype=torch.promote_types(like.dtype, torch.float32))
    for row, i in enumerate(idx):
        lp = seqs.engine_logprobs[i]
        if len(lp) != len(seqs.completion_ids[i]):
            raise ValueError(f"the rollout engine gave {len(lp)} log-probs for a completion of "
                             f"{len(seqs.completion_ids[i])} tokens; rollout_correction needs one per token "
                             "(fix the engine, or set rollout_correction: off)")
        grid[row, : len(lp)] = torch.tensor(lp, dtype=grid.dtype)
    return grid.to(like.device)


def engine_weights(config: DPPOConfig, level: str, seqs: Sequences, idx: Sequence[int],
                   old_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The rollout correction of micro-batch ``idx``: weights min(π_old/μ, C) per token (or per sequence, by
    ``level``), and their sums for the step's log (weight and truncated tokens summed, max |log π_old − log
    μ|). They multiply each token's whole loss, the KL term's included (``policy_loss(token_weights=)``)."""
    engine = engine_logprob_grid(seqs, idx, old_logprobs)
    m = mask.bool()
    w = truncated_importance_weights(old_logprobs, engine, config.rollout_correction_cap, level=level,
                                     mask=mask)
    w = torch.where(m, w, torch.ones_like(w))  # padding: 1 (its loss is masked anyway, and stays finite)
    diff = (old_logprobs.detach().to(engine.dtype) - engine).abs()[m]
    return w, {"engine_weight_sum": w[m].sum().item(),
               "engine_truncated": (w[m] >= config.rollout_correction_cap).sum().item(),
               "engine_logprob_diff_max": diff.max().item() if diff.numel() else 0.0}


def completion_logprobs_with_grad(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                                  completion_ids: Sequence[Sequence[int]], temperature: float,
                                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion given its prompt, padded to (N, T_max), and the mask.

    Sequences are right-padded into one (N, L) batch; the logits at position t predict token t+1.
    """
    device = next(model.parameters()).device
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(lengths)
    t_max = max(len(c) for c in completion_ids)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)  # (N, L)
    attn = torch.zeros_like(ids)
    # (N, T) positions predicting each token
    gather_pos = torch.zeros((len(lengths), t_max), dtype=torch.long)
    targets = torch.full((len(lengths), t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), t_max))
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        seq = list(p) + list(c)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        gather_pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        targets[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        mask[i, : len(c)] = 1
    # (N, L, V)
    logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits
    picked = logits.gather(1, gather_pos.to(device)[..., None].expand(-1, -1, logits.shape[-1]))  # (N, T, V)
    return token_logprobs(picked, targets.to(device), temperature), mask.to(device)


Forward = Callable[[torch.nn.Module, int], tuple[torch.Tensor, torch.Tensor]]


def layout_micro_batches(seqs: Sequences, config: DPPOConfig, pad_id: int,
                         segments: bool = False) -> tuple[list[list[int]], Forward, dict[str, float]]:
    """Split ``seqs`` into micro-batches: their indices, a forward ``f(model, k)`` giving ``(logprobs, mask)``
    of micro-batch k, and layout stats (rows, token-slot capacity, density, padding avoided).

    Padded (default): ``micro_batch_size`` sequences per micro-batch, sorted by length so that neighbours
    waste little padding. Packed (``packing: true``): whole sequences back to back in rows of at most
    ``max_tokens_per_row`` tokens (:mod:`dppo_core.packing`), ``packing_rows_per_micro_batch`` rows per
    micro-batch, with a block-diagonal attention mask. Shared prefix (``shared_prefix: true``): each prompt
    once per group (:mod:`dppo_core.shared_prefix`), with ``segments`` (the model runs segment attention) in
    one unpadded row per micro-batch of about as many tokens as the packed (or padded) micro-batch would hold.
    The loss is a sum over sequences with a constant normaliser, so every layout gives the same loss and
    gradient.
    """
    c = config
    lengths = [len(p) + len(q) for p, q in zip(seqs.prompt_ids, seqs.completion_ids, strict=True)]
    # micro-batches of similar lengths waste less padding (the loss is a sum, so the order is free)
    order = sorted(range(len(seqs)), key=lambda i: lengths[i])
    padded = [order[i : i + c.micro_batch_size] for i in range(0, len(order), c.micro_batch_size)]
    padded_capacity = sum(len(idx) * max(lengths[i] for i in idx) for idx in padded)
    real = sum(lengths)
    if c.shared_prefix:
        return _shared_prefix_layout(seqs, c, pad_id, real, padded_capacity, segments)
    if not c.packing:
        def forward(m: torch.nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            idx = padded[k]
            return completion_logprobs_with_grad(m, [seqs.prompt_ids[i] for i in idx],
                                                 [seqs.completion_ids[i] for i in idx], c.temperature, pad_id)

        return padded, forward, {"update_rows": len(seqs), "update_capacity": padded_capacity,
                                 "update_density": real / max(1, padded_capacity), "padding_avoided": 0}
    from dppo_core.packing import PackSequence, pack_micro_batches, packed_completion_logprobs

    items = [PackSequence(list(p), list(q), 1.0)
             for p, q in zip(seqs.prompt_ids, seqs.completion_ids, strict=True)]
    packed = pack_micro_batches(items, c.max_tokens_per_row, c.packing_rows_per_micro_batch,
                                window=c.packing_window, oversize="own_row", pad_id=pad_id)

    def packed_forward(m: torch.nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return packed_completion_logprobs(m, packed[k][1], c.temperature)

    capacity = sum(b.capacity for _, b in packed)
    return [idx for idx, _ in packed], packed_forward, {
        "update_rows": sum(b.num_rows for _, b in packed), "update_capacity": capacity,
        "update_density": real / max(1, capacity), "padding_avoided": padded_capacity - capacity}


def _shared_prefix_layout(seqs: Sequences, c: DPPOConfig, pad_id: int, real: int, padded_capacity: int,
                          segments: bool) -> tuple[list[list[int]], Forward, dict[str, float]]:
    """``shared_prefix: true``: each prompt once per segment, its completions after it
    (:mod:`dppo_core.shared_prefix`); with ``segments`` one unpadded row per micro-batch, else segments packed
    into rows (``packing``) or one per row."""
    from dppo_core.packing import PackSequence
    from dppo_core.shared_prefix import shared_prefix_logprobs, shared_prefix_micro_batches

    items = [PackSequence(list(p), list(q), 1.0)
             for p, q in zip(seqs.prompt_ids, seqs.completion_ids, strict=True)]
    if segments:  # segment attention: one unpadded row per micro-batch, of the tokens a micro-batch holds
        budget = (c.max_tokens_per_row * c.packing_rows_per_micro_batch if c.packing
                  else math.ceil(real / max(1, len(seqs)) * c.micro_batch_size))  # micro_batch_size sequences
        batches = shared_prefix_micro_batches(items, budget, 1, pad_id=pad_id, one_row=True)
    elif c.packing:
        batches = shared_prefix_micro_batches(items, c.max_tokens_per_row, c.packing_rows_per_micro_batch,
                                              window=c.packing_window, pad_id=pad_id)
    else:  # one segment per row (a group, split where it exceeds max_tokens_per_row), about micro_batch_size
        batches = shared_prefix_micro_batches(items, c.max_tokens_per_row,  # sequences per micro-batch
                                              max(1, c.micro_batch_size // c.num_generations), pad_id=pad_id,
                                              one_segment_per_row=True)

    def forward(m: torch.nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return shared_prefix_logprobs(m, batches[k][1], c.temperature)

    capacity = sum(b.capacity for _, b in batches)
    laid_out = sum(b.real_tokens for _, b in batches)  # each prompt once per segment: fewer than ``real``
    return [idx for idx, _ in batches], forward, {
        "update_rows": sum(b.num_rows for _, b in batches), "update_capacity": capacity,
        "update_density": laid_out / max(1, capacity), "padding_avoided": padded_capacity - capacity,
        "prompt_tokens_shared": real - laid_out}
