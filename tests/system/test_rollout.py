"""The transformers rollout engine and the engine-independent pieces of dppo_core.rollout.

The slow obvious reference for every log-prob here is one unpadded forward pass per sequence.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dppo_core.engines.vllm import checkpoint_weights
from dppo_core.models import load_model
from dppo_core.rollout import (
    Completion,
    HFRollout,
    RolloutBatch,
    RolloutGroup,
    SamplingConfig,
    logprob_mismatch,
    make_rollout_engine,
    sequence_logprobs,
    truncated_importance_weights,
)
from dppo_core.tasks import ArithmeticTask

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (a few hand-computed weights, the factory, refusals and warnings) cannot.

G = 4  # completions per prompt


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts():
    return [p.messages() for p in ArithmeticTask().test_set(1)[:3]]


@pytest.fixture(scope="module")
def hf_batch(model_and_tokenizer, prompts):
    model, tok = model_and_tokenizer
    sampling = SamplingConfig(max_tokens=16, temperature=0.7, seed=1)
    return HFRollout(model, tok, batch_size=5).generate(prompts, G, sampling)  # 5: chunks straddle groups


@pytest.mark.numerics
def test_batch_structure(hf_batch, model_and_tokenizer, prompts):
    _, tok = model_and_tokenizer
    assert len(hf_batch.groups) == len(prompts)
    assert hf_batch.num_completions == len(prompts) * G
    for group in hf_batch.groups:
        assert len(group.completions) == G
        for c in group.completions:
            assert len(c.logprobs) == c.length == len(c.token_ids) >= 1
            assert all(lp <= 0 for lp in c.logprobs)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == tok.eos_token_id
            else:
                assert c.finish_reason == "length" and c.length == 16
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert hf_batch.num_generated_tokens == sum(map(sum, hf_batch.lengths()))


@pytest.mark.numerics
def test_sampling_logprobs_are_the_tempered_model_distribution(hf_batch, model_and_tokenizer):
    # An untrained model is near uniform over ~300 tokens, so transformers' default top_k=50 (if it
    # leaked in) would shift every log-prob by ~log(300/50) = 1.8.
    model, _ = model_and_tokenizer
    m = logprob_mismatch(model, hf_batch, temperature=0.7)
    assert m.num_tokens == hf_batch.num_generated_tokens
    assert m.max_abs < 1e-4, m
    wrong_t = logprob_mismatch(model, hf_batch, temperature=1.0)
    assert wrong_t.mean_abs > 1e-2, "the check must be able to tell temperatures apart"


@pytest.mark.numerics
def test_same_seed_same_samples(model_and_tokenizer, prompts):
    model, tok = model_and_tokenizer
    engine = HFRollout(model, tok)
    s = SamplingConfig(max_tokens=8, temperature=1.0, seed=7)
    a = engine.generate(prompts, G, s)
    b = engine.generate(prompts, G, s)
    c = engine.generate(prompts, G, SamplingConfig(max_tokens=8, temperature=1.0, seed=8))
    ids = lambda batch: [[x.token_ids for x in g.completions] for g in batch.groups]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


@pytest.mark.numerics
def test_no_seed_continues_the_global_stream(model_and_tokenizer, prompts):
    model, tok = model_and_tokenizer
    engine = HFRollout(model, tok)
    s = SamplingConfig(max_tokens=8, temperature=1.0)  # seed None
    torch.manual_seed(3)
    a, b = engine.generate(prompts, G, s), engine.generate(prompts, G, s)
    assert _ids(a) != _ids(b)  # the second call draws on from where the first stopped
    torch.manual_seed(3)
    assert _ids(engine.generate(prompts, G, s)) == _ids(a)  # and the global seed makes it reproducible


@pytest.mark.numerics
def test_greedy_is_argmax(model_and_tokenizer, prompts):
    model, tok = model_and_tokenizer
    batch = HFRollout(model, tok).generate(prompts[:1], 2, SamplingConfig(max_tokens=6, temperature=0))
    g = batch.groups[0]
    assert g.completions[0].token_ids == g.completions[1].token_ids
    seq = g.prompt_ids + g.completions[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]  # (len, vocab)
    P = len(g.prompt_ids)
    assert logits[P - 1 : len(seq) - 1].argmax(-1).tolist() == g.completions[0].token_ids


@pytest.mark.numerics
def test_sequence_logprobs_padded_equals_one_by_one(model_and_tokenizer):
    model, _ = model_and_tokenizer
    seqs = [[5, 9, 33, 2, 7], [11, 4], [8, 8, 8, 100, 101, 102, 103]]
    padded = sequence_logprobs(model, seqs, start=[2, 1, 4], temperature=0.5, batch_size=3)
    for seq, s, got in zip(seqs, [2, 1, 4], padded, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0] / 0.5, -1)  # (len, vocab)
        want = torch.stack([logp[t - 1, seq[t]] for t in range(s, len(seq))])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="start=0"):
        sequence_logprobs(model, seqs[:1], start=[0])


@pytest.mark.numerics
def test_mismatch_of_a_doctored_batch(model_and_tokenizer, hf_batch):
    # Shift every engine log-prob by 0.25: the measured mismatch must be exactly that.
    model, _ = model_and_tokenizer
    groups = [RolloutGroup(g.prompt, g.prompt_ids, [
        Completion(c.token_ids, c.text, [lp + 0.25 for lp in c.logprobs], c.finish_reason) for c in g.completions
    ]) for g in hf_batch.groups]
    m = logprob_mismatch(model, RolloutBatch(groups), temperature=0.7)
    assert m.mean_abs == pytest.approx(0.25, abs=1e-4)
    assert m.max_abs == pytest.approx(0.25, abs=1e-4)


def test_truncated_importance_weights():
    logp_train = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -1.0]], requires_grad=True)
    logp_engine = torch.tensor([[-1.0, -1.0, -2.5], [-3.5, -0.1, -0.2]])
    w = truncated_importance_weights(logp_train, logp_engine, cap=2.0)
    want = torch.tensor([[1.0, torch.e ** -1, 2.0], [torch.e ** 0.5, 1.0, torch.e ** -0.8]])
    torch.testing.assert_close(w, want)
    assert not w.requires_grad
    assert truncated_importance_weights(logp_train, logp_engine, cap=1e9)[0, 2].item() == pytest.approx(torch.e ** 2)
    with pytest.raises(ValueError, match="same shape"):
        truncated_importance_weights(logp_train, logp_engine[:, :2])
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(logp_train, logp_engine, cap=0.5)


@pytest.mark.numerics
def test_checkpoint_weights_of_peft_model_equal_merged(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(tiny_model_dir)
    plain = {k: v.clone() for k, v in checkpoint_weights(model).items()}  # merging below writes in place
    peft_model = get_peft_model(model, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    folded = checkpoint_weights(peft_model)
    assert set(folded) == set(plain)
    merged = peft_model.merge_and_unload().state_dict()
    changed = 0
    for k, v in folded.items():
        torch.testing.assert_close(v, merged[k], atol=1e-6, rtol=0)
        changed += not torch.equal(v, plain[k])
    assert changed == 3 * 5  # three target modules in each of the five layers


def test_factory_hf_and_vllm_missing(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    assert isinstance(make_rollout_engine("hf", model=model, tokenizer=tok), HFRollout)
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.warns(RuntimeWarning, match="falling back to transformers") as record:
        engine = make_rollout_engine("vllm", model=model, tokenizer=tok)
    assert isinstance(engine, HFRollout) and len(record) == 1
    with pytest.raises(RuntimeError, match="require=True"):
        make_rollout_engine("vllm", model=model, tokenizer=tok, require=True)
    with pytest.raises(ValueError, match="kind must be"):
        make_rollout_engine("sglang", model=model, tokenizer=tok)


def test_factory_bad_model_path_falls_back_or_raises(model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match="no-such-model"):
        make_rollout_engine("vllm", model=model, tokenizer=tok, model_path=missing, require=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = make_rollout_engine("auto", model=model, tokenizer=tok, model_path=missing)
    assert isinstance(engine, HFRollout)
    assert [str(w.message) for w in record if w.category is RuntimeWarning][0].startswith("vLLM could not start")


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingConfig(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)


def test_the_vllm_engine_has_one_import_path_which_does_not_import_vllm():
    # VLLMRollout, WeightSyncError and checkpoint_weights live in dppo_core.engines.vllm, and only there (the
    # lazy re-export from dppo_core.rollout was removed); neither module imports vLLM until an engine starts.
    import subprocess
    import sys

    code = ("import sys\n"
            "import dppo_core.rollout as r\n"
            "from dppo_core.engines.vllm import VLLMRollout, WeightSyncError, checkpoint_weights  # noqa: F401\n"
            "assert not any(hasattr(r, n) for n in ('VLLMRollout', 'WeightSyncError', 'checkpoint_weights'))\n"
            "print('vllm' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------------------------------
# The compact decode loop (finished sequences leave the batch) against transformers generate
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_model(warm_small_model_dir):
    return load_model(warm_small_model_dir)


@pytest.fixture(scope="module")
def mixed_prompts():
    """Prompts of every level: the warm-started small model answers some in a few tokens, others run long."""
    return [p.messages() for p in ArithmeticTask().test_set(2)]


def _ids(batch: RolloutBatch) -> list[list[list[int]]]:
    return [[c.token_ids for c in g.completions] for g in batch.groups]


@pytest.mark.numerics
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)],
                         ids=["T1", "T0.7-top_p0.9", "greedy"])
def test_compact_loop_gives_generates_samples(warm_model, mixed_prompts, temperature, top_p):
    model, tok = warm_model
    sampling = SamplingConfig(max_tokens=16, temperature=temperature, top_p=top_p, seed=5)
    # batch_size 7: chunks straddle groups, and the second chunk continues the first one's random stream
    compact = HFRollout(model, tok, batch_size=7).generate(mixed_prompts, G, sampling)
    reference = HFRollout(model, tok, batch_size=7, decode="generate").generate(mixed_prompts, G, sampling)
    lengths = [n for g in compact.lengths() for n in g]
    finishes = {c.finish_reason for g in compact.groups for c in g.completions}
    # the check means something only if sequences finish at different steps within a chunk
    assert len(set(lengths)) >= 3 and finishes == {"stop", "length"}, (lengths, finishes)
    assert _ids(compact) == _ids(reference)
    for gc, gr in zip(compact.groups, reference.groups, strict=True):
        for c, r in zip(gc.completions, gr.completions, strict=True):
            assert c.finish_reason == r.finish_reason and c.text == r.text
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)
    # and the samples depend on the seed (an engine that ignored it could not pass the equality above by luck)
    other = HFRollout(model, tok, batch_size=7).generate(mixed_prompts, G, SamplingConfig(
        max_tokens=16, temperature=temperature, top_p=top_p, seed=6))
    assert temperature == 0 or _ids(other) != _ids(compact)


def _decode_rows(model, prefill: list[int] | None = None) -> tuple[list[int], object]:
    """Rows of every one-token (decode) step of ``model``, recorded by a pre-hook on its token embedding, which
    the model's forward and the lean decode step both call (and the rows of every longer, prompt, forward in
    ``prefill``)."""
    rows: list[int] = []

    def hook(_module, args):
        ids = args[0]
        if ids.shape[1] == 1:
            rows.append(ids.shape[0])
        elif prefill is not None:
            prefill.append(ids.shape[0])

    return rows, model.get_input_embeddings().register_forward_pre_hook(hook)


@pytest.mark.numerics
def test_compact_loop_computes_only_running_sequences(warm_model, mixed_prompts):
    model, tok = warm_model
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=5)
    work, batches, prompt_rows = {}, {}, {}
    for decode in ("compact", "generate"):
        prompt_rows[decode] = []
        rows, handle = _decode_rows(model, prompt_rows[decode])
        try:
            batches[decode] = HFRollout(model, tok, decode=decode).generate(mixed_prompts, G, sampling)
        finally:
            handle.remove()
        work[decode] = sum(rows)
    compact, reference = batches["compact"], batches["generate"]
    n = compact.num_completions
    # the prompt is computed once per distinct prompt, not once per sequence
    assert prompt_rows["compact"] == [len(mixed_prompts)] and prompt_rows["generate"] == [n]
    # a sequence's first token comes from the prompt's forward; each later one from a decode step in which
    # the sequence, and only the sequences still running, are computed
    assert work["compact"] == compact.num_generated_tokens - n
    # generate computes every row until the longest completion ends
    assert work["generate"] == n * (max(max(g) for g in reference.lengths()) - 1) > work["compact"]


@pytest.mark.numerics
def test_compact_loop_on_a_peft_model(warm_small_model_dir, mixed_prompts):
    from peft import LoraConfig, get_peft_model

    model, tok = load_model(warm_small_model_dir)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights=False))
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=3)
    compact = HFRollout(model, tok).generate(mixed_prompts, G, sampling)
    finishes = {c.finish_reason for g in compact.groups for c in g.completions}
    assert len({n for g in compact.lengths() for n in g}) >= 3 and finishes == {"stop", "length"}
    assert _ids(compact) == _ids(HFRollout(model, tok, decode="generate").generate(mixed_prompts, G, sampling))
    assert logprob_mismatch(model, compact).max_abs < 1e-4


def _with_shared_prefix(prompts: list) -> list:
    """``prompts`` after a long system message and one solved example: what a few-shot prompt (the smollm2
    presets') looks like, a shared prefix far longer than MIN_SHARED_PREFIX."""
    shot = ArithmeticTask().train(3)[0]
    head = [{"role": "system", "content": "You are a careful calculator. Add, subtract and multiply exactly, "
                                          "then box the answer."},
            {"role": "user", "content": shot.prompt}, {"role": "assistant", "content": shot.solution("equation")}]
    return [head + list(p) for p in prompts]


@pytest.mark.numerics
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "forward"])
def test_a_prefix_all_prompts_share_is_computed_once(warm_model, mixed_prompts, lean):
    """Prompts that start alike (a system message, solved examples): the compact loop computes the shared
    tokens once for the chunk and each prompt's own tokens after them, and still gives generate's samples."""
    from dppo_core.engines.prompt_rows import MIN_SHARED_PREFIX, shared_prefix_length
    from dppo_core.models import encode_prompt

    model, tok = warm_model
    prompts = _with_shared_prefix(mixed_prompts)
    shared = shared_prefix_length([encode_prompt(tok, p) for p in prompts])
    assert shared >= MIN_SHARED_PREFIX
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=5)
    prefill: list[int] = []
    rows, handle = _decode_rows(model, prefill)
    try:
        compact = HFRollout(model, tok, batch_size=7, lean=lean).generate(prompts, G, sampling)
    finally:
        handle.remove()
    reference = HFRollout(model, tok, batch_size=7, decode="generate").generate(prompts, G, sampling)
    finishes = {c.finish_reason for g in compact.groups for c in g.completions}
    assert len({n for g in compact.lengths() for n in g}) >= 3 and finishes == {"stop", "length"}
    assert _ids(compact) == _ids(reference)
    for gc, gr in zip(compact.groups, reference.groups, strict=True):
        for c, r in zip(gc.completions, gr.completions, strict=True):
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)
    # per chunk of 7 sequences: one row for the shared prefix, then one per distinct prompt of the chunk
    chunks = [list(range(len(prompts) * G))[i:i + 7] for i in range(0, len(prompts) * G, 7)]
    distinct = [len({j // G for j in chunk}) for chunk in chunks]
    assert prefill == [n for d in distinct for n in ((1, d) if d > 1 else (d,))]
    unshared = HFRollout(model, tok, batch_size=7, lean=lean, share_prefix=False).generate(prompts, G, sampling)
    assert _ids(unshared) == _ids(compact)


def test_the_shared_prefix_layout_keeps_every_prompt_token_at_its_position(monkeypatch):
    import dppo_core.engines.prompt_rows as rows

    monkeypatch.setattr(rows, "MIN_SHARED_PREFIX", 2)
    assert rows.shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
    assert rows.shared_prefix_length([[1, 2, 3], [1, 2, 3, 5]]) == 2  # each prompt keeps a token of its own
    assert rows.shared_prefix_length([[1, 2, 3], [9, 2, 3]]) == 0 and rows.shared_prefix_length([[1, 2, 3]]) == 0
    monkeypatch.setattr(rows, "MIN_SHARED_PREFIX", 4)
    assert rows.shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 0  # too short to be worth a forward
    ids, mask = rows.prefix_padded([[1, 2, 3, 4], [1, 2, 3, 5, 6]], 3, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 0, 4], [1, 2, 3, 5, 6]]
    assert mask.tolist() == [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert positions[mask.bool()].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]


def test_hf_rollout_refuses_bad_settings(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match="decode must be one of"):
        HFRollout(model, tok, decode="static")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        HFRollout(model, tok, batch_size=0)


@pytest.mark.numerics
def test_compact_loop_with_absolute_positions(tiny_model_dir):
    """A random GPT-2 (learned absolute positions, another cache layout): the compact loop still gives
    generate's samples. Its completions are made to end at random steps by a wide stop set."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = load_model(tiny_model_dir)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=2, n_head=2,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    prompts = [p.messages() for p in ArithmeticTask().test_set(1)]
    sampling = SamplingConfig(max_tokens=20, temperature=1.0, seed=2)
    engines = [HFRollout(model, tok, batch_size=6, decode=d) for d in ("compact", "generate")]
    for e in engines:
        e.stop_ids = sorted(set(e.stop_ids) | set(range(100, 160)))  # about 1 in 8 tokens ends a completion
    compact, reference = (e.generate(prompts, G, sampling) for e in engines)
    assert len({n for g in compact.lengths() for n in g}) >= 5
    assert _ids(compact) == _ids(reference)
    for gc, gr in zip(compact.groups, reference.groups, strict=True):
        for c, r in zip(gc.completions, gr.completions, strict=True):
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_compact_loop_warns_about_generation_config_processors_it_does_not_apply(warm_small_model_dir):
    model, tok = load_model(warm_small_model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HFRollout(model, tok)  # the embedded models ask for nothing beyond temperature and top-p
    model.generation_config.repetition_penalty = 1.1
    with pytest.warns(UserWarning, match="repetition_penalty=1.1, which HFRollout's compact loop does not apply"):
        HFRollout(model, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HFRollout(model, tok, decode="generate")  # generate applies them


@pytest.mark.numerics
def test_a_cache_that_cannot_drop_rows_falls_back_to_generate(warm_model, mixed_prompts, monkeypatch):
    import dppo_core.engines.hf as hf_engine

    model, tok = warm_model
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=4)
    reference = HFRollout(model, tok, decode="generate").generate(mixed_prompts[:3], G, sampling)
    monkeypatch.setattr(hf_engine, "_rows_can_leave", lambda cache: False)
    rows, handle = _decode_rows(model)
    try:
        with pytest.warns(UserWarning, match="decoding with transformers generate"):
            batch = HFRollout(model, tok).generate(mixed_prompts[:3], G, sampling)
    finally:
        handle.remove()
    assert _ids(batch) == _ids(reference)
    assert len(set(rows)) == 1  # every decode step ran the whole batch: generate did the work


def test_compact_loop_refuses_non_finite_logits(warm_small_model_dir, mixed_prompts):
    model, tok = load_model(warm_small_model_dir)
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(RuntimeError, match="inf or nan"):
        HFRollout(model, tok).generate(mixed_prompts[:1], 2, SamplingConfig(max_tokens=4, seed=0))


class _BareForward(torch.nn.Module):
    """A causal LM whose forward takes neither ``position_ids`` nor ``logits_to_keep``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.generation_config = inner.generation_config

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                          use_cache=use_cache)


@pytest.mark.numerics
def test_compact_loop_passes_only_what_the_forward_takes(warm_model, mixed_prompts):
    model, tok = warm_model
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=8)
    prompt = mixed_prompts[:1]  # one prompt, G samples: no padding, so the model's own positions are right
    bare = HFRollout(_BareForward(model), tok).generate(prompt, 6, sampling)
    assert _ids(bare) == _ids(HFRollout(model, tok).generate(prompt, 6, sampling))
    assert len(set(bare.lengths()[0])) >= 2  # rows left the batch on the bare path too
