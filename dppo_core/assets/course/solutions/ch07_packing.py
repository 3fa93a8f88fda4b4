"""Chapter 07 exercises, solved and checked: a next-fit packer (window 1), next fit decreasing, micro-batch
density, and the block-diagonal mask read off the position ids.

Run: python dppo_core/assets/course/solutions/ch07_packing.py   (seconds, no model: synthetic sequences as
long as the chapter's pruned batch; tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import math
import random

import torch

from dppo_core.packing import PackSequence, block_causal_mask, pack, pack_micro_batches, plan_rows

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Close a row only when the next sequence does not fit in what is left (filling the budget exactly is "
        "fine), and never go back to an earlier row."),
    2: ("Sort stably on the negated length so that ties keep their input order, and return indices into the "
        "original list, not positions in the sorted one."),
    3: ("Cut the rows in order into chunks of k (the last one may be shorter) and pay for each chunk its "
        "number of rows times its own longest row."),
    4: ("Number the segments by a cumulative sum of (position_ids == 0) along each row, combine same-segment "
        "with a causal tril, and return (R, 1, T, T)."),
}


def synthetic_sequences(n: int = 96, seed: int = 0) -> list[PackSequence]:
    """Prompts of 25-28 tokens, completions of 6-63 (mostly short), like the chapter's kept batch."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(25, 28), min(63, 6 + int(rng.expovariate(1 / 14)))
        out.append(PackSequence(list(range(1, p + 1)), list(range(1, c + 1))))
    return out


def density(rows: list[list[int]], lengths: list[int]) -> float:
    """Real tokens / (rows x longest row), as PackedBatch.density."""
    return sum(lengths) / (len(rows) * max(sum(lengths[i] for i in row) for row in rows))


# --------------------------------------------------------------------------------------------------
# Exercise 1: a packer with window 1 (next fit), against the window-16 packer
# --------------------------------------------------------------------------------------------------

