"""Dense packing: whole sequences back to back in rows of a token budget, and one forward over the rows.

An update trains on N sequences (prompt + completion, the loss over completion tokens). Run padded, one
per row, a batch pays for N x L_max token slots; packed, several sequences share a row and the rows are
nearly full. Layout of a :class:`PackedBatch` of R rows of width T (T = the longest row, so no column is
all padding), for rows holding sequences a, b | c:

    input_ids     a0 a1 a2 a3 b0 b1 b2 |  c0 c1 c2 c3 c4 .  .        (. = pad_id)
    position_ids   0  1  2  3  0  1  2 |   0  1  2  3  4  0  0        restart at 0 for every sequence
    seq_ids        a  a  a  a  b  b  b |   c  c  c  c  c -1 -1        index in the input list; -1 = padding
    loss_mask      0  0  1  1  0  1  1 |   0  0  0  1  1  0  0        True at completion tokens (the targets)
    cu_seqlens    [0, 4, 7]            |  [0, 5]                      per row, flash-attention style

Attention must never cross a boundary: token t of sequence s attends to tokens u <= t of s only. On
sdpa / eager (and CPU) that is an explicit block-diagonal causal mask of shape (R, 1, T, T)
(:func:`block_causal_mask`; padding slots attend to themselves so no softmax row is
empty). With flash attention the rows are flattened into one row of real tokens and only
``position_ids`` are passed: transformers reads the sequence boundaries off the positions restarting at 0
and calls the variable-length kernel, which skips the cross-sequence blocks entirely. (transformers only
does that for a batch of one row; with several rows it would silently run plain causal attention across
the boundaries, hence the flattening.)

The packer (:func:`plan_rows`) is greedy over a window: keep the unplaced sequences in input order; for
the current row look at the next W of them, place the longest that fits in what is left of the budget,
repeat; when none of the W fits, close the row and open a new one. W = 1 is "next fit" in input order
(a row closes at the first sequence that does not fit); a larger W fills the gaps a long sequence leaves
with shorter ones further down the queue. Sequences are never split or truncated.

Two densities are reported (both 1 for a perfect packing):

    density         = real tokens / (R * T)                      the slots the forward pays for
    budget_density  = real tokens / sum_rows max(B, row length)   against the budget B
                                                                  (an oversize own-row counts its length)

Packing changes nothing but the layout: the per-token log-probs of the packed forward equal those of the
padded one (:func:`dppo_core.logprobs.completion_logprobs_with_grad`) to float tolerance, and so do the
loss and its gradient (tests/system/test_packing.py).

What it saves depends on the attention kernel. With flash attention's variable-length kernel the
attention work is sum_i L_i^2 whatever the layout, so every padding slot removed is time saved. With an
explicit mask (sdpa on CPU, eager) the kernel still computes all R T^2 scores, masked or not: a token in a
row of T pays attention over T positions instead of over its own sequence's L. On CPU, choose a row
budget of a few times the typical sequence length, not thousands (benchmarks/packing_update.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from dppo_core.grpo import token_logprobs

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

OVERSIZE = ("error", "own_row")
ATTENTION_ROUTES = ("auto", "mask", "position_ids", "varlen")


@dataclass
class PackSequence:
    """One sequence to train on: the prompt, then the completion (the loss is over completion tokens)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    weight: float = 1.0  # per-sequence loss weight (1 for GRPO, 1 / keep probability for DPPO)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class PackedBatch:
    """N sequences laid out in R rows of width T (see the module docstring for the layout).

    Row tensors are (R, T); per-sequence tensors are (N,) in input order. ``seq_rows[i]`` and
    ``seq_offsets[i]`` say where sequence i starts.
    """

    input_ids: torch.Tensor  # (R, T) long, padded with pad_id
    position_ids: torch.Tensor  # (R, T) long, restarting at 0 for every sequence; 0 on padding
    seq_ids: torch.Tensor  # (R, T) long, index of the sequence in the input list; -1 on padding
    loss_mask: torch.Tensor  # (R, T) bool, True at completion tokens (the prediction targets)
    cu_seqlens: list[torch.Tensor]  # per row: (sequences in the row + 1,) int32 cumulative boundaries
    row_sequences: list[list[int]]  # sequence indices of each row, in order
    weights: torch.Tensor  # (N,) float32
    prompt_lengths: torch.Tensor  # (N,) long
    completion_lengths: torch.Tensor  # (N,) long
    seq_rows: torch.Tensor  # (N,) long, the row of each sequence
    seq_offsets: torch.Tensor  # (N,) long, the column where each sequence starts
    row_budget: int  # max_tokens_per_row the rows were packed to (T of the longest row for pad())
    num_sequences: int  # N
    real_tokens: int  # tokens that are not padding
    capacity: int  # token slots paid for, R * T

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def row_lengths(self) -> list[int]:
        return [int(c[-1]) for c in self.cu_seqlens]

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_lengths.sum())

    @property
    def density(self) -> float:
        """Real tokens / (R * T): the share of the forward's token slots that hold a real token."""
        return self.real_tokens / max(1, self.capacity)

    @property
    def budget_capacity(self) -> int:
        """Token slots at the budget: ``sum_rows max(row_budget, row length)`` (an oversize row counts its
        length)."""
        return sum(max(self.row_budget, n) for n in self.row_lengths)

    @property
    def budget_density(self) -> float:
        """Real tokens / :attr:`budget_capacity`: how full the rows are against the budget (<= 1)."""
        return self.real_tokens / max(1, self.budget_capacity)

    def stats(self) -> dict[str, float | int]:
        """Counts and densities, for logs and benchmarks."""
        return {"sequences": self.num_sequences, "rows": self.num_rows, "width": self.width,
                "row_budget": self.row_budget, "real_tokens": self.real_tokens, "capacity": self.capacity,
                "density": round(self.density, 4), "budget_density": round(self.budget_density, 4)}


