"""The prompt once per group: a group's completions share one copy of its prompt in the update's forward.

GRPO trains G completions of every prompt, and a plain layout (padded or packed, :mod:`dppo_core.packing`)
carries the prompt G times: ``G * (P + R)`` tokens for a group. Here the prompt is laid out once, followed
by each kept completion, in one *segment*: ``P + sum of R_i`` tokens. Attention inside a segment:

    segment       p0 p1 p2 | a0 a1 a2 | b0 b1          (prompt, then completions a and b)
    position_ids   0  1  2 |  3  4  5 |  3  4          each completion continues the prompt's positions
    a1 attends to  p0 p1 p2   a0 a1                    the prompt and its own earlier tokens
    b0 attends to  p0 p1 p2             b0             never another completion

So every completion token sees exactly what it sees in the plain layout, at the same positions: its
log-prob, the loss and the gradient are the same up to float rounding (``tests/test_shared_prefix.py``).
The first token of every completion is predicted by the logits at the prompt's last position (one set of
logits, shared: each completion gathers its own target from it); token k > 0 by the completion's own
token k - 1.

Segments go into rows like sequences do: packed greedily into rows of ``max_tokens_per_row`` tokens
(:func:`dppo_core.packing.plan_rows`; a group whose segment would exceed the budget is split into several
segments, each with its own copy of the prompt), or one segment per row when not packed. The mask is
explicit, (R, 1, T, T), as on the packing's ``mask`` route (sdpa, eager, CPU); flash-attention's varlen
kernel cannot express a shared prefix, so this layout needs an attention implementation that takes a mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dppo_core.packing import (
    PackSequence,
    _validate,
    attention_implementation,
    completion_grid,
    model_attention_mask,
    plan_rows,
)


@dataclass
class SharedPrefixBatch:
    """N sequences as segments (one prompt, then its completions) in R rows of width T."""

    input_ids: torch.Tensor  # (R, T) long, padded with pad_id
    position_ids: torch.Tensor  # (R, T) long; a completion continues its prompt's positions; 0 on padding
    segment_ids: torch.Tensor  # (R, T) long, segment index; -1 on padding
    branch_ids: torch.Tensor  # (R, T) long, the sequence a completion token belongs to; -1 on prompt and padding
    pred_rows: torch.Tensor  # (K,) long, per completion token (sequence order, then token order): its row
    pred_cols: torch.Tensor  # (K,) long, the column whose logits predict it
    targets: torch.Tensor  # (K,) long, the token
    completion_lengths: torch.Tensor  # (N,) long
    segments: list[list[int]]  # the sequences of each segment (they share its prompt)
    row_segments: list[list[int]]  # the segments of each row
    num_sequences: int
    real_tokens: int  # tokens that are not padding
    capacity: int  # token slots paid for, R * T
    unshared_tokens: int  # what the plain layout carries: sum over sequences of prompt + completion

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def density(self) -> float:
        return self.real_tokens / max(1, self.capacity)

    @property
    def prompt_copies_saved(self) -> int:
        """Prompt tokens the plain layout would carry and this one does not."""
        return self.unshared_tokens - self.real_tokens


def group_by_prompt(sequences: Sequence[PackSequence]) -> list[list[int]]:
    """Indices of the sequences that share a prompt (same token ids), groups in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(sequences):
        groups.setdefault(tuple(s.prompt_ids), []).append(i)
    return list(groups.values())


def plan_segments(sequences: Sequence[PackSequence], max_tokens: int | None) -> list[list[int]]:
    """Each prompt's sequences as segments of at most ``max_tokens`` tokens (prompt once + completions);
    a completion that does not fit with the prompt even alone gets a segment of its own. ``None``: one
    segment per prompt."""
    segments = []
    for group in group_by_prompt(sequences):
        p = len(sequences[group[0]].prompt_ids)
        current: list[int] = []
        used = p
        for i in group:
            r = len(sequences[i].completion_ids)
            if current and max_tokens is not None and used + r > max_tokens:
                segments.append(current)
                current, used = [], p
            current.append(i)
            used += r
        segments.append(current)
    return segments


def segment_length(sequences: Sequence[PackSequence], segment: Sequence[int]) -> int:
    return len(sequences[segment[0]].prompt_ids) + sum(len(sequences[i].completion_ids) for i in segment)


