"""The prompt once per group: a group's completions share one copy of its prompt in the update's forward.

GRPO trains G completions of every prompt, and a plain layout (padded or packed, :mod:`dppo_core.packing`)
carries the prompt G times: ``G * (P + R)`` tokens for a group. Here the prompt is laid out once, followed
by each kept completion, in one *segment*: ``P + sum of R_i`` tokens. Attention inside a segment:

    segment       p0 p1 p2 | a0 a1 a2 | b0 b1          (prompt, then completions a and b)
    position_ids   0  1  2 |  3  4  5 |  3  4          each completion continues the prompt's positions
    a1 attends to  p0 p1 p2   a0 a1                    the prompt and its own earlier tokens
    b0 attends to  p0 p1 p2             b0             never another completion

So every completion token sees exactly what it sees in the plain layout, at the same positions: its log-prob,
the loss and the gradient are the same up to float rounding (``tests/system/test_shared_prefix.py``). The
first token of every completion is predicted by the logits at the prompt's last position (one set of logits,
shared: each completion gathers its own target from it); token k > 0 by the completion's own token k - 1.

Two ways to run it:

- **Segment attention** (``attn_implementation: auto`` with ``shared_prefix``: the model is loaded with
  :data:`NAME`, registered by :func:`register`). A micro-batch is *one* row holding its segments back to
  back, with no padding at all, so the update's linear layers see exactly ``P + sum of R_i`` tokens per
  segment. The attention is computed per segment instead of over the row: each prompt attends causally to
  itself, and each completion to its prompt's keys followed by its own earlier tokens
  (:func:`segment_attention`, index tensors from :func:`segment_plan`); its cost grows with the segments'
  lengths, not with the row's length squared. Every other call of the model (rollouts with a KV cache,
  evaluation) runs transformers' sdpa, unchanged.
- **An explicit mask** (``attn_implementation: sdpa`` or ``eager``): segments go into rows like sequences
  do, packed greedily into rows of ``max_tokens_per_row`` tokens (:func:`dppo_core.packing.plan_rows`; a
  group whose segment would exceed the budget is split into several segments, each with its own copy of the
  prompt), or one segment per row when not packed, with an (R, 1, T, T) mask (:func:`shared_prefix_mask`),
  as on the packing's ``mask`` route. Its rows are padded and its attention pays for the row length squared.

Flash-attention's varlen kernel cannot express a shared prefix (a completion's keys are not one contiguous
range), so this layout refuses ``flash_attention_2`` and ``torch_varlen``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dppo_core.packing import (
    PackSequence,
    attention_implementation,
    completion_grid,
    model_attention_mask,
    plan_rows,
    validate_sequences,
)

#: the attention implementation name under which :func:`segment_attention_forward` is registered in
#: transformers
NAME = "dppo_segments"


@dataclass
class SharedPrefixBatch:
    """N sequences as segments (one prompt, then its completions) in R rows of width T."""

    input_ids: torch.Tensor  # (R, T) long, padded with pad_id
    position_ids: torch.Tensor  # (R, T) long; a completion continues its prompt's positions; 0 on padding
    segment_ids: torch.Tensor  # (R, T) long, segment index; -1 on padding
    branch_ids: torch.Tensor  # (R, T) long, the sequence a completion token belongs to; -1 on prompt and
                              # padding
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
    validate_sequences(sequences)
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
        pred_rows=torch.tensor(pred_rows, dtype=torch.long),
        pred_cols=torch.tensor(pred_cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        completion_lengths=torch.tensor([len(s.completion_ids) for s in sequences], dtype=torch.long),
        segments=[list(s) for s in segments], row_segments=[list(r) for r in rows], num_sequences=n,
        real_tokens=sum(row_len), capacity=R * T, unshared_tokens=sum(len(s) for s in sequences))


def shared_prefix_micro_batches(sequences: Sequence[PackSequence], max_tokens_per_row: int | None,
                                rows_per_micro_batch: int, window: int = 16, pad_id: int = 0,
                                one_segment_per_row: bool = False,
                                one_row: bool = False) -> list[tuple[list[int], SharedPrefixBatch]]:
    """Segments of at most ``max_tokens_per_row`` tokens (None: one per prompt), placed in rows (packed to
    that budget, or one per row with ``one_segment_per_row`` or no budget), the rows cut into micro-batches
    of ``rows_per_micro_batch``. Returns ``(indices, batch)`` per micro-batch: the batch's sequence j is
    ``sequences[indices[j]]``.

    ``one_row`` (the segment-attention layout): each micro-batch is a single row with no padding, its
    segments back to back; segments are cut at ``max_tokens_per_row * rows_per_micro_batch`` tokens, and a
    micro-batch takes whole segments up to that many tokens (at least one).
    """
    if rows_per_micro_batch < 1:
        raise ValueError(f"rows_per_micro_batch must be at least 1, got {rows_per_micro_batch}")
    validate_sequences(sequences)
    if one_row:
        budget = None if max_tokens_per_row is None else max_tokens_per_row * rows_per_micro_batch
        segments = plan_segments(sequences, budget)
        lengths = [segment_length(sequences, seg) for seg in segments]
        rows: list[list[int]] = []
        used = 0
        for s in range(len(segments)):
            if rows and (budget is None or used + lengths[s] <= budget):
                rows[-1].append(s)
                used += lengths[s]
            else:
                rows.append([s])
                used = lengths[s]
        rows_per_micro_batch = 1
    else:
        segments = plan_segments(sequences, max_tokens_per_row)
        lengths = [segment_length(sequences, seg) for seg in segments]
        if max_tokens_per_row is None or one_segment_per_row:
            # similar lengths together
            rows = [[s] for s in sorted(range(len(segments)), key=lambda s: lengths[s])]
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
    # key is prompt, or own branch
    visible = (branch[:, None, :] == -1) | (branch[:, :, None] == branch[:, None, :])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    eye = torch.eye(T, dtype=torch.bool)
    return ((same_segment & visible & causal) | eye)[:, None]


def shared_prefix_logprobs(model: torch.nn.Module, batch: SharedPrefixBatch,
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion, from one forward over the shared-prefix rows.

    Same contract as :func:`dppo_core.packing.packed_completion_logprobs`: ``(logprobs, mask)``, both
    (N, T_c) in input order, float32, 0 on padding. Differentiable, plain and PEFT models alike. A model
    loaded with ``attn_implementation=NAME`` runs :func:`segment_attention` (any rows, one without padding
    being the layout it is for); otherwise the model must take a 4-D boolean (sdpa) or additive (eager)
    attention mask.
    """
    impl = attention_implementation(model)
    device = next(model.parameters()).device
    if impl == NAME:
        # a 4-D mask is passed through by transformers as it is; segment attention ignores it
        out = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                    attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device), use_cache=False,
                    shared_prefix_plan=segment_plan(batch, device))
    elif "flash" in impl or impl == "torch_varlen":
        raise ValueError(f"the shared-prefix layout needs an attention mask or segment attention, which "
                         f"{impl} is not; load the model with attn_implementation={NAME!r} (after "
                         "dppo_core.shared_prefix.register()) or 'sdpa', or set shared_prefix: false")
    else:
        out = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                    attention_mask=model_attention_mask(model, shared_prefix_mask(batch), device),
                    use_cache=False)
    flat = batch.pred_rows * batch.input_ids.shape[1] + batch.pred_cols
    return completion_grid(out.logits, flat, batch.targets, batch.completion_lengths, temperature)


