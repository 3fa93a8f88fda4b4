"""The rollout plans that read rewards (dppo_core.plans), the baselines practitioners run instead of DPPO's prompt
stage, on the small test model with a reward whose all-equal groups are known in advance: DAPO's dynamic sampling, it
with GRESO's skip, and an offline filter of the pool. Each runs in the plain DPPOTrainer, chosen by rollout_plan."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from mutants import LineMutant
from run_helpers import run_config

from dppo_core import registry
from dppo_core.config import ConfigError
from dppo_core.data import prompt_key
from dppo_core.grouplog import read_groups
from dppo_core.metrics import unknown_keys
from dppo_core.plans import Plain, make_plan
from dppo_core.plans.dynamic_sampling import (
    DAPO_MAX_ROUNDS,
    MAX_ROUNDS,
    OVERSAMPLE,
    DynamicSampling,
    OversampledDynamicSampling,
)
from dppo_core.plans.offline_filter import OfflineFilter
from dppo_core.plans.pilot import Pilot
from dppo_core.tools.bench.presets import BENCH_PRESETS, method_config
from dppo_core.trainer import DPPOTrainer


def constant(row_id: str) -> bool:
    return zlib.crc32(row_id.encode()) % 2 == 0


def constant_for_half(prompts, completions, id, **columns):  # noqa: A002 (the task's column is named id)
    """1 for every completion of the prompts whose id hashes even (their groups are always all equal); the parity
    of the completion's length for the others (mixed groups, mostly)."""
    return [1.0 if constant(i) else float(len(c) % 2 == 0) for i, c in zip(id, completions, strict=True)]


def always_one(prompts, completions, **columns):
    return [1.0] * len(completions)


def _config(model_dir, out, **kw):
    return run_config(model_dir, out, **(dict(max_completion_length=10, save_steps=0, eval_steps=0,
                                              eval_problems_per_level=2, train_pool_size=16, beta=0.0,
                                              pruning="dppo", drop_zero_advantage=True,
                                              rollout_plan="dynamic_sampling") | kw))


def _filter(model_dir, out, **kw):
    return _config(model_dir, out, rollout_plan="offline_filter", **kw)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _all_equal(row) -> bool:
    return len(set(row)) == 1


class SpyTrainer(DPPOTrainer):
    """Records the rewards of the groups each step trains on."""

    def weigh(self, selection, rewards, lengths, step, **kwargs):
        self.trained = [*getattr(self, "trained", []), rewards.clone()]
        return super().weigh(selection, rewards, lengths, step, **kwargs)


def test_dynamic_sampling_trains_only_mixed_groups_and_logs_every_group_it_rolled_out(small_model_dir, tmp_path):
    trainer = SpyTrainer(_config(small_model_dir, tmp_path, max_steps=3), reward_funcs=[constant_for_half],
                         progress=False)
    assert isinstance(trainer.plan, DynamicSampling)
    trainer.train()
    steps = [m for m in _lines(tmp_path / "metrics.jsonl") if "step_time" in m]
    groups = read_groups(tmp_path)
    assert len(steps) == len(groups) == 3 and unknown_keys(steps) == []
    for m, g, trained in zip(steps, groups, trainer.trained, strict=True):
        mixed = sum(not _all_equal(r) for r in g["rewards"])
        assert len(g["ids"]) == m["prompts_rolled_out"] == m["completions_rolled_out"] // 4
        assert sum(map(sum, g["lengths"])) == m["tokens_generated"] and g["window"] == m["prompts_candidates"]
        assert g["window"] >= len(g["ids"]) and all(p == 1.0 for p in g["pi"])
        # the first (at most) prompts_per_step mixed groups train; every other rolled-out group was dropped
        assert trained.shape[0] == min(4, mixed) and all(not _all_equal(r.tolist()) for r in trained)
        assert m["ds_dropped_groups"] == len(g["ids"]) - trained.shape[0]
        assert m["zero_std_groups"] == pytest.approx(sum(map(_all_equal, g["rewards"])) / len(g["ids"]))
        assert 1 <= m["ds_rounds"] <= MAX_ROUNDS and (mixed >= 4 or m["ds_rounds"] == MAX_ROUNDS)
        assert m["sequences_trained"] == 4 * trained.shape[0]
        assert m["time_rollout"] > 0 and m["time_prune"] >= 0
    assert any(m["ds_dropped_groups"] > 0 for m in steps), "the reward makes half the groups all equal"
    # the dropped groups are in the history too: a prompt seen once in the last step, is all-equal
    last = groups[-1]
    for pid, rewards in zip(last["ids"], last["rewards"], strict=True):
        if last["ids"].count(pid) == 1:
            assert trainer.estimator.history.get(pid).all_equal == _all_equal(rewards), pid


