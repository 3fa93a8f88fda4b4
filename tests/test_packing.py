"""Dense packing: the packer's invariants (hypothesis), oversize sequences, density, and packed == padded
log-probs (at temperature 1 and others), loss and gradients on the tiny model, plain and LoRA."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dppo_core.grpo import policy_loss
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.packing import (
    PackSequence,
    attention_implementation,
    pack,
    pack_micro_batches,
    packed_completion_logprobs,
    pad,
    plan_rows,
)

pytestmark = pytest.mark.numerics  # compares computed numbers: run under both kernel settings (Makefile)

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


# --------------------------------------------------------------------------------------------------
# The packed forward equals the padded one
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these forwards are small, and on a shared 2-core machine two OpenMP threads
    next to another busy process run about 20x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from dppo_core.models import load_model

    m, _ = load_model(tiny_model_dir)
    return m.eval()


def _sequences(seed, n=24, vocab=300):  # the tiny model's vocabulary has 309 tokens
    rng = random.Random(seed)
    return [PackSequence([rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))],
                         [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))],
                         weight=rng.uniform(0.5, 3.0)) for _ in range(n)]


def _padded(model, seqs, temperature=1.0):
    logp, mask = completion_logprobs_with_grad(model, [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs],
                                               temperature, PAD)
    return logp * mask, mask  # the reference leaves arbitrary values on padding; packing leaves 0


@pytest.mark.parametrize("seed,budget,window", [(0, 96, 16), (1, 160, 4), (2, 256, 1), (3, 70, 16)])
def test_packed_logprobs_equal_padded(model, seed, budget, window):
    seqs = _sequences(seed)
    batch = pack(seqs, budget, window, pad_id=PAD)
    assert max(len(r) for r in batch.row_sequences) > 1
    with torch.no_grad():
        ref, ref_mask = _padded(model, seqs)
        logp, mask = packed_completion_logprobs(model, batch)
    assert logp.shape == ref.shape and logp.dtype == torch.float32
    assert torch.equal(mask, ref_mask)
    assert (logp - ref).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_packed_logprobs_equal_padded_at_a_temperature(model, temperature):
    """The update scores completions at ``config.temperature`` (dppo_core.logprobs passes it on): packed equals
    padded at T != 1 too, on the default route and the flattened one. The temperature has power here: the
    log-probs at T differ from those at T = 1 by far more than the tolerance, so a packed forward that ignored it
    (and scored at T = 1) would fail."""
    seqs = _sequences(10)
    batch = pack(seqs, 128, pad_id=PAD)
    with torch.no_grad():
        ref, ref_mask = _padded(model, seqs, temperature)
        at_one, _ = _padded(model, seqs)
        for attention in ("auto", "varlen"):
            logp, mask = packed_completion_logprobs(model, batch, temperature, attention=attention)
            assert torch.equal(mask, ref_mask)
            assert (logp - ref).abs().max() < 1e-5, f"attention={attention}"
    assert (ref - at_one).abs().max() > 1e-2


def test_a_mask_that_crosses_boundaries_is_caught(model):
    """The negative control: plain causal attention inside a row changes the log-probs by far more than 1e-5."""
    seqs = _sequences(0)
    batch = pack(seqs, 96)
    batch.seq_ids[batch.seq_ids >= 0] = 0  # one "sequence" per row: attention crosses the boundaries
    with torch.no_grad():
        ref, _ = _padded(model, seqs)
        logp, _ = packed_completion_logprobs(model, batch)
    assert (logp - ref).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["position_ids", "varlen"])
def test_every_attention_route_gives_the_same_logprobs(model, attention):
    """The routes flash / flex attention take ("varlen": one flattened row; "position_ids": rows, no mask),
    run here through sdpa, which reads the boundaries off position_ids the same way."""
    seqs = _sequences(4)
    batch = pack(seqs, 128)
    with torch.no_grad():
        ref, _ = _padded(model, seqs)
        logp, _ = packed_completion_logprobs(model, batch, attention=attention)
    assert (logp - ref).abs().max() < 1e-5


def test_eager_attention_gets_an_additive_mask(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    assert attention_implementation(m) == "eager"
    seqs = _sequences(5)
    with torch.no_grad():
        ref, _ = _padded(m, seqs)
        logp, _ = packed_completion_logprobs(m, pack(seqs, 128))
    assert (logp - ref).abs().max() < 1e-5


def _loss(logp, mask, idx, adv, w, loss_type, n_total, tokens):
    return policy_loss(logp, adv[idx], mask, weights=w[idx], loss_type=loss_type, num_sequences=n_total,
                       max_completion_length=64, num_tokens=tokens)[0]


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_loss_and_gradients_equal_padded(model, loss_type):
    seqs = _sequences(6, n=20)
    n = len(seqs)
    gen = torch.Generator().manual_seed(0)
    adv, w = torch.randn(n, generator=gen), torch.tensor([s.weight for s in seqs])
    tokens = sum(len(s.completion_ids) for s in seqs)
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        ref_loss = _loss(*_padded(model, seqs), list(range(n)), adv, w, loss_type, 32, tokens)
        ref_loss.backward()
        ref_grads = _grads(model)

        model.zero_grad(set_to_none=True)  # packed, in micro-batches of 2 rows: gradients accumulate
        loss = 0.0
        for idx, batch in pack_micro_batches(seqs, 128, rows_per_micro_batch=2, pad_id=PAD):
            mb_loss = _loss(*packed_completion_logprobs(model, batch), idx, adv, w, loss_type, 32, tokens)
            mb_loss.backward()
            loss += mb_loss.item()
        grads = _grads(model)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    assert abs(loss - ref_loss.item()) < 1e-6
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6, rtol=1e-4), name


def test_lora_logprobs_and_gradients_equal_padded(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    from dppo_core.models import load_model

    base, _ = load_model(tiny_model_dir)
    m = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():  # lora_B starts at zero; make the adapter change the output
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    assert attention_implementation(m) == "sdpa"
    seqs = _sequences(7, n=16)
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(1))
    w = torch.tensor([s.weight for s in seqs])
    idx = list(range(len(seqs)))

    ref, ref_mask = _padded(m, seqs)
    _loss(ref, ref_mask, idx, adv, w, "grpo", 16, 0).backward()
    ref_grads = _grads(m)
    m.zero_grad(set_to_none=True)
    logp, mask = packed_completion_logprobs(m, pack(seqs, 128))
    _loss(logp, mask, idx, adv, w, "grpo", 16, 0).backward()
    grads = _grads(m)

    assert (logp - ref).abs().max() < 1e-5
    with m.disable_adapter(), torch.no_grad():  # the adapter matters: without it the log-probs differ
        assert (packed_completion_logprobs(m, pack(seqs, 128))[0] - ref).abs().max() > 1e-3
    assert grads and all("lora" in n for n in grads)
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        assert torch.allclose(g, ref_grads[name], atol=1e-6, rtol=1e-4), name


# --------------------------------------------------------------------------------------------------
# Position ids restart at every sequence, and the default CPU route can see it when they do not
# --------------------------------------------------------------------------------------------------
# The tiny model uses RoPE, which is relative: positions that fail to restart shift a whole sequence by
# its offset in the row, and its log-probs move by only ~1e-6 on the default ("mask") route, under the
# 1e-5 tolerance above. Two checks that do see it: the layout itself, and a model with absolute position
# embeddings (a random 2-layer GPT-2 built from a config, no download) through the same default route.
# Each is run against a mutant packer whose positions count on across a row (the bug) to show it has power.


def _assert_positions_restart(batch):
    """position_ids are 0, 1, ... from the first token of every sequence, and 0 on padding."""
    for r, row in enumerate(batch.row_sequences):
        bounds = batch.cu_seqlens[r].tolist()
        for i, s, e in zip(row, bounds, bounds[1:], strict=False):
            assert (int(batch.seq_rows[i]), int(batch.seq_offsets[i])) == (r, s)
            assert batch.position_ids[r, s:e].tolist() == list(range(e - s)), f"sequence {i} (row {r})"
        assert not batch.position_ids[r, bounds[-1]:].any(), f"padding of row {r}"


@pytest.fixture
def positions_do_not_restart(monkeypatch):
    """The mutant: build_batch (used by pack, pad and pack_micro_batches) numbers the real tokens of each
    row 0, 1, 2, ... straight through, so only a row's first sequence starts at 0."""
    import dppo_core.packing as packing

    real_build = packing.build_batch

    def build_batch(*args, **kwargs):
        b = real_build(*args, **kwargs)
        real = b.seq_ids >= 0
        b.position_ids = torch.where(real, torch.arange(b.width).expand_as(real), 0)
        return b

    monkeypatch.setattr(packing, "build_batch", build_batch)