@dataclass
class CompletionBlock:
    """Completions of similar length, attended together: n of them, of at most C tokens."""

    index: torch.Tensor  # (n, C) long: flattened position of each completion's tokens, 0 past its end
    valid: torch.Tensor  # (n, C) bool
    segment: torch.Tensor  # (n,) long: the segment (so the prompt) of each completion
    mask: torch.Tensor  # (n, 1, C, P + C) bool, True = attend: its prompt's tokens, then its own earlier
                        # tokens


@dataclass
class SegmentPlan:
    """Index tensors of a :class:`SharedPrefixBatch` for :func:`segment_attention` (positions are flattened,
    ``row * T + column``): S segments with prompts of at most P tokens, and the completions in blocks of
    similar length (sorted by length, ``block`` at a time), so that short completions are not padded to the
    longest."""

    prompt_index: torch.Tensor  # (S, P) long: position of each segment's prompt tokens, 0 past its end
    prompt_valid: torch.Tensor  # (S, P) bool
    prompt_mask: torch.Tensor  # (S, 1, P, P) bool, True = attend: causal within the prompt
    blocks: list[CompletionBlock]
    positions: int  # R * T


def _grouped_index(owner: torch.Tensor, positions: torch.Tensor,
                   groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups, longest) positions of each owner's tokens in position order, and which entries are real."""
    counts = torch.bincount(owner, minlength=groups)
    width = max(1, int(counts.max())) if len(owner) else 1
    order = torch.argsort(owner * (positions.max() + 1 if len(positions) else 1) + positions)
    owner, positions = owner[order], positions[order]
    rank = torch.arange(len(owner)) - (torch.cumsum(counts, 0) - counts)[owner]
    index = torch.zeros((groups, width), dtype=torch.long)
    valid = torch.zeros((groups, width), dtype=torch.bool)
    index[owner, rank] = positions
    valid[owner, rank] = True
    return index, valid