def build_shared_batch(sequences: Sequence[PackSequence], segments: Sequence[Sequence[int]],
                       rows: Sequence[Sequence[int]], pad_id: int = 0) -> SharedPrefixBatch:
    """The tensors for ``segments`` (sequence indices sharing a prompt) placed in ``rows`` (segment indices).

    ``sequences`` are numbered 0..N-1 and the result's log-probs come back in that order.
    """
    _validate(sequences)
    n = len(sequences)
    if sorted(i for seg in segments for i in seg) != list(range(n)):
        raise ValueError("segments must hold every sequence index 0..N-1 exactly once")
    if sorted(s for row in rows for s in row) != list(range(len(segments))):
        raise ValueError("rows must hold every segment index exactly once")
    for seg in segments:
        if len({tuple(sequences[i].prompt_ids) for i in seg}) != 1:
            raise ValueError(f"segment {list(seg)} mixes sequences with different prompts")
    lengths = [segment_length(sequences, seg) for seg in segments]
    row_len = [sum(lengths[s] for s in row) for row in rows]
    R, T = len(rows), max(row_len)
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, T), dtype=torch.long)
    segment_ids = torch.full((R, T), -1, dtype=torch.long)
    branch_ids = torch.full((R, T), -1, dtype=torch.long)
    # per sequence: row, the column predicting its first token, the columns of its tokens
    first_pred = [0] * n
    token_cols: list[list[int]] = [[] for _ in range(n)]
    seq_row = [0] * n
    for r, row in enumerate(rows):
        col = 0
        for s in row:
            seg = segments[s]
            prompt = list(sequences[seg[0]].prompt_ids)
            p = len(prompt)
            input_ids[r, col : col + p] = torch.tensor(prompt, dtype=torch.long)
            position_ids[r, col : col + p] = torch.arange(p)
            segment_ids[r, col : col + p] = s
            last_prompt = col + p - 1
            col += p
            for i in seg:
                c = list(sequences[i].completion_ids)
                k = len(c)
                if k:
                    input_ids[r, col : col + k] = torch.tensor(c, dtype=torch.long)
                    position_ids[r, col : col + k] = torch.arange(p, p + k)
                    segment_ids[r, col : col + k] = s
                    branch_ids[r, col : col + k] = i
                seq_row[i], first_pred[i] = r, last_prompt
                token_cols[i] = list(range(col, col + k))
                col += k
    pred_rows, pred_cols, targets = [], [], []
    for i in range(n):
        cols = token_cols[i]
        preds = [first_pred[i], *cols[:-1]]
        pred_rows += [seq_row[i]] * len(cols)
        pred_cols += preds[: len(cols)]
        targets += list(sequences[i].completion_ids)
    return SharedPrefixBatch(
        input_ids=input_ids, position_ids=position_ids, segment_ids=segment_ids, branch_ids=branch_ids,
        pred_rows=torch.tensor(pred_rows, dtype=torch.long), pred_cols=torch.tensor(pred_cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        completion_lengths=torch.tensor([len(s.completion_ids) for s in sequences], dtype=torch.long),
        segments=[list(s) for s in segments], row_segments=[list(r) for r in rows], num_sequences=n,
        real_tokens=sum(row_len), capacity=R * T, unshared_tokens=sum(len(s) for s in sequences))


def shared_prefix_micro_batches(sequences: Sequence[PackSequence], max_tokens_per_row: int | None,
                                rows_per_micro_batch: int, window: int = 16, pad_id: int = 0,
                                one_segment_per_row: bool = False) -> list[tuple[list[int], SharedPrefixBatch]]:
    """Segments of at most ``max_tokens_per_row`` tokens (None: one per prompt), placed in rows (packed to
    that budget, or one per row with ``one_segment_per_row`` or no budget), the rows cut into micro-batches
    of ``rows_per_micro_batch``. Returns ``(indices, batch)`` per micro-batch: the batch's sequence j is
    ``sequences[indices[j]]``."""
    if rows_per_micro_batch < 1:
        raise ValueError(f"rows_per_micro_batch must be at least 1, got {rows_per_micro_batch}")
    _validate(sequences)
    segments = plan_segments(sequences, max_tokens_per_row)
    lengths = [segment_length(sequences, seg) for seg in segments]
    if max_tokens_per_row is None or one_segment_per_row:
        rows = [[s] for s in sorted(range(len(segments)), key=lambda s: lengths[s])]  # similar lengths together
    else:
        rows = plan_rows(lengths, max_tokens_per_row, window, oversize="own_row")
    out = []
    for start in range(0, len(rows), rows_per_micro_batch):
        chunk = rows[start : start + rows_per_micro_batch]
        segs = [s for row in chunk for s in row]
        indices = [i for s in segs for i in segments[s]]
        local = {g: j for j, g in enumerate(indices)}
        seg_local = {s: j for j, s in enumerate(segs)}
        out.append((indices, build_shared_batch([sequences[i] for i in indices],
                                                [[local[i] for i in segments[s]] for s in segs],
                                                [[seg_local[s] for s in row] for row in chunk], pad_id)))
    return out


def shared_prefix_mask(batch: SharedPrefixBatch) -> torch.Tensor:
    """(R, 1, T, T) bool, True = attend: earlier tokens of the same segment that are its prompt or the same
    completion. Padding slots attend to themselves only, so no row of the softmax is empty."""
    seg, branch = batch.segment_ids, batch.branch_ids
    T = seg.shape[1]
    same_segment = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    visible = (branch[:, None, :] == -1) | (branch[:, :, None] == branch[:, None, :])  # key is prompt, or own branch
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    eye = torch.eye(T, dtype=torch.bool)
    return ((same_segment & visible & causal) | eye)[:, None]


def shared_prefix_logprobs(model, batch: SharedPrefixBatch,
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion, from one forward over the shared-prefix rows.

    Same contract as :func:`dppo_core.packing.packed_completion_logprobs`: ``(logprobs, mask)``, both
    (N, T_c) in input order, float32, 0 on padding. Differentiable, plain and PEFT models alike; the
    model must take a 4-D boolean (sdpa) or additive (eager) attention mask.
    """
    impl = attention_implementation(model)
    if "flash" in impl:
        raise ValueError(f"the shared-prefix layout needs an attention mask, which {impl} does not take; load "
                         "the model with attn_implementation='sdpa' or set shared_prefix: false")
    device = next(model.parameters()).device
    out = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                attention_mask=model_attention_mask(model, shared_prefix_mask(batch), device), use_cache=False)
    flat = batch.pred_rows * batch.input_ids.shape[1] + batch.pred_cols
    return completion_grid(out.logits, flat, batch.targets, batch.completion_lengths, temperature)
