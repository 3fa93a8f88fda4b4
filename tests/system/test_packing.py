"""Dense packing on models: packed == padded log-probs (at temperature 1 and others), loss and gradients on the
tiny model, plain and LoRA, and positions that restart at every sequence. (The packer on lengths alone, its
invariants, oversize sequences and density: tests/unit/test_packer.py.)"""

import random

import pytest
import torch

from dppo_core.grpo import policy_loss
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.packing import (
    PackSequence,
    attention_implementation,
    pack,
    pack_micro_batches,
    packed_completion_logprobs,
)

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (the checks of the positions alone) cannot.

PAD = 0

# --------------------------------------------------------------------------------------------------
# The packed forward equals the padded one
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these forwards are small, and on a shared 2-core machine two OpenMP threads
    next to another busy process run about 20x slower than one."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch._C: an in-process vLLM engine no-ops torch.set_num_threads
    yield
    torch._C.set_num_threads(before)


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


@pytest.mark.numerics
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


@pytest.mark.numerics
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


@pytest.mark.numerics
def test_a_mask_that_crosses_boundaries_is_caught(model):
    """The negative control: plain causal attention inside a row changes the log-probs by far more than 1e-5."""
    seqs = _sequences(0)
    batch = pack(seqs, 96)
    batch.seq_ids[batch.seq_ids >= 0] = 0  # one "sequence" per row: attention crosses the boundaries
    with torch.no_grad():
        ref, _ = _padded(model, seqs)
        logp, _ = packed_completion_logprobs(model, batch)
    assert (logp - ref).abs().max() > 1e-2


@pytest.mark.numerics
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


@pytest.mark.numerics
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


@pytest.mark.numerics
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


@pytest.mark.numerics
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


@pytest.mark.numerics
def test_packed_logprobs_equal_padded_with_absolute_positions(absolute_position_model):
    seqs = _sequences(9, n=20)
    _multi_sequence_rows([pack(seqs, 128, pad_id=PAD)])
    assert _packed_minus_padded(absolute_position_model, seqs) < 1e-5


@pytest.mark.numerics
def test_absolute_positions_catch_positions_that_do_not_restart(absolute_position_model, positions_do_not_restart):
    """The negative control of the test above: the same comparison, on the same default route, fails by far
    more than its tolerance when the packer's positions count on across a row."""
    seqs = _sequences(9, n=20)
    assert _packed_minus_padded(absolute_position_model, seqs) > 1e-2
