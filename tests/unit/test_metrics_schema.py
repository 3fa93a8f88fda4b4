"""metrics.jsonl's schema (dppo_core.metrics): the check the system tests run on every line a step writes."""

from dppo_core.metrics import PLAN_KEYS, PREFILTER, STEP, step_keys, unknown_keys


def test_unknown_keys_names_each_key_the_schema_lacks_and_reads_events_by_their_own():
    assert unknown_keys([{"step": 1, "loss": 0.1, "reward_accuracy_reward": 1.0, "ds_rounds": 2}]) == []
    assert unknown_keys([{"step": 2, "lossy": 1.0}, {"step": 3, "loss": 0.0}]) == ["step 2: lossy"]
    assert unknown_keys([{"event": "prefilter", "step": 0, "kept": 3, "loss": 1.0}]) == ["prefilter 0: loss"]


def test_every_key_says_what_it_means():
    for schema in (STEP, PREFILTER, *PLAN_KEYS.values()):
        assert all(isinstance(doc, str) and doc for doc in schema.values())
    assert {"step", "step_time", "decode_steps", "ds_no_signal", "pilot_tokens"} <= step_keys()


def _trainer_stub(g: int = 2):
    """What :meth:`DPPOTrainer.step_record` reads of the trainer: the step, the config's G, the rate, the plan."""
    from types import SimpleNamespace

    return SimpleNamespace(step=1, config=SimpleNamespace(num_generations=g), _lr=lambda step: 1e-4,
                           plan=SimpleNamespace(name="stub"))


def _rolled_out(rewards, lengths, **kw):
    import torch

    from dppo_core.plans import PromptSelection, RolledOut
    from dppo_core.rollout import RolloutBatch

    selection = PromptSelection(list(range(len(rewards))), torch.ones(len(rewards), dtype=torch.float64), 4,
                                [{"prompt": str(i)} for i in range(len(rewards))])
    return RolledOut(selection, 0, RolloutBatch([]), torch.tensor(rewards), lengths, {}, **kw)


def test_the_step_record_is_filled_in_one_place_and_a_plan_adds_only_its_own_keys():
    """A step that trained nothing, one whose plan rolled out more than it trains (its counts replace the trained
    groups'), and a plan that tries to write a key of the step's own line (refused: no last write wins)."""
    import pytest
    import torch

    from dppo_core.plans import PromptSelection, RolloutCounts
    from dppo_core.run import PhaseTimer
    from dppo_core.trainer import PHASES, DPPOTrainer

    timer = PhaseTimer(PHASES)
    timer.lap("prune")
    pruned = DPPOTrainer.step_record(_trainer_stub(), PromptSelection([], torch.zeros(0), 4, []), timer)
    assert pruned["skipped"] == 1 and pruned["prompts_rolled_out"] == 0 and pruned["reward_mean"] is None
    assert pruned["prompts_candidates"] == 4 and "completions_rolled_out" not in pruned and not unknown_keys([pruned])

    stopped = _rolled_out([[1.0, 1.0]], [3, 5])  # a pilot that stopped its one group: nothing left to train
    stopped.selection = PromptSelection([], torch.zeros(0), 4, [])
    stopped.lengths, stopped.rewards = [], torch.zeros(0, 2)
    stopped.counts = RolloutCounts(prompts_rolled_out=1, completions=2, tokens=8, tokens_saved_est=24)
    stopped.plan_stats = {"pilot_groups_stopped": 1}
    line = DPPOTrainer.step_record(_trainer_stub(), stopped.selection, timer, stopped)
    assert (line["prompts_rolled_out"], line["completions_rolled_out"], line["tokens_generated"]) == (1, 2, 8)
    assert line["tokens_saved_rollout_est"] == 24 and line["skipped"] == 1 and line["pilot_groups_stopped"] == 1
    assert not unknown_keys([line])

    refill = _rolled_out([[1.0, 0.0]], [2, 2])  # trained one group of the three a refill rolled out
    refill.counts = RolloutCounts(3, 6, 12, prompts_candidates=6,
                                  rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
    refill.mark_skipped = False
    refill.lengths, refill.rewards = [], torch.zeros(0, 2)  # as dynamic sampling's no-signal step
    line = DPPOTrainer.step_record(_trainer_stub(), refill.selection, timer, refill)
    assert line["zero_std_groups"] == pytest.approx(2 / 3) and line["reward_mean"] == pytest.approx(0.5)
    assert line["prompts_candidates"] == 6 and "skipped" not in line and not unknown_keys([line])

    clash = _rolled_out([[1.0, 0.0]], [2, 2], plan_stats={"tokens_generated": 99})
    with pytest.raises(RuntimeError, match="tokens_generated.*RolledOut.counts"):
        DPPOTrainer.step_record(_trainer_stub(), clash.selection, timer, clash)
