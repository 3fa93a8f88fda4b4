"""The GRPO trainer on a small local model: updates, LoRA, QLoRA on CPU, checkpoints and resume."""

import json
import math

import pytest
import torch
from run_helpers import parity_reward
from run_helpers import run_config as _config

from dppo_core.config import ConfigError, DPPOConfig
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.metrics import unknown_keys
from dppo_core.models import load_model
from dppo_core.rollout import HFRollout, SamplingConfig
from dppo_core.trainer import DPPOTrainer, learning_rate_at

# `numerics` per test (run under the Makefile's second kernel setting too): those whose outcome can depend on a
# floating-point kernel; the others (learning-rate schedules in Python floats, refusals) cannot.


def _trainer(config):
    return DPPOTrainer(config, reward_funcs=[parity_reward], progress=False)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.numerics
def test_a_step_changes_the_weights_and_logs_every_metric(small_model_dir, tmp_path):
    trainer = _trainer(_config(small_model_dir, tmp_path, eval_levels=(1, 2, 3)))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "reward_std", "reward_parity_reward", "zero_std_groups", "completion_length",
                "clip_fraction", "kl",
                "grad_norm", "tokens_generated", "tokens_trained", "time_rollout", "time_reward",
                "time_update", "time_sync"):
        assert key in rows[0], key
    evals = _lines(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2] and "sampled_L3" in evals[-1] and "greedy_L1_stderr" in evals[-1]
    assert (tmp_path / "final" / "config.json").exists()


def test_learning_rate_schedules_warm_up_then_decay_to_the_floor():
    at = lambda **kw: [learning_rate_at(s, DPPOConfig(learning_rate=1.0, max_steps=6, **kw)) for s in range(6)]  # noqa: E731
    assert at() == [1.0] * 6
    assert at(warmup_steps=2) == [0.5] + [1.0] * 5
    assert at(warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.2) == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4])
    cosine = at(lr_schedule="cosine", min_lr_ratio=0.1)
    assert cosine[0] == 1.0 and cosine[3] == pytest.approx(0.55)
    assert all(a > b > 0.1 for a, b in zip(cosine, cosine[1:], strict=False))
    assert learning_rate_at(6, DPPOConfig(learning_rate=1.0, max_steps=6, lr_schedule="cosine")) == pytest.approx(0.0)


@pytest.mark.parametrize("kw, trl_kw", [(dict(lr_schedule="cosine"), dict(lr_scheduler_type="cosine")),
                                        (dict(lr_schedule="linear"), dict(lr_scheduler_type="linear")),
                                        (dict(lr_schedule="cosine", min_lr_ratio=0.1),
                                         dict(lr_scheduler_type="cosine_with_min_lr",
                                              lr_scheduler_kwargs={"min_lr_rate": 0.1}))])
def test_the_trl_peer_gets_the_same_schedule_after_the_warm_up(kw, trl_kw):
    from transformers import get_scheduler

    from dppo_core.tools.bench.peers import trl_lr_schedule

    config = DPPOConfig(learning_rate=2e-4, max_steps=10, warmup_steps=3, **kw)
    assert trl_lr_schedule(config) == trl_kw
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.learning_rate)
    scheduler = get_scheduler(trl_kw["lr_scheduler_type"], optimizer, num_warmup_steps=3, num_training_steps=10,
                              scheduler_specific_kwargs=trl_kw.get("lr_scheduler_kwargs"))
    theirs = []
    for _ in range(10):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [learning_rate_at(s, config) for s in range(3, 10)] == pytest.approx(theirs[3:])


@pytest.mark.numerics
def test_the_trainer_follows_the_schedule(small_model_dir, tmp_path):
    trainer = _trainer(_config(small_model_dir, tmp_path, max_steps=3, save_steps=0, warmup_steps=1,
                               lr_schedule="linear", min_lr_ratio=0.5))
    trainer.train()
    assert [r["lr"] for r in _lines(tmp_path / "metrics.jsonl")] == pytest.approx([1e-3, 1e-3, 7.5e-4])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(7.5e-4)