def segment_plan(batch: SharedPrefixBatch, device: torch.device | str = "cpu",
                 block: int = 32) -> SegmentPlan:
    """Where each segment's prompt and each completion sit in ``batch``, and who attends to whom; completions
    in blocks of ``block``, by length."""
    seg, branch = batch.segment_ids.reshape(-1), batch.branch_ids.reshape(-1)
    pos = torch.arange(seg.numel())
    prompt = (seg >= 0) & (branch < 0)
    n_seg = len(batch.segments)
    prompt_index, prompt_valid = _grouped_index(seg[prompt], pos[prompt], n_seg)
    completion = branch >= 0
    completion_index, completion_valid = _grouped_index(branch[completion], pos[completion],
                                                        batch.num_sequences)
    completion_segment = torch.zeros(batch.num_sequences, dtype=torch.long)
    for s, segment_members in enumerate(batch.segments):
        completion_segment[segment_members] = s
    p = prompt_index.shape[1]
    causal_p = torch.ones(p, p, dtype=torch.bool).tril()
    prompt_mask = causal_p & prompt_valid[:, None, :]  # (S, P, P); rows past a prompt's end still see it
    lengths = completion_valid.sum(-1)
    order = torch.argsort(lengths, stable=True)
    blocks = []
    for start in range(0, batch.num_sequences, block):
        members = order[start : start + block]
        c = max(1, int(lengths[members].max()))
        valid = completion_valid[members, :c]
        own = torch.ones(c, c, dtype=torch.bool).tril() & valid[:, None, :]  # (n, C, C)
        sees_prompt = prompt_valid[completion_segment[members]][:, None, :].expand(-1, c, -1)  # (n, C, P)
        blocks.append(CompletionBlock(completion_index[members, :c].to(device), valid.to(device),
                                      completion_segment[members].to(device),
                                      torch.cat([sees_prompt, own], dim=-1)[:, None].to(device)))
    return SegmentPlan(prompt_index.to(device), prompt_valid.to(device), prompt_mask[:, None].to(device),
                       blocks, seg.numel())


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SegmentPlan,
                      scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Attention of a shared-prefix batch computed per segment: ``query`` (B, H_q, T, D), ``key``/``value``
    (B, H_kv, T, D) in the batch's layout; returns (B, T, H_q, D), zeros on padding.

    Each prompt token attends to its prompt's tokens up to itself; each completion token to its prompt's
    tokens and then to its own completion's tokens up to itself, which is exactly what the explicit mask of
    :func:`shared_prefix_mask` allows, without a (T, T) score matrix per row.
    """
    b, hq, t, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    if b * t != plan.positions:
        raise ValueError(f"the segment plan is for {plan.positions} positions, the attention got {b} x {t}")
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} key/value heads evenly")
    q = query.transpose(0, 1).reshape(hq, b * t, d)
    k = key.transpose(0, 1).reshape(hkv, b * t, d)
    v = value.transpose(0, 1).reshape(hkv, b * t, dv)

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # (H, BT, D) -> (groups, H, width, D)
        # index_select, whose backward is an index_add (advanced indexing's is a much slower index_put on CPU)
        return (x.index_select(1, index.reshape(-1)).view(x.shape[0], *index.shape, x.shape[-1])
                .permute(1, 0, 2, 3))

    def sdpa(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # grouped-query attention: query head i reads key/value head i // (hq / hkv), as transformers'
        # repeat_kv; the keys are gathered per completion with their own hkv heads and repeated only here
        if hkv != hq:
            k_, v_ = k_.repeat_interleave(hq // hkv, dim=1), v_.repeat_interleave(hq // hkv, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, dropout_p=dropout,
                                                                scale=scaling)

    kp, vp = take(k, plan.prompt_index), take(v, plan.prompt_index)
    out_p = sdpa(take(q, plan.prompt_index), kp, vp, plan.prompt_mask)
    out = query.new_zeros((b * t, hq, dv))
    out = out.index_copy(0, plan.prompt_index[plan.prompt_valid], out_p.transpose(1, 2)[plan.prompt_valid])
    for blk in plan.blocks:
        kc = torch.cat([kp.index_select(0, blk.segment), take(k, blk.index)], dim=2)
        vc = torch.cat([vp.index_select(0, blk.segment), take(v, blk.index)], dim=2)
        out_c = sdpa(take(q, blk.index), kc, vc, blk.mask)
        out = out.index_copy(0, blk.index[blk.valid], out_c.transpose(1, 2)[blk.valid])
    return out.reshape(b, t, hq, dv)


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, shared_prefix_plan: SegmentPlan | None = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation=NAME``: :func:`segment_attention`
    when the forward carries ``shared_prefix_plan`` (the shared-prefix update), transformers' sdpa
    otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unsupported in ("softcap", "s_aux"):  # logit soft-capping, attention sinks: neither path applies them
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{NAME} does not apply {unsupported} (this model asks for it); load the model "
                             "with its own attention implementation and set shared_prefix: false")
    if shared_prefix_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    # the window lives in sdpa's mask, which segment attention has none of
    for unsupported in ("sliding_window",):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{NAME} does not apply {unsupported} (this model asks for it); load the model "
                             "with attn_implementation='sdpa' (the shared prefix then uses an explicit mask)")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{NAME} takes no KV cache in a shared-prefix forward; got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    return segment_attention(query, key, value, shared_prefix_plan, scaling, dropout), None


def register() -> None:
    """Make ``attn_implementation=NAME`` loadable in transformers (idempotent)."""
    from dppo_core.varlen import register_attention

    register_attention(NAME, segment_attention_forward)