SCORED: list[int] = []


def counted_half(prompts, completions, id, **columns):  # noqa: A002
    SCORED.append(len(completions))
    return constant_for_half(prompts, completions, id)


def quarter(prompts, completions, **columns):
    return [0.25] * len(completions)


def test_dynamic_sampling_scores_each_completion_once_and_logs_each_functions_mean(small_model_dir, tmp_path):
    """The step trains on groups its rounds scored: the reward functions are not called on them again, the rewards
    are those of the rounds, and ``reward_<name>`` is each function's mean over the trained groups."""
    SCORED.clear()
    trainer = SpyTrainer(_config(small_model_dir, tmp_path, max_steps=2), reward_funcs=[counted_half, quarter],
                         progress=False)
    trainer.train()
    steps = [m for m in _lines(tmp_path / "metrics.jsonl") if "step_time" in m]
    assert sum(SCORED) == sum(m["completions_rolled_out"] for m in steps)  # once each, in its round
    for m, g, trained in zip(steps, read_groups(tmp_path), trainer.trained, strict=True):
        assert all(r.tolist() in g["rewards"] for r in trained)  # groups.jsonl: every rolled-out group's rewards
        assert m["reward_quarter"] == 0.25
        assert m["reward_counted_half"] == pytest.approx(trained.mean().item() - 0.25)


def test_dynamic_sampling_without_signal_stops_after_its_rounds_and_trains_nothing(small_model_dir, tmp_path):
    trainer = DPPOTrainer(_config(small_model_dir, tmp_path, max_steps=1), reward_funcs=[always_one],
                          progress=False)
    trainer.train()
    (m,) = [m for m in _lines(tmp_path / "metrics.jsonl") if "step_time" in m]
    (g,) = read_groups(tmp_path)
    # not a skipped step (those roll nothing out): it paid for its rollouts and trained nothing
    assert unknown_keys([m]) == []
    assert "skipped" not in m and m["ds_no_signal"] == 1 and m["ds_rounds"] == MAX_ROUNDS and m["tokens_trained"] == 0
    assert m["time_rollout"] > 0 and m["time_update"] == 0.0
    assert m["ds_dropped_groups"] == len(g["ids"]) == m["prompts_rolled_out"] > 4
    assert m["tokens_generated"] == sum(map(sum, g["lengths"])) > 0


def test_greso_sampling_skips_prompts_last_seen_all_equal_before_each_round(small_model_dir, tmp_path):
    config = _config(small_model_dir, tmp_path, pruning="greso", prompt_prune_rate=0.9, train_pool_size=8,
                     drop_zero_advantage=True)
    trainer = DPPOTrainer(config, reward_funcs=[always_one], progress=False)
    trainer.train()
    first, second = read_groups(tmp_path)
    # every group comes out all equal and goes into the history at once, so later rounds and steps skip 90% of
    # the candidates they have seen before rollout: fewer are rolled out than drawn
    assert first["window"] >= len(first["ids"]) and second["window"] > len(second["ids"])
    assert set(second["ids"]) <= {prompt_key(r) for r in trainer.prompts.rows}


def test_greso_sampling_draws_its_skips_afresh_in_each_round(small_model_dir, tmp_path):
    """Each round of a step draws its own skips (a shared draw would skip the same positions in every round)."""
    config = _config(small_model_dir, tmp_path, pruning="greso", prompt_prune_rate=0.5, train_pool_size=8)
    trainer = DPPOTrainer(config, reward_funcs=[always_one], progress=False)
    window = list(trainer.prompts.rows)
    trainer.estimator.observe([prompt_key(r) for r in window], torch.ones(len(window), 4), torch.zeros(len(window), 4),
                              0)  # every prompt last seen all-equal: each kept with probability 0.5
    rounds = [tuple(trainer.plan.round_keep(trainer, window, 1, r)) for r in range(MAX_ROUNDS)]
    assert len(set(rounds)) > 1 and rounds[0] == tuple(trainer.estimator.select([prompt_key(r) for r in window],
                                                                                1).indices)