@pytest.mark.numerics
def test_interrupted_and_resumed_run_equals_uninterrupted(small_model_dir, tmp_path):
    full = _trainer(_config(small_model_dir, tmp_path / "a", max_steps=4, num_iterations=2))
    full.train()
    first = _trainer(_config(small_model_dir, tmp_path / "b", max_steps=2, num_iterations=2))
    first.train()
    resumed = _trainer(_config(small_model_dir, tmp_path / "b", max_steps=4, num_iterations=2))
    resumed.train(resume=True)
    assert resumed.step == 4
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time") and k != "step_time"} for r in rows]  # noqa: E731
    assert drop(_lines(tmp_path / "a" / "metrics.jsonl")) == drop(_lines(tmp_path / "b" / "metrics.jsonl"))
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # checkpoints are whole directories or absent; older ones are pruned
    names = sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-3", "checkpoint-4"]
    assert not list((tmp_path / "b").glob(".tmp-*"))


@pytest.mark.numerics
def test_lora_trains_only_the_adapter_and_merged_equals_unmerged(small_model_dir, tmp_path):
    trainer = _trainer(_config(small_model_dir, tmp_path, update_mode="lora", lora_r=4, lora_alpha=8,
                                  learning_rate=1e-2))
    trainer.train()
    model = trainer.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    seqs = [[1, 5, 9, 13, 2, 7], [4, 8, 15, 16, 23]]
    with torch.no_grad():
        unmerged, mask = completion_logprobs_with_grad(model, [s[:2] for s in seqs], [s[2:] for s in seqs], 1.0, 0)
        merged_model = model.merge_and_unload()
        merged, _ = completion_logprobs_with_grad(merged_model, [s[:2] for s in seqs], [s[2:] for s in seqs], 1.0, 0)
    assert (unmerged - merged).abs().max() < 1e-5


@pytest.mark.numerics
def test_lora_reference_policy_is_the_base_with_the_adapter_off(small_model_dir, tmp_path):
    trainer = _trainer(_config(small_model_dir, tmp_path, update_mode="lora", beta=0.1, learning_rate=1e-2,
                                  lora_r=4))
    trainer.train()
    rows = _lines(tmp_path / "metrics.jsonl")
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts at zero: policy == reference
    assert rows[1]["kl"] > 0
    assert trainer.ref_model is None