def next_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Sequences in input order; a row closes at the first sequence that does not fit."""
    rows, row, left = [], [], budget
    for i, n in enumerate(lengths):
        if n > left:
            rows.append(row)
            row, left = [], budget
        row.append(i)
        left -= n
    return rows + [row]


def exercise_1(next_fit=next_fit) -> None:
    assert next_fit([5, 4, 3, 6, 2], 8) == [[0], [1, 2], [3, 4]]              # by hand: 5 | 4+3 | 6+2
    assert next_fit([8, 8], 8) == [[0], [1]]                                  # a full row closes exactly
    L = [len(s) for s in synthetic_sequences()]
    for budget in (128, 256, 512):
        ours = next_fit(L, budget)
        assert ours == plan_rows(L, budget, window=1)                     # == the package with window 1
        windowed = plan_rows(L, budget, window=16)
        lower = math.ceil(sum(L) / budget)                                # no packer needs fewer rows
        print(f"B = {budget}: next fit {len(ours)} rows, density {density(ours, L):.3f} | window 16: "
              f"{len(windowed)} rows, density {density(windowed, L):.3f} | at least {lower} rows")
        assert lower <= len(windowed) <= len(ours)


# --------------------------------------------------------------------------------------------------
# Exercise 2: next fit decreasing (sort by length, then window 1)
# --------------------------------------------------------------------------------------------------

def next_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Sort the sequences by length, longest first (the earlier on a tie), then next fit; rows of input
    indices."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])        # stable: ties keep input order
    return [[order[k] for k in row] for row in next_fit([lengths[i] for i in order], budget)]


def exercise_2(next_fit_decreasing=next_fit_decreasing) -> None:
    assert next_fit_decreasing([3, 6, 2, 5], 8) == [[1], [3, 0], [2]]        # by hand: 6 | 5+3 | 2
    seqs = synthetic_sequences()
    L = [len(s) for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: -L[i])              # longest first
    for budget in (128, 256):
        nfd = next_fit_decreasing(L, budget)
        assert sorted(i for row in nfd for i in row) == list(range(len(seqs)))   # every sequence once
        assert all(sum(L[i] for i in row) <= budget for row in nfd)
        packed = pack([seqs[i] for i in order], budget, window=1)       # the package on the sorted list
        assert [[order[k] for k in row] for row in packed.row_sequences] == nfd   # the same rows
        assert packed.num_rows == len(nfd) and math.isclose(packed.density, density(nfd, L))
        w16 = plan_rows(L, budget, window=16)
        print(f"B = {budget}: next fit decreasing {len(nfd)} rows (density {density(nfd, L):.3f}); "
              f"window 16 in input order {len(w16)} rows ({density(w16, L):.3f})")
    # Here the window packer in rollout order beats next fit decreasing at both budgets: sorting alone does
    # not help a packer that closes a row at its first misfit, while a window of 16 finds a short sequence to
    # fill the gap a long one leaves. And it needs no sort, so the batch keeps its order.


# --------------------------------------------------------------------------------------------------
# Exercise 3: micro-batch density against rows per micro-batch
# --------------------------------------------------------------------------------------------------

def micro_batch_density(row_lengths: list[int], rows_per_micro_batch: int) -> float:
    """Real tokens / slots paid when the rows, in order, are cut into micro-batches of
    ``rows_per_micro_batch`` rows, each micro-batch as wide as its longest row."""
    chunks = [row_lengths[j : j + rows_per_micro_batch]
              for j in range(0, len(row_lengths), rows_per_micro_batch)]
    return sum(row_lengths) / sum(len(c) * max(c) for c in chunks)


def exercise_3(micro_batch_density=micro_batch_density) -> None:
    assert math.isclose(micro_batch_density([10, 6, 8, 8, 4], 2), 36 / 40)   # by hand: 2x10 + 2x8 + 1x4 slots
    seqs = synthetic_sequences()
    L = [len(s) for s in seqs]
    rows = plan_rows(L, 256, window=16)
    row_len = [sum(L[i] for i in row) for row in rows]
    print("rows per micro-batch   micro-batches   density (package)   density (predicted)")
    predicted = {}
    for k in (1, 4, 8, 16, len(rows)):
        mbs = pack_micro_batches(seqs, 256, k, window=16)
        package = sum(b.real_tokens for _, b in mbs) / sum(b.capacity for _, b in mbs)
        predicted[k] = micro_batch_density(row_len, k)                       # from the row lengths alone
        assert math.isclose(package, predicted[k])
        print(f"{k:>20}   {len(mbs):>13}   {package:>17.3f}   {predicted[k]:>19.3f}")
    # Fewer rows per micro-batch means each is as wide as the longest of fewer rows: for nested chunkings
    # (16 -> 8 -> 4 -> 1) the density can only rise or stay, at the price of more forward passes.
    assert predicted[1] >= predicted[4] >= predicted[8] >= predicted[16] >= predicted[len(rows)]


# --------------------------------------------------------------------------------------------------
# Exercise 4: the block-diagonal causal mask from position_ids alone
# --------------------------------------------------------------------------------------------------

def mask_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(R, T) -> (R, 1, T, T): a new sequence starts wherever the position restarts at 0.

    Padding slots have position 0 too, so each one becomes a 'sequence' of its own and attends to itself only.
    """
    starts = (position_ids == 0).long()
    seq = starts.cumsum(1)                                    # (R, T) segment number of every slot
    same = seq[:, :, None] == seq[:, None, :]
    T = position_ids.shape[1]
    return (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None]


def exercise_4(mask_from_position_ids=mask_from_position_ids) -> None:
    seqs = synthetic_sequences(32)
    for budget, window in ((128, 16), (256, 4), (512, 1)):
        batch = pack(seqs, budget, window=window)
        ours, package = mask_from_position_ids(batch.position_ids), block_causal_mask(batch.seq_ids)
        real = batch.seq_ids >= 0                                         # (R, T) query slots that are tokens
        assert torch.equal(ours[:, 0][real], package[:, 0][real])          # every real token: the same keys
        assert not (ours[:, 0] & real[:, :, None] & ~real[:, None, :]).any()  # no real token sees padding
    print("mask from position_ids == dppo_core.packing.block_causal_mask(seq_ids) for every real token, 3 "
          "packings")
    # Padding rows differ (block_causal_mask lets a padding slot see earlier padding), which changes nothing:
    # no real token attends to padding either way. Reading boundaries off position_ids is what transformers
    # does in the flash-attention path, given one flattened row with no padding; the package builds the
    # explicit mask from seq_ids, which needs no convention about where positions restart.


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    exercise_4()
    print("chapter 07 solutions: all checks passed")


if __name__ == "__main__":
    main()