# --------------------------------------------------------------------------------------------------
# Planning: lengths only
# --------------------------------------------------------------------------------------------------


def _check_oversize(lengths: Sequence[int], max_tokens_per_row: int, oversize: str) -> list[int]:
    if oversize not in OVERSIZE:
        raise ValueError(f"oversize must be one of {OVERSIZE}, got {oversize!r}")
    if max_tokens_per_row < 1:
        raise ValueError(f"max_tokens_per_row must be at least 1, got {max_tokens_per_row}")
    big = [i for i, n in enumerate(lengths) if n > max_tokens_per_row]
    if big and oversize == "error":
        i = big[0]
        more = f" ({len(big) - 1} more sequences are too long as well)" if len(big) > 1 else ""
        raise ValueError(
            f"sequence {i} has {lengths[i]} tokens (prompt + completion), more than max_tokens_per_row="
            f"{max_tokens_per_row}{more}; raise max_tokens_per_row to at least "
            f"{max(lengths[j] for j in big)} or pass oversize='own_row' to give each such sequence a row of "
            "its own (sequences are never cut)")
    return big


def plan_rows(lengths: Sequence[int], max_tokens_per_row: int, window: int = 16,
              oversize: str = "error") -> list[list[int]]:
    """Assign sequences (given by their lengths) to rows; returns the sequence indices of each row.

    Window-based greedy (module docstring): for the current row, among the next ``window`` unplaced
    sequences in input order, place the longest that fits (the earliest on a tie); close the row when none
    fits. ``window=1`` is next fit in input order. Every row holds at most ``max_tokens_per_row`` tokens,
    except with ``oversize="own_row"``, where each sequence longer than the budget is taken out of the
    queue and given a row of its own, after the packed rows (that row is longer than the budget).
    ``oversize="error"`` raises ``ValueError`` naming the first such sequence instead.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    big = set(_check_oversize(lengths, max_tokens_per_row, oversize))
    queue = [i for i in range(len(lengths)) if i not in big]  # unplaced, in input order
    rows: list[list[int]] = []
    while queue:
        row: list[int] = []
        left = max_tokens_per_row
        while queue:
            best = -1
            for k in range(min(window, len(queue))):
                n = lengths[queue[k]]
                if n <= left and (best < 0 or n > lengths[queue[best]]):
                    best = k
            if best < 0:
                break
            i = queue.pop(best)
            row.append(i)
            left -= lengths[i]
        rows.append(row)  # never empty: the queue's head always fits an empty row
    rows.extend([i] for i in sorted(big))
    return rows


# --------------------------------------------------------------------------------------------------
# Building the tensors
# --------------------------------------------------------------------------------------------------


def validate_sequences(sequences: Sequence[PackSequence]) -> None:
    if not sequences:
        raise ValueError("nothing to pack: the list of sequences is empty")
    for i, s in enumerate(sequences):
        if len(s.prompt_ids) == 0:
            raise ValueError(f"sequence {i} has an empty prompt: the first completion token needs at least "
                             "one token before it to be predicted from")


def build_batch(sequences: Sequence[PackSequence], rows: Sequence[Sequence[int]], row_budget: int,
                pad_id: int = 0) -> PackedBatch:
    """The tensors of a :class:`PackedBatch` for a given row assignment (each sequence in exactly one row)."""
    validate_sequences(sequences)
    n = len(sequences)
    placed = sorted(i for row in rows for i in row)
    if placed != list(range(n)):
        raise ValueError("rows must hold every sequence index 0..N-1 exactly once")
    row_len = [sum(len(sequences[i]) for i in row) for row in rows]
    R, T = len(rows), max(row_len)
    input_ids = torch.full((R, T), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, T), dtype=torch.long)
    seq_ids = torch.full((R, T), -1, dtype=torch.long)
    loss_mask = torch.zeros((R, T), dtype=torch.bool)
    seq_rows = torch.zeros(n, dtype=torch.long)
    seq_offsets = torch.zeros(n, dtype=torch.long)
    cu_seqlens = []
    for r, row in enumerate(rows):
        pos, bounds = 0, [0]
        for i in row:
            s = sequences[i]
            p, c = len(s.prompt_ids), len(s.completion_ids)
            tokens = list(s.prompt_ids) + list(s.completion_ids)
            input_ids[r, pos : pos + p + c] = torch.tensor(tokens, dtype=torch.long)
            position_ids[r, pos : pos + p + c] = torch.arange(p + c)
            seq_ids[r, pos : pos + p + c] = i
            loss_mask[r, pos + p : pos + p + c] = True
            seq_rows[i], seq_offsets[i] = r, pos
            pos += p + c
            bounds.append(pos)
        cu_seqlens.append(torch.tensor(bounds, dtype=torch.int32))
    real = sum(row_len)
    return PackedBatch(
        input_ids=input_ids, position_ids=position_ids, seq_ids=seq_ids, loss_mask=loss_mask,
        cu_seqlens=cu_seqlens, row_sequences=[list(row) for row in rows],
        weights=torch.tensor([float(s.weight) for s in sequences], dtype=torch.float32),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in sequences], dtype=torch.long),
        completion_lengths=torch.tensor([len(s.completion_ids) for s in sequences], dtype=torch.long),
        seq_rows=seq_rows, seq_offsets=seq_offsets, row_budget=int(row_budget), num_sequences=n,
        real_tokens=real, capacity=R * T,
    )


def pack(sequences: Sequence[PackSequence], max_tokens_per_row: int, window: int = 16,
         oversize: str = "error", pad_id: int = 0) -> PackedBatch:
    """Pack whole sequences into rows of at most ``max_tokens_per_row`` tokens (:func:`plan_rows`).

    Never truncates: a sequence longer than the budget raises ``ValueError`` (``oversize="error"``) or gets
    a row of its own (``oversize="own_row"``; that row, and so T, is then longer than the budget).
    """
    validate_sequences(sequences)
    rows = plan_rows([len(s) for s in sequences], max_tokens_per_row, window, oversize)
    return build_batch(sequences, rows, max_tokens_per_row, pad_id)


def pad(sequences: Sequence[PackSequence], pad_id: int = 0) -> PackedBatch:
    """The padded baseline behind the same interface: one sequence per row, right-padded to the longest.

    ``row_budget`` is the longest sequence, so ``budget_density == density``.
    """
    validate_sequences(sequences)
    return build_batch(sequences, [[i] for i in range(len(sequences))], max(len(s) for s in sequences),
                       pad_id)


def pack_micro_batches(sequences: Sequence[PackSequence], max_tokens_per_row: int, rows_per_micro_batch: int,
                       window: int = 16, oversize: str = "error",
                       pad_id: int = 0) -> list[tuple[list[int], PackedBatch]]:
    """Pack all sequences once, then cut the rows into micro-batches of ``rows_per_micro_batch`` rows.

    Returns ``(indices, batch)`` per micro-batch: ``batch`` holds ``sequences[indices[j]]`` as its
    sequence j (so its log-probs line up with ``advantages[indices]``, ``weights[indices]``).
    """
    if rows_per_micro_batch < 1:
        raise ValueError(f"rows_per_micro_batch must be at least 1, got {rows_per_micro_batch}")
    validate_sequences(sequences)
    rows = plan_rows([len(s) for s in sequences], max_tokens_per_row, window, oversize)
    out = []
    for start in range(0, len(rows), rows_per_micro_batch):
        group = rows[start : start + rows_per_micro_batch]
        indices = [i for row in group for i in row]
        local = {g: j for j, g in enumerate(indices)}
        out.append((indices, build_batch([sequences[i] for i in indices],
                                         [[local[i] for i in row] for row in group], max_tokens_per_row,
                                         pad_id)))
    return out


# --------------------------------------------------------------------------------------------------
# The packed forward
# --------------------------------------------------------------------------------------------------


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention backend of a transformers model (PEFT-wrapped or not): "sdpa", "eager",
    "flash_attention_2", ..."""
    base = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None) or getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def _route(model: torch.nn.Module, attention: str) -> str:
    if attention not in ATTENTION_ROUTES:
        raise ValueError(f"attention must be one of {ATTENTION_ROUTES}, got {attention!r}")
    if attention != "auto":
        return attention
    impl = attention_implementation(model)
    if "flash" in impl or impl == "torch_varlen":  # flash_attention_2 / _3, kernels-community/...flash...
        return "varlen"
    if impl == "flex_attention":  # transformers builds the packed BlockMask from position_ids
        return "position_ids"
    return "mask"


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    # a transformers model, PEFT-wrapped or not (a PeftModel passes the call on to its base model); torch
    # types a module's attributes as Tensor | Module, so the embedding's weight is cast
    emb = cast("PreTrainedModel", model).get_input_embeddings()
    weight = cast(torch.Tensor, emb.weight)
    return weight.dtype if weight.is_floating_point() else torch.float32