def _multi_sequence_rows(batches):
    assert any(len(row) > 1 for b in batches for row in b.row_sequences), "no row holds two sequences"


def test_position_ids_restart_at_every_sequence():
    seqs = _sequences(8, n=30)
    batches = [pack(seqs, 96, pad_id=PAD), pack(seqs, 200, window=1, pad_id=PAD)]
    batches += [b for _, b in pack_micro_batches(seqs, 128, rows_per_micro_batch=2, pad_id=PAD)]
    _multi_sequence_rows(batches)
    for b in batches:
        _assert_positions_restart(b)


def test_position_check_catches_positions_that_do_not_restart(positions_do_not_restart):
    seqs = _sequences(8, n=30)
    for b in [pack(seqs, 96, pad_id=PAD)] + [b for _, b in pack_micro_batches(seqs, 128, 2, pad_id=PAD)]:
        _multi_sequence_rows([b])
        with pytest.raises(AssertionError, match="sequence"):
            _assert_positions_restart(b)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def absolute_position_model(request):
    """A random GPT-2 (learned absolute position embeddings), tiny: built from a config in well under a second."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_positions=256, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                        eos_token_id=2, pad_token_id=PAD, attn_implementation=request.param)
    m = GPT2LMHeadModel(config).eval()
    assert attention_implementation(m) == request.param  # the default route for both is the explicit mask
    return m


def _packed_minus_padded(m, seqs):
    with torch.no_grad():
        ref, ref_mask = _padded(m, seqs)
        diffs = []
        for idx, batch in [(list(range(len(seqs))), pack(seqs, 128, pad_id=PAD))] + pack_micro_batches(
                seqs, 96, rows_per_micro_batch=2, pad_id=PAD):
            logp, mask = packed_completion_logprobs(m, batch)  # attention="auto": the default CPU route
            assert torch.equal(mask, ref_mask[idx, : mask.shape[1]])
            diffs.append(float((logp - ref[idx, : logp.shape[1]]).abs().max()))
    return max(diffs)


def test_packed_logprobs_equal_padded_with_absolute_positions(absolute_position_model):
    seqs = _sequences(9, n=20)
    _multi_sequence_rows([pack(seqs, 128, pad_id=PAD)])
    assert _packed_minus_padded(absolute_position_model, seqs) < 1e-5


def test_absolute_positions_catch_positions_that_do_not_restart(absolute_position_model, positions_do_not_restart):
    """The negative control of the test above: the same comparison, on the same default route, fails by far
    more than its tolerance when the packer's positions count on across a row."""
    seqs = _sequences(9, n=20)
    assert _packed_minus_padded(absolute_position_model, seqs) > 1e-2