def _lora_grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logp, mask = completion_logprobs_with_grad(model, [[1, 5, 9]], [[13, 2, 7, 4]], 1.0, 0)
    (-(logp * mask).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _grads_before_and_after_generate(model_dir, apply_fix: bool):
    config = DPPOConfig(model=str(model_dir), update_mode="qlora4", lora_r=8, lora_alpha=16)
    model, tok = DPPOTrainer(config, progress=False).model, None
    with torch.no_grad():  # give lora_B non-zero values so every adapter matrix has a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    if not apply_fix:  # undo the trainer's workaround, to show what it prevents
        for m in model.modules():
            if type(m).__name__ == "Linear4bit":
                m.support_avx512bf16_for_cpu = True
    before = _lora_grads(model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    HFRollout(model, tok).generate(["What is 1+1?"], 2, SamplingConfig(max_tokens=4, seed=0))
    model.train()
    return before, _lora_grads(model)


@pytest.mark.numerics
def test_qlora4_gradients_survive_generate_on_cpu(small_model_dir):
    """bitsandbytes' CPU 4-bit path loses its backward after a no-grad generate unless the trainer's fix is on."""
    pytest.importorskip("bitsandbytes")
    before, after = _grads_before_and_after_generate(small_model_dir, apply_fix=True)
    for name in before:
        assert torch.allclose(before[name], after[name], rtol=1e-3, atol=1e-6), name
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16"):
        # negative control: without the fix, gradients that flow back through a 4-bit matmul change
        before, after = _grads_before_and_after_generate(small_model_dir, apply_fix=False)
        assert any(not torch.allclose(before[n], after[n], rtol=1e-3, atol=1e-6) for n in before)


@pytest.mark.numerics
def test_qlora4_loss_decreases_after_generate(small_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    trainer = _trainer(_config(small_model_dir, tmp_path, update_mode="qlora4", lora_r=8, lora_alpha=16,
                               learning_rate=1e-2))
    model, tok = trainer.model, trainer.tokenizer
    HFRollout(model, tok).generate(["What is 1+1?"], 2, SamplingConfig(max_tokens=4, seed=0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(10):
        model.train()
        logp, mask = completion_logprobs_with_grad(model, [[1, 5, 9]], [[13, 2, 7, 4]], 1.0, 0)
        loss = -(logp * mask).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses


def test_bad_model_path_and_prompt_longer_than_context(small_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _trainer(_config("./no/such/model", tmp_path))
    with pytest.raises(ConfigError, match="max_completion_length"):
        _trainer(_config(small_model_dir, tmp_path, max_completion_length=600))


def test_a_prompt_longer_than_the_context_names_the_prompt(small_model_dir, tmp_path):
    from dppo_core.data import PromptSource

    long_row = {"id": "too-long", "prompt": [{"role": "user", "content": "1+" * 400 + "1"}], "answer": "401"}
    trainer = DPPOTrainer(_config(small_model_dir, tmp_path), prompt_source=PromptSource([long_row]),
                          progress=False)
    with pytest.raises(ConfigError, match="'too-long' has .* tokens"):
        trainer.train()


def test_empty_dataset_is_refused():
    from dppo_core.data import PromptSource

    with pytest.raises(ConfigError, match="empty"):
        PromptSource([])


@pytest.mark.numerics
def test_engine_log_probs_match_the_update_forward(small_model_dir):
    """The update's forward pass gives the sampler's log-probs for the same tokens (ratio 1 on-policy)."""
    model, tok = load_model(small_model_dir)
    batch = HFRollout(model, tok).generate(["What is 2+3?"], 3, SamplingConfig(max_tokens=8, temperature=0.7, seed=1))
    g = batch.groups[0]
    comps = [c for c in g.completions if c.token_ids]
    with torch.no_grad():
        logp, mask = completion_logprobs_with_grad(model, [g.prompt_ids] * len(comps),
                                                   [c.token_ids for c in comps], 0.7, tok.pad_token_id)
    for i, c in enumerate(comps):
        assert torch.allclose(logp[i, : c.length], torch.tensor(c.logprobs), atol=1e-4)


@pytest.mark.numerics
def test_ctrl_c_finishes_the_step_writes_a_checkpoint_and_resumes(small_model_dir, tmp_path):
    import os
    import signal

    def press_ctrl_c(metrics):
        if metrics.get("step") == 1:
            os.kill(os.getpid(), signal.SIGINT)

    handler_before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
    trainer = _trainer(_config(small_model_dir, tmp_path, max_steps=3, save_steps=0))
    trainer.callbacks.append(press_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [p.name for p in trainer.checkpoints()] == ["checkpoint-1"]
    resumed = _trainer(_config(small_model_dir, tmp_path, max_steps=3, save_steps=0))
    resumed.train(resume=True)
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is handler_before  # the trainer puts the previous handler back


def _metrics_without_times(path):
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "step_time"} for r in _lines(path)]


@pytest.mark.numerics
@pytest.mark.parametrize("keep_all", [dict(prompt_prune_rate=0.0, completion_prune_rate=0.0),
                                      dict(prompt_prune_rate=0.5, completion_prune_rate=0.5,
                                           min_prompt_keep_prob=1.0, min_completion_keep_prob=1.0)])
def test_dppo_with_every_keep_probability_one_is_grpo_step_for_step(small_model_dir, tmp_path, keep_all):
    grpo = _trainer(_config(small_model_dir, tmp_path / "grpo", max_steps=3, num_iterations=2))
    grpo.train()
    dppo = _trainer(_config(small_model_dir, tmp_path / "dppo", max_steps=3, num_iterations=2, pruning="dppo",
                            drop_zero_advantage=False, **keep_all))
    dppo.train()
    pruning_keys = {"prompts_candidates", "prompts_rolled_out", "completions_rolled_out", "tokens_saved_rollout_est",
                    "tokens_saved_update", "weight_ess", "weight_max"}
    a = _metrics_without_times(tmp_path / "grpo" / "metrics.jsonl")
    b = _metrics_without_times(tmp_path / "dppo" / "metrics.jsonl")
    assert a == b
    assert all(r["tokens_saved_update"] == 0 and r["weight_max"] == 1.0 for r in b) and pruning_keys <= set(b[0])
    for (name, x), y in zip(grpo.model.state_dict().items(), dppo.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.numerics
@pytest.mark.parametrize("schemes", [
    dict(prompt_scheme="proportional"),
    # the variance-aware schemes: a posterior over prompts, a token budget over completions, a sorted design
    dict(prompt_scheme="posterior", completion_scheme="length", fixed_size_design="pivotal", posterior_half_life=2.0),
], ids=["proportional", "posterior-length-pivotal"])
def test_pruned_run_trains_on_fewer_tokens_and_resumes_exactly(small_model_dir, tmp_path, schemes):
    kw = dict(max_steps=4, pruning="dppo", prompt_prune_rate=0.5, completion_prune_rate=0.5,
              fixed_size_sampling=True, dense_prompts=True, prompts_per_step=4, **schemes)
    full = _trainer(_config(small_model_dir, tmp_path / "a", **kw))
    full.prompts.rows = full.prompts.rows[:6]  # a small dataset, so prompts recur and their history is used
    full.prompts.weights = None
    full.train()
    rows = _lines(tmp_path / "a" / "metrics.jsonl")
    assert all(r["tokens_saved_update"] > 0 for r in rows)
    assert all(r["sequences_trained"] <= r["completions_rolled_out"] for r in rows)
    assert any(r["prompts_candidates"] > r["prompts_rolled_out"] for r in rows), rows  # history pruned some prompts
    # dense prompts + fixed size: the generation batch stays full
    assert all(r["prompts_rolled_out"] == 4 for r in rows)
    assert len(full.history) > 0
    first = _trainer(_config(small_model_dir, tmp_path / "b", **{**kw, "max_steps": 2}))
    first.prompts.rows, first.prompts.weights = full.prompts.rows, None
    first.train()
    assert (tmp_path / "b" / "checkpoint-2" / "prompt_history.json").is_file()
    resumed = _trainer(_config(small_model_dir, tmp_path / "b", **kw))
    resumed.prompts.rows, resumed.prompts.weights = full.prompts.rows, None
    resumed.train(resume=True)
    assert resumed.history.records == full.history.records
    a, b = (_metrics_without_times(tmp_path / name / "metrics.jsonl") for name in ("a", "b"))
    assert a == b
    for (name, x), y in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.numerics
@pytest.mark.parametrize("scheme", ["constant", "posterior"])
def test_a_pilot_rolls_out_the_rest_of_the_continued_groups_and_resumes_exactly(small_model_dir, tmp_path, scheme):
    """Pilot, then continue, through the trainer: each step generates k completions per kept prompt and G - k more for
    the continued groups (a second engine call with its own seed), trains on whole groups of G, logs the stopped
    groups' pilots, and a run stopped after 2 steps and resumed takes the same 4 steps as one that was not."""
    kw = dict(max_steps=4, pruning="dppo", prompt_prune_rate=0.5, prompt_scheme="posterior", dense_prompts=True,
              pilot_size=2, continue_probability=0.3, continue_scheme=scheme, prompts_per_step=4)
    full = _trainer(_config(small_model_dir, tmp_path / "a", **kw))
    full.prompts.rows, full.prompts.weights = full.prompts.rows[:6], None  # prompts recur: their history is used
    calls, in_step = [], []  # the engine calls of the training steps (not of the evaluations)
    full.start()
    generate, train_step = full.engine.generate, full.train_step

    def counted(prompts, n, sampling):
        if in_step:
            calls.append((full.step, len(prompts), n, sampling.seed,
                          (sampling.temperature, sampling.top_p, sampling.max_tokens)))
        return generate(prompts, n, sampling)

    def step():
        in_step.append(1)
        try:
            return train_step()
        finally:
            in_step.pop()

    full.engine.generate, full.train_step = counted, step
    full.train()
    rows = _lines(tmp_path / "a" / "metrics.jsonl")
    groups = _lines(tmp_path / "a" / "groups.jsonl")
    assert len(rows) == len(groups) == 4 and unknown_keys(rows) == []  # every key in metrics.jsonl's schema
    by_step = {g["step"]: g for g in groups}
    assert sorted(by_step) == [r["step"] for r in rows] == [1, 2, 3, 4]  # one group line per step, under its step
    for r in rows:
        g = by_step[r["step"]]  # paired by step, not by position: a line written under the wrong step fails here
        stopped = g.get("stopped", {"ids": [], "rewards": [], "lengths": []})
        step_calls = [c for c in calls if c[0] == r["step"] - 1]
        assert step_calls[0][1:3] == (r["prompts_rolled_out"], 2)  # the pilot: k = 2 for every kept prompt
        continued = len(g["ids"])
        assert r["prompts_rolled_out"] == continued + r["pilot_groups_stopped"] == continued + len(stopped["ids"])
        if continued:  # the rest: G - k = 2 more for each continued group, from another random stream, sampled
            # as the pilot was (the same temperature, top-p and length: one group's completions, one distribution)
            assert step_calls[1][1:3] == (continued, 2) and step_calls[1][3] != step_calls[0][3]
            assert step_calls[1][4] == step_calls[0][4] == (full.config.temperature, full.config.top_p,
                                                         full.config.max_completion_length)
        assert all(len(x) == 4 for x in g["rewards"]) and all(len(x) == 2 for x in stopped["rewards"])
        assert all(len(set(x)) == 1 for x in stopped["rewards"])  # only an all-equal pilot can be stopped
        assert r["completions_rolled_out"] == 2 * r["prompts_rolled_out"] + 2 * continued
        assert r["tokens_generated"] == sum(map(sum, g["lengths"])) + sum(map(sum, stopped["lengths"]))
        # the rollout saved: the window's full groups at this step's mean length, less what was generated (pilots too)
        window_tokens = round(r["prompts_candidates"] * 4 * r["tokens_generated"] / r["completions_rolled_out"])
        assert r["tokens_saved_rollout_est"] == window_tokens - r["tokens_generated"]
        assert r["decode_steps"] <= 2 * 12
    assert sum(r["pilot_groups_stopped"] for r in rows) > 0  # the continue draw stopped some
    first = _trainer(_config(small_model_dir, tmp_path / "b", **{**kw, "max_steps": 2}))
    first.prompts.rows, first.prompts.weights = full.prompts.rows, None
    first.train()
    resumed = _trainer(_config(small_model_dir, tmp_path / "b", **kw))
    resumed.prompts.rows, resumed.prompts.weights = full.prompts.rows, None
    resumed.train(resume=True)
    assert resumed.history.records == full.history.records
    assert _metrics_without_times(tmp_path / "a" / "metrics.jsonl") == _metrics_without_times(
        tmp_path / "b" / "metrics.jsonl")
    for (name, x), y in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_a_step_whose_groups_all_stop_after_the_pilot_is_skipped_and_logged(small_model_dir, tmp_path):
    """Every pilot of one completion is all equal; at c = 0.001 every group stops (for this seed): the step trains
    nothing, counts its rollout time and tokens, and logs the stopped groups."""
    trainer = _trainer(_config(small_model_dir, tmp_path, max_steps=1, pruning="dppo", pilot_size=1,
                               continue_probability=0.001))
    trainer.start()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    record = trainer.train_step()
    assert record["skipped"] == 1 and record["pilot_groups_stopped"] == record["prompts_rolled_out"] == 4
    assert unknown_keys([record]) == []
    assert record["tokens_trained"] == 0 and record["tokens_generated"] == record["pilot_tokens"] > 0
    assert record["time_rollout"] > 0 and record["completions_rolled_out"] == 4
    assert trainer.last_groups["rewards"] == [] and len(trainer.last_groups["stopped"]["ids"]) == 4
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.numerics
def test_a_step_whose_prompts_are_all_pruned_is_skipped_and_counted(small_model_dir, tmp_path):
    from dppo_core.pruning import PromptHistory

    trainer = _trainer(_config(small_model_dir, tmp_path, max_steps=1, pruning="greso", prompt_prune_rate=0.99))
    ids = [str(r["id"]) for r in trainer.prompts.rows]
    trainer.history = PromptHistory()
    trainer.history.update(ids, torch.zeros(len(ids), 2), torch.zeros(len(ids), 2), step=0)  # all degenerate
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    record = trainer.train_step()
    # 4 prompts each kept with probability 0.01: all pruned for this seed
    assert record["skipped"] == 1 and record["prompts_rolled_out"] == 0 and record["tokens_trained"] == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.step == 1 and unknown_keys([record]) == []


def test_pruning_config_errors_say_how_to_fix(small_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="pruning is 'none'"):
        _config(small_model_dir, tmp_path, completion_prune_rate=0.5)
    with pytest.raises(ConfigError, match="completion_prune_rate=1.0"):
        _config(small_model_dir, tmp_path, pruning="dppo", completion_prune_rate=1.0)
    with pytest.raises(ConfigError, match="min_completion_keep_prob"):
        _config(small_model_dir, tmp_path, pruning="dppo", min_completion_keep_prob=0.0)
    with pytest.raises(ConfigError, match="CPPO prunes completions only"):
        _config(small_model_dir, tmp_path, pruning="cppo", prompt_prune_rate=0.5)


def _first_step_gradients(trainer):
    """The trainer's first step, returning the gradient of every trained parameter as it reached the optimizer
    (after clipping, before AdamW moves the weights)."""
    grads = {}

    def keep(optimizer, args, kwargs):
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                          if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(keep)
    trainer.train()
    return grads


@pytest.mark.numerics
@pytest.mark.parametrize("extra", [dict(), dict(beta=0.1, num_iterations=2)])
def test_packed_updates_equal_padded_updates(small_model_dir, tmp_path, extra):
    """Packing changes the layout, not the maths: one step's metrics and gradient equal the padded layout's to
    float32 rounding. Checked at one step's gradient, not at the weights after AdamW steps: Adam divides by
    sqrt(v), which turns a rounding-level difference in a near-zero gradient coordinate into a step the size of
    the learning rate, so weights after Adam steps differ on another CPU's kernels."""
    kw = dict(max_steps=1, pruning="dppo", completion_prune_rate=0.5, save_steps=0, **extra)
    padded = _trainer(_config(small_model_dir, tmp_path / "padded", **kw))
    g_padded = _first_step_gradients(padded)
    packed = _trainer(_config(small_model_dir, tmp_path / "packed", packing=True, max_tokens_per_row=64,
                              packing_rows_per_micro_batch=3, **kw))
    g_packed = _first_step_gradients(packed)
    (ra,), (rb,) = _lines(tmp_path / "padded" / "metrics.jsonl"), _lines(tmp_path / "packed" / "metrics.jsonl")
    assert ra["tokens_trained"] == rb["tokens_trained"] and ra["sequences_trained"] == rb["sequences_trained"]
    for key in ("loss", "grad_norm", "kl"):
        assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key
    assert rb["update_density"] >= ra["update_density"] and rb["padding_avoided"] >= 0
    assert g_padded.keys() == g_packed.keys() and g_padded
    # Each gradient entry sums one term per trained token; another layout sums them in another order, which
    # float32 rounds differently by about eps * sqrt(tokens) relative to the entry's scale (a random walk of
    # roundings). Measured: at most 0.72 of that, under the Makefile's pins and under PyTorch's generic kernels with
    # MKL's compatible path; the bound allows 16.
    eps = torch.finfo(torch.float32).eps
    for name, x in g_padded.items():
        tol = 16 * eps * math.sqrt(ra["tokens_trained"]) * max(x.abs().max().item(), 1e-12)
        worst = (g_packed[name] - x).abs().max().item()
        assert worst <= tol, f"{name}: packed gradient differs from padded by {worst:.3g} (bound {tol:.3g})"


def test_a_run_trains_and_evaluates_on_its_system_prompt_and_solved_example(small_model_dir, tmp_path):
    """``system_prompt`` and ``few_shot`` reach every prompt the engine is sent, rollouts and evaluations alike;
    ``cpu_threads`` sets PyTorch's threads (the real-model presets' one thread)."""
    from dppo_core.data import prompt_renderer

    before = torch.get_num_threads()
    config = _config(small_model_dir, tmp_path, max_steps=1, few_shot=1, system_prompt="Answer briefly.",
                     cpu_threads=1, update_mode="lora", shared_prefix=True, train_levels=(3,))
    try:
        trainer = _trainer(config)
        assert torch.get_num_threads() == 1
        trainer.engine = trainer.make_engine()
        sent, generate = [], trainer.engine.generate
        trainer.engine.generate = lambda prompts, *a, **k: (sent.append(list(prompts)), generate(prompts, *a, **k))[1]
        trainer.train()
    finally:
        torch._C.set_num_threads(before)  # torch._C: see dppo_core.run
    head = prompt_renderer(config)([])
    assert [m["role"] for m in head] == ["system", "user", "assistant"]
    assert len(sent) == 5  # evaluation at step 0 (greedy, sampled), the step's rollout, the final evaluation
    assert all(p[:3] == head and p[3]["role"] == "user" and len(p) == 4 for batch in sent for p in batch)
    assert [e["step"] for e in _lines(tmp_path / "eval.jsonl")] == [0, 1]