def packed_completion_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0, *,
                               attention: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion, from one forward over the packed rows.

    Same contract as :func:`dppo_core.logprobs.completion_logprobs_with_grad`: returns ``(logprobs,
    mask)``, both (N, T_c) with N the sequences in input order and T_c the longest completion, float32;
    padding entries are 0 in both (the padded reference leaves arbitrary values under mask 0; only
    ``logprobs * mask`` is comparable). The logits at position t predict token t+1, so completion token k of
    a sequence starting at column o with a prompt of p tokens is scored by the logits at column
    o + p - 1 + k. Only those positions go through the log-softmax (never a (R, T, V) one).

    ``attention`` picks how sequence boundaries reach the model; ``"auto"`` reads the model's attention
    implementation (through ``get_base_model()`` for PEFT):
        ``"mask"`` (sdpa, eager, anything else): explicit block-diagonal causal mask (R, 1, T, T), boolean
            for sdpa, additive float for eager, plus ``position_ids``;
        ``"varlen"`` (flash attention, ``torch_varlen``): the rows flattened into one (1, real tokens)
            row with ``position_ids``; flash attention derives ``cu_seqlens`` from them, ``torch_varlen``
            (:mod:`dppo_core.varlen`) is given them (:func:`varlen_boundaries`);
        ``"position_ids"`` (flex attention): the (R, T) rows with only ``position_ids``; transformers
            builds the packed mask from them.
    Always ``use_cache=False``: with a KV cache transformers stops reading boundaries off ``position_ids``
    (it only does so when ``past_key_values is None``) and would attend across sequences.
    Differentiable (used in training), with plain and PEFT models alike.
    """
    route = _route(model, attention)
    device = next(model.parameters()).device
    c = batch.completion_lengths
    # one entry per completion token: its sequence, its index in the completion, and where it is scored
    tok_seq, tok_k = completion_token_index(c)
    row = batch.seq_rows[tok_seq]
    col = batch.seq_offsets[tok_seq] + batch.prompt_lengths[tok_seq] - 1 + tok_k  # the predicting position
    targets = batch.input_ids[row, col + 1]  # (K,)

    if route == "varlen":
        real = batch.seq_ids >= 0  # rows are left-aligned, so row-major order keeps each sequence contiguous
        row_starts = torch.cumsum(real.sum(1), 0) - real.sum(1)
        flat_index = row_starts[row] + col
        kwargs = {}
        # the boundaries on the device once, not per layer
        if attention_implementation(model) == "torch_varlen":
            kwargs = {k: v.to(device) if torch.is_tensor(v) else v
                      for k, v in varlen_boundaries(batch).items()}
            kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_q"]
        out = model(input_ids=batch.input_ids[real][None].to(device),
                    position_ids=batch.position_ids[real][None].to(device), use_cache=False, **kwargs)
    else:
        flat_index = row * batch.width + col
        kwargs = {}
        if route == "mask":
            kwargs["attention_mask"] = model_attention_mask(model, block_causal_mask(batch.seq_ids), device)
        out = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                    use_cache=False, **kwargs)
    return completion_grid(out.logits, flat_index, targets, c, temperature)


def varlen_boundaries(batch: PackedBatch) -> dict[str, Any]:
    """The packed sequences' boundaries in the flattened row of the ``varlen`` route, as transformers' keyword
    arguments (``cu_seq_lens_q``/``_k``: (S + 1,) int32 cumulative lengths; ``max_length_q``/``_k``)."""
    starts = torch.nonzero(batch.position_ids[batch.seq_ids >= 0] == 0).flatten()
    total = int((batch.seq_ids >= 0).sum())
    cu = torch.cat([starts, torch.tensor([total])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def block_causal_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """(rows, T) sequence ids -> (rows, 1, T, T) bool mask: attend only to earlier tokens of the same
    sequence.

    Padding slots (id -1) attend to themselves only, so no row of the softmax is empty.
    """
    T = seq_ids.shape[1]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]  # (rows, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    eye = torch.eye(T, dtype=torch.bool)
    return ((same & causal) | eye)[:, None]


def model_attention_mask(model: torch.nn.Module, mask: torch.Tensor,
                         device: torch.device | str) -> torch.Tensor:
    """A (R, 1, T, T) boolean mask (True = attend) as ``model``'s attention takes it: boolean for sdpa,
    additive float (0 or the dtype's minimum) for eager, which adds the mask to the scores."""
    mask = mask.to(device)
    if attention_implementation(model) != "eager":
        return mask
    dtype = _compute_dtype(model)
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)