def test_dynamic_sampling_refuses_weighted_prompt_pruning(small_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout_plan='dynamic_sampling'.*1/π"):
        _config(small_model_dir, tmp_path, prompt_prune_rate=0.5).validate()


def test_the_offline_filter_refuses_to_resume(small_model_dir, tmp_path):
    trainer = DPPOTrainer(_filter(small_model_dir, tmp_path), reward_funcs=[always_one], progress=False)
    trainer.step = 1
    with pytest.raises(RuntimeError, match="cannot resume"):
        trainer.train_step()


def test_the_offline_filter_drops_the_pools_all_equal_prompts_and_counts_its_cost(small_model_dir, tmp_path):
    trainer = DPPOTrainer(_filter(small_model_dir, tmp_path), reward_funcs=[constant_for_half], progress=False)
    pool = list(trainer.prompts.rows)
    trainer.train()
    lines = _lines(tmp_path / "metrics.jsonl")
    assert unknown_keys(lines) == []  # the filter's line against its own schema, the steps' against theirs
    head = lines[0]
    assert head["event"] == "prefilter" and "step_time" not in head and head["time_prefilter"] > 0
    assert head["pool"] == len(pool) == 16 and head["kept"] + head["dropped"] == 16
    assert head["tokens_generated"] > 0 and not head["filter_left_nothing"]
    always = {prompt_key(r) for r in pool if constant(r["id"])}
    kept = {prompt_key(r) for r in trainer.prompts.rows}
    assert always and not always & kept and kept <= {prompt_key(r) for r in pool}
    assert head["dropped_all_correct"] >= len(always)
    assert {pid for g in read_groups(tmp_path) for pid in g["ids"]} <= kept  # training samples the filtered pool
    assert [m["step"] for m in lines if "step_time" in m] == [1, 2]


def test_the_filter_that_leaves_nothing_keeps_the_pool_and_says_so(small_model_dir, tmp_path):
    trainer = DPPOTrainer(_filter(small_model_dir, tmp_path, max_steps=1), reward_funcs=[always_one],
                          progress=False)
    pool = [prompt_key(r) for r in trainer.prompts.rows]
    trainer.train()
    head = _lines(tmp_path / "metrics.jsonl")[0]
    assert head["filter_left_nothing"] and head["kept"] == head["pool"] == len(pool) and head["dropped"] == 16
    assert [prompt_key(r) for r in trainer.prompts.rows] == pool


def test_each_bench_method_runs_its_plan_in_the_plain_trainer(tmp_path):
    preset = BENCH_PRESETS["cpu-realistic"]
    plans = {m: type(make_plan(method_config(preset, m, 1, tmp_path)))
             for m in ("grpo_skip_filtered", "dapo_sampling", "greso_sampling", "dapo_oversampled", "dppo",
                       "dppo_budget_pilot")}
    assert plans == {"grpo_skip_filtered": OfflineFilter, "dapo_sampling": DynamicSampling,
                     "greso_sampling": DynamicSampling, "dapo_oversampled": OversampledDynamicSampling,
                     "dppo": Plain, "dppo_budget_pilot": Pilot}
    # every plan the registry declares is the class it names, under that name
    for name in registry.ROLLOUT_PLANS:
        config = method_config(preset, "dppo_pilot" if name == "pilot" else "grpo_skip", 1, tmp_path)
        assert make_plan(config.with_overrides({"rollout_plan": name})).name == name


class EngineSpy(DPPOTrainer):
    """Records each training step's engine calls: the step, the call's random seed and its longest completion."""

    def train_step(self):
        if not hasattr(self, "calls"):
            self.calls: list[tuple[int, int, int]] = []
            self.in_step = False
            generate = self.engine.generate

            def spy(prompts, n, sampling):
                batch = generate(prompts, n, sampling)
                if self.in_step:  # (not the evaluations')
                    longest = max(c.length for g in batch.groups for c in g.completions)
                    self.calls.append((self.step + 1, sampling.seed, longest))
                return batch

            self.engine.generate = spy
        self.in_step = True
        try:
            return super().train_step()
        finally:
            self.in_step = False


def _check_rounds(small_model_dir, tmp_path):
    seeds = {}
    for seed in (0, 1):
        out = tmp_path / f"seed-{seed}"
        trainer = EngineSpy(_config(small_model_dir, out, max_steps=2, seed=seed), reward_funcs=[always_one],
                            progress=False)
        trainer.train()
        assert len(trainer.calls) == 2 * MAX_ROUNDS
        seeds[seed] = {s for _, s, _ in trainer.calls}
        assert len(seeds[seed]) == 2 * MAX_ROUNDS, "two calls of one run shared a stream"
        steps = [m for m in _lines(out / "metrics.jsonl") if "step_time" in m]
        for m in steps:
            assert m["decode_steps"] == sum(longest for step, _, longest in trainer.calls if step == m["step"])
            assert m["decode_steps"] > max(max(x) for x in read_groups(out)[m["step"] - 1]["lengths"])
    assert not seeds[0] & seeds[1], "a round of one seed reused another seed's stream"


def test_each_round_of_each_seed_samples_from_a_stream_of_its_own_and_counts_its_decode_steps(small_model_dir,
                                                                                           tmp_path):
    """No reward signal, so every step runs all its rounds. Every engine call of a run, and of the next seed's run,
    gets its own random stream (round r of seed s was round 1 of seed s + r - 1), and a step's decode_steps is
    the sum of its calls' longest completions (not only the trained groups')."""
    _check_rounds(small_model_dir, tmp_path)


_PLAN = "dppo_core.plans.dynamic_sampling"
#: each a line of DynamicSampling.roll_out made wrong, which the check above must catch
ROUND_MUTANTS = [
    LineMutant("rounds_share_the_steps_stream", _PLAN, "roll_out", "call=rounds - 1)", "call=0)",
               "Every refill round samples from the step's first stream.", owner="DynamicSampling"),
    LineMutant("refill_seed_from_the_next_seed", _PLAN, "roll_out",
               "trainer.generate(step, rows, call=rounds - 1)",
               "trainer.generate(step + 1_000_003 * (rounds - 1), rows)",
               "The first version's refill seed: round r of seed s is round 1 of seed s + r - 1.",
               owner="DynamicSampling"),
    LineMutant("decode_steps_of_the_last_call", _PLAN, "roll_out",
               "decode += int(logged[\"lengths\"][-1].max())", "decode = int(logged[\"lengths\"][-1].max())",
               "decode_steps counts one engine call (the last), not every round's.", owner="DynamicSampling"),
]


@pytest.mark.parametrize("mutant", ROUND_MUTANTS, ids=repr)
def test_round_mutants_are_caught(small_model_dir, tmp_path, monkeypatch, mutant):
    mutant.install(monkeypatch)
    with pytest.raises(AssertionError):
        _check_rounds(small_model_dir, tmp_path)


def test_dapo_oversampled_rolls_out_three_times_the_batch_in_each_round(small_model_dir, tmp_path):
    """DAPO's recipe: every round one call of 3 x prompts_per_step candidates, up to 10 rounds; a step still short
    trains what it has and says so (the recipe raises)."""
    trainer = DPPOTrainer(_config(small_model_dir, tmp_path / "none", max_steps=1, rollout_plan="dapo_oversampled"),
                          reward_funcs=[always_one], progress=False)
    trainer.train()
    (m,) = [m for m in _lines(tmp_path / "none" / "metrics.jsonl") if "step_time" in m]
    k = trainer.config.prompts_per_step
    assert m["ds_rounds"] == DAPO_MAX_ROUNDS == 10 and m["prompts_rolled_out"] == OVERSAMPLE * k * 10
    assert m["ds_short"] == 1 and m["tokens_trained"] == 0
    trainer = DPPOTrainer(_config(small_model_dir, tmp_path / "half", max_steps=2, rollout_plan="dapo_oversampled"),
                          reward_funcs=[constant_for_half], progress=False)
    trainer.train()
    for m, g in zip([m for m in _lines(tmp_path / "half" / "metrics.jsonl") if "step_time" in m],
                    read_groups(tmp_path / "half"), strict=True):
        assert m["prompts_rolled_out"] == OVERSAMPLE * k * m["ds_rounds"] == len(g["ids"])  # whole batches only
        mixed = sum(not _all_equal(r) for r in g["rewards"])
        assert m["ds_short"] == int(mixed < k) and (mixed >= k or m["ds_rounds"] == 10)

