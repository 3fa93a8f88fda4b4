"""Dense packing's packer on lengths and token ids alone: its invariants (hypothesis), oversize sequences and
density. (The packed forward against the padded one, on models: tests/system/test_packing.py.)"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dppo_core.packing import PackSequence, pack, pad, plan_rows

PAD = 0

# --------------------------------------------------------------------------------------------------
# The packer: lengths only
# --------------------------------------------------------------------------------------------------

lengths_st = st.lists(st.integers(0, 60), min_size=1, max_size=60)


def _replay(lengths, budget, window, rows):
    """Check ``rows`` against the definition: among the next ``window`` unplaced sequences (input order),
    place the longest that fits (earliest on a tie); close the row when none fits; oversize rows last."""
    big = [i for i, n in enumerate(lengths) if n > budget]
    packed = rows[: len(rows) - len(big)]
    assert rows[len(packed):] == [[i] for i in big]
    queue = [i for i in range(len(lengths)) if lengths[i] <= budget]
    for row in packed:
        left = budget
        for placed in row:
            fitting = [k for k in range(min(window, len(queue))) if lengths[queue[k]] <= left]
            assert fitting, "a sequence was placed although none in the window fits"
            best = max(fitting, key=lambda k: (lengths[queue[k]], -k))
            assert placed == queue[best]
            left -= lengths[queue.pop(best)]
        assert all(lengths[i] > left for i in queue[:window]), "a row was closed while a window sequence fits"
    assert not queue


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 150), window=st.integers(1, 20))
def test_plan_rows_places_each_sequence_once_within_the_budget(lengths, budget, window):
    rows = plan_rows(lengths, budget, window, oversize="own_row")
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(row for row in rows)
    for row in rows:
        total = sum(lengths[i] for i in row)
        assert total <= budget or (len(row) == 1 and total > budget)
    _replay(lengths, budget, window, rows)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, budget=st.integers(60, 150))
def test_window_one_is_next_fit_in_input_order(lengths, budget):
    rows = plan_rows(lengths, budget, window=1)
    assert [i for row in rows for i in row] == list(range(len(lengths)))  # consecutive runs, in order
    for row, nxt in zip(rows, rows[1:], strict=False):
        assert sum(lengths[i] for i in row) + lengths[nxt[0]] > budget  # closed only when the next does not fit


def test_window_fills_gaps_that_next_fit_leaves():
    lengths = [6, 6, 4, 4]  # budget 10: next fit gives [6] [6,4] [4]; a window of 4 gives [6,4] [6,4]
    assert plan_rows(lengths, 10, window=1) == [[0], [1, 2], [3]]
    assert plan_rows(lengths, 10, window=4) == [[0, 2], [1, 3]]


sequence_st = st.builds(
    PackSequence,
    prompt_ids=st.lists(st.integers(1, 500), min_size=1, max_size=12),
    completion_ids=st.lists(st.integers(1, 500), min_size=0, max_size=12),
    weight=st.floats(0.1, 10.0),
)


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(sequence_st, min_size=1, max_size=25), budget=st.integers(1, 40), window=st.integers(1, 8))
def test_pack_tensors_are_consistent(seqs, budget, window):
    b = pack(seqs, budget, window, oversize="own_row", pad_id=PAD)
    R, T = b.input_ids.shape
    assert T == max(b.row_lengths) and R == len(b.row_sequences)
    assert sorted(i for row in b.row_sequences for i in row) == list(range(len(seqs)))
    for r, row in enumerate(b.row_sequences):
        bounds = [0]
        for i in row:
            bounds.append(bounds[-1] + len(seqs[i]))
        assert b.cu_seqlens[r].tolist() == bounds
        if bounds[-1] > budget:
            assert len(row) == 1  # only an oversize sequence alone in its row
        for i, s, e in zip(row, bounds, bounds[1:], strict=False):
            p = len(seqs[i].prompt_ids)
            assert (b.seq_rows[i], b.seq_offsets[i]) == (r, s)
            assert b.input_ids[r, s:e].tolist() == seqs[i].prompt_ids + seqs[i].completion_ids
            assert b.position_ids[r, s:e].tolist() == list(range(e - s))
            assert (b.seq_ids[r, s:e] == i).all()
            assert b.loss_mask[r, s:e].tolist() == [False] * p + [True] * (e - s - p)
        tail = slice(bounds[-1], T)
        assert (b.seq_ids[r, tail] == -1).all() and (b.position_ids[r, tail] == 0).all()
        assert (b.input_ids[r, tail] == PAD).all() and not b.loss_mask[r, tail].any()
    assert int(b.loss_mask.sum()) == sum(len(s.completion_ids) for s in seqs) == b.num_completion_tokens
    assert b.real_tokens == sum(len(s) for s in seqs) == int((b.seq_ids >= 0).sum())
    assert b.capacity == R * T and 0 < b.density <= 1 and 0 < b.budget_density <= 1
    assert torch.allclose(b.weights, torch.tensor([s.weight for s in seqs], dtype=torch.float32))


def test_pad_is_one_sequence_per_row():
    seqs = [PackSequence([1, 2], [3]), PackSequence([4], [5, 6, 7, 8]), PackSequence([9, 9, 9], [])]
    b = pad(seqs)
    assert b.row_sequences == [[0], [1], [2]] and b.input_ids.shape == (3, 5)
    assert b.density == b.budget_density == 11 / 15


def test_oversize_error_names_the_sequence():
    seqs = [PackSequence([1] * 5, [2] * 5), PackSequence([1] * 5, [2] * 5), PackSequence([1] * 20, [2] * 30)]
    with pytest.raises(ValueError, match=r"sequence 2 has 50 tokens.*max_tokens_per_row=32.*own_row"):
        pack(seqs, 32)


def test_oversize_own_row_puts_it_alone_and_never_cuts():
    seqs = [PackSequence([1] * 5, [2] * 5), PackSequence([1] * 20, [2] * 30), PackSequence([1] * 5, [2] * 5)]
    b = pack(seqs, 32, oversize="own_row")
    assert b.row_sequences == [[0, 2], [1]] and b.row_lengths == [20, 50]
    assert b.width == 50 and b.budget_capacity == 32 + 50


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="empty"):
        pack([], 16)
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        pack([PackSequence([1], [2]), PackSequence([], [2])], 16)
    with pytest.raises(ValueError, match="oversize"):
        pack([PackSequence([1], [2])], 16, oversize="truncate")


def test_density_on_a_realistic_length_mix():
    rng = random.Random(0)
    seqs = [PackSequence([1] * rng.randint(20, 30), [2] * rng.randint(5, 64)) for _ in range(256)]
    packed, padded = pack(seqs, 512, window=16), pad(seqs)
    assert packed.density >= 0.95 and packed.budget_density >= 0.95
    assert padded.density < 0.75 < packed.density