def completion_token_index(completion_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token (sequence order, then token order): its sequence and its index in the
    completion."""
    c = completion_lengths
    tok_seq = torch.repeat_interleave(torch.arange(len(c)), c)  # (K,)
    tok_k = torch.arange(int(c.sum())) - torch.repeat_interleave(torch.cumsum(c, 0) - c, c)  # (K,)
    return tok_seq, tok_k


def completion_grid(logits: torch.Tensor, flat_index: torch.Tensor, targets: torch.Tensor,
                    completion_lengths: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs laid out (N, T_c), and their mask, from a forward's logits.

    ``flat_index[k]`` is the flattened (row * width + column) position whose logits predict completion token
    k, ``targets[k]`` that token; tokens are in sequence order, then token order, ``completion_lengths``
    per sequence. Only those K positions go through the log-softmax.
    """
    device = logits.device
    c = completion_lengths
    n = len(c)
    t_c = int(c.max()) if n else 0
    tok_seq, tok_k = completion_token_index(c)
    picked = logits.reshape(-1, logits.shape[-1]).index_select(0, flat_index.to(device))  # (K, V)
    lp = token_logprobs(picked[None], targets.to(device)[None], temperature)[0]  # (K,)
    index = (tok_seq.to(device), tok_k.to(device))
    logprobs = torch.zeros((n, t_c), dtype=lp.dtype, device=device).index_put(index, lp)
    mask_out = torch.zeros((n, t_c), dtype=torch.float32, device=device)
    mask_out[index] = 1.0
    return logprobs, mask_out
