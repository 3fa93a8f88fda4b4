"""The estimator module on its own: plain tensors in and out, every mode behind one interface."""

from __future__ import annotations

import math

import pytest
import torch

from dppo_core import pruning
from dppo_core.config import PRUNING_MODES, DPPOConfig
from dppo_core.estimator import (
    ESTIMATORS,
    CPPOEstimator,
    DPPOEstimator,
    Estimator,
    GRESOEstimator,
    PODSEstimator,
    make_estimator,
)
from dppo_core.pruning import PromptHistory

# Not marked `numerics`: small tensors, and checks that are exact or have margins far above any rounding, so the
# second kernel setting (Makefile) could not change an outcome.


def test_registry_holds_every_pruning_mode():
    assert set(ESTIMATORS) == set(PRUNING_MODES)
    for mode in PRUNING_MODES:
        extra = {"prompt_prune_rate": 0.5} if mode in ("dppo", "greso") else {}
        extra |= {"completion_prune_rate": 0.5} if mode in ("dppo", "cppo") else {}
        assert make_estimator(DPPOConfig(pruning=mode, **extra)).name == mode


def test_what_an_estimator_declares_to_the_adapters():
    """What the TRL and verl adapters ask an estimator, instead of probing its fields: whether it drops the
    completions with A = 0 (exact only without a KL term), and the G its prompt scheme reads counts with."""
    for est in (Estimator(), CPPOEstimator(), GRESOEstimator(), PODSEstimator()):
        assert not est.drops_zero_advantage() and est.group_size_read() is None
    assert DPPOEstimator().drops_zero_advantage()
    assert not DPPOEstimator(beta=0.04).drops_zero_advantage()
    assert not DPPOEstimator(drop_zero_advantage=False).drops_zero_advantage()
    assert DPPOEstimator(prompt_scheme="paper", group_size=4).group_size_read() is None
    for scheme in ("posterior", "fitted", "streak"):
        assert DPPOEstimator(prompt_scheme=scheme, group_size=4).group_size_read() == 4
    assert make_estimator(DPPOConfig(pruning="dppo", num_generations=6, prompt_scheme="fitted",
                                     prompt_prune_rate=0.5)).group_size_read() == 6


def test_none_keeps_everything_with_weight_one():
    est = Estimator()
    sel = est.select([f"p{i}" for i in range(5)], step=0, size=3)
    assert sel.indices == [0, 1, 2] and sel.window == 3 and torch.equal(sel.probs, torch.ones(3, dtype=torch.float64))
    w = est.weigh(torch.randn(3, 4), sel, step=0)
    assert w.keep.all() and torch.equal(w.weights, torch.ones(3, 4, dtype=torch.float64)) and w.num_sequences == 12


def test_dppo_with_every_keep_probability_one_equals_none():
    est = DPPOEstimator(prompt_prune_rate=0.0, completion_prune_rate=0.0, drop_zero_advantage=False)
    adv = torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    sel = est.select(["a", "b"], step=3)
    w = est.weigh(adv, sel, step=3)
    plain = Estimator().weigh(adv, sel, step=3)
    assert torch.equal(w.keep, plain.keep) and torch.equal(w.weights, plain.weights)
    assert w.num_sequences == plain.num_sequences == 6


def test_dppo_drops_exactly_the_zero_loss_completions_when_beta_is_zero():
    adv = torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    w = DPPOEstimator(beta=0.0).weigh(adv, step=0)
    assert w.keep.tolist() == [[True, True, False, False]] and w.num_sequences == 4
    w_kl = DPPOEstimator(beta=0.04).weigh(adv, step=0)
    assert w_kl.keep.all(), "with a KL term an A = 0 completion still has a loss: it is kept (all p = 1 here)"


def test_dppo_select_and_weigh_use_the_pruning_functions_and_the_step_draws():
    history = PromptHistory()
    ids = [f"p{i}" for i in range(8)]
    rewards = torch.tensor([[0.0, 1.0]] * 3 + [[1.0, 1.0]] * 3)  # three mixed groups, three all right
    history.update(ids[:6], rewards, torch.tensor([[-1.0, 1.0]] * 3 + [[0.0, 0.0]] * 3), step=0)
    est = DPPOEstimator(seed=7, history=history, prompt_prune_rate=0.5, completion_prune_rate=0.5,
                        min_prompt_keep_prob=0.2, fixed_size_sampling=True)
    sel = est.select(ids, step=1, size=8)
    probs = pruning.prompt_keep_probs(history, ids, 0.5, scheme="paper", min_keep_prob=0.2, step=1)
    keep = pruning.sample_keep(probs, pruning.step_generator(7, 1, "prompts"), True)
    assert sel.indices == keep.nonzero().flatten().tolist() and sel.window == 8
    assert torch.equal(sel.probs, probs[sel.indices])
    adv = torch.randn(len(sel.indices), 4)
    w = est.weigh(adv, sel, step=1)
    p = pruning.completion_keep_probs(adv, 0.5, min_keep_prob=0.1)
    kept = pruning.sample_keep(p, pruning.step_generator(7, 1, "completions"), True)
    assert torch.equal(w.keep, kept)
    assert torch.allclose(w.weights, pruning.importance_weights(sel.probs, p, kept))
    assert w.num_sequences == 8 * 4, "the normaliser is over the whole candidate window, kept or not"


def test_dppo_weighted_loss_is_unbiased_over_draws():
    """Mean over 3,000 steps' draws of Σ w·ℓ equals Σ ℓ within 4 standard errors, and a 5% error is caught."""
    torch.manual_seed(0)
    history = PromptHistory()
    ids = [f"p{i}" for i in range(6)]
    history.update(ids, torch.rand(6, 4).round(), torch.randn(6, 4).abs(), step=0)
    est = DPPOEstimator(history=history, prompt_prune_rate=0.5, completion_prune_rate=0.5,
                        min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2, prompt_scheme="proportional")
    adv = torch.randn(6, 4)
    loss = 1 + torch.rand(6, 4)  # per-completion losses at a fixed θ (positive, so a 5% scale error shows)
    draws = []
    for step in range(1, 3001):
        sel = est.select(ids, step)
        w = est.weigh(adv[sel.indices], sel, step)
        draws.append(float((w.weights * loss[sel.indices]).sum()))
    x = torch.tensor(draws, dtype=torch.float64)
    se = x.std().item() / math.sqrt(len(x))
    assert abs(x.mean().item() - loss.sum().item()) < 4 * se
    assert abs(1.05 * x.mean().item() - loss.sum().item()) > 4 * se, "the check must catch a 5% error"


def test_biased_baselines_are_what_they_say():
    adv = torch.tensor([[3.0, -1.0, 0.5, -2.0]])
    w = CPPOEstimator(completion_prune_rate=0.5).weigh(adv)
    assert w.keep.tolist() == [[True, False, False, True]] and w.num_sequences == 2
    assert torch.equal(w.weights[w.keep], torch.ones(2, dtype=torch.float64))
    history = PromptHistory()
    history.update(["a"], torch.ones(1, 2), torch.zeros(1, 2), step=0)  # degenerate last time
    greso = GRESOEstimator(history=history, prompt_prune_rate=0.5)
    probs = greso.prompt_probs(["a", "b"], step=1)
    assert probs.tolist() == [0.5, 1.0]
    sel = greso.select(["a", "b"], step=1)
    assert greso.weigh(torch.ones(len(sel.indices), 2), sel).num_sequences == 2 * len(sel.indices)


def test_pods_trains_the_most_varied_half_with_advantages_over_it():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.2, 0.9, 0.5, 0.4]])
    from dppo_core.grpo import group_advantages

    est = PODSEstimator(completion_prune_rate=0.5)
    with pytest.raises(ValueError, match="rewards"):
        est.weigh(group_advantages(rewards), None, 0)
    w = est.weigh(group_advantages(rewards), None, 0, rewards=rewards)
    assert w.keep[0, 0] and w.keep[0].sum() == 2 and w.keep[1].tolist() == [True, True, False, False]
    assert w.num_sequences == 4 and w.weights[w.keep].eq(1).all() and w.weights[~w.keep].eq(0).all()
    # advantages recomputed over the two kept completions of each group: +-1 (up to the std's eps)
    assert torch.allclose(w.advantages[w.keep].abs(), torch.ones(4), atol=1e-3)
    assert w.advantages[0, 0] > 0 and w.advantages[1, 1] > 0 > w.advantages[1, 0]
    config = DPPOConfig(model="unused", pruning="pods", completion_prune_rate=0.5, num_generations=8)
    assert make_estimator(config).num_kept(8) == 4 and make_estimator(config).num_kept(2) == 2
    with pytest.raises(ValueError, match="prompt_prune_rate"):
        DPPOConfig(model="unused", pruning="pods", prompt_prune_rate=0.5)


def test_dense_prompts_extend_the_window_until_the_budget_is_expected():
    history = PromptHistory()
    ids = [f"p{i}" for i in range(16)]
    history.update(ids, torch.ones(16, 2), torch.zeros(16, 2), step=0)  # all degenerate: low scores
    est = DPPOEstimator(history=history, prompt_prune_rate=0.5, dense_prompts=True, prompt_window_factor=4)
    assert est.num_candidates(4) == 16
    sel = est.select(ids, step=1, size=4)
    assert 4 < sel.window <= 16
    assert est.prompt_probs(ids[: sel.window], step=1, budget=4).sum().item() == pytest.approx(4.0)


def test_state_dict_round_trip_and_a_bad_state_changes_nothing():
    est = DPPOEstimator(prompt_prune_rate=0.5)
    est.observe(["a", "b"], torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, -1.0], [0.0, 0.0]]), step=2)
    state = est.state_dict()
    other = DPPOEstimator(prompt_prune_rate=0.5)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert PromptHistory.from_state_dict(state).state_dict()["records"] == state["records"]
    with pytest.raises(ValueError, match="not a PromptHistory state"):
        other.load_state_dict({"nonsense": 1})
    assert other.state_dict() == state


def test_what_a_hand_written_loop_could_get_wrong_is_caught():
    est = DPPOEstimator(prompt_prune_rate=0.5, completion_prune_rate=0.5)
    with pytest.raises(ValueError, match="pass the step's Selection"):
        est.weigh(torch.randn(2, 4))  # prompts are pruned: the weights need their keep probabilities
    with pytest.raises(TypeError):
        DPPOEstimator(0, None, 0.5)  # fields by keyword only: a positional 0.5 cannot land in the wrong field
    empty = est.select([], step=0)  # every prompt pruned (here: none offered): an empty, valid step
    w = DPPOEstimator(fixed_size_sampling=True).weigh(torch.zeros(0, 4), empty, step=0)
    assert w.keep.shape == (0, 4) and w.num_sequences == 0
    state = CPPOEstimator().state_dict()
    with pytest.warns(UserWarning, match="written by a 'cppo' estimator"):
        est.load_state_dict(state)


def test_the_length_scheme_asks_for_lengths():
    """``completion_scheme='length'`` needs the completions' token counts: a clear error without them (the
    trainer passes them: tests/system/test_trainer.py runs it, tests/system/test_unbiased.py through ``weigh``)."""
    est = DPPOEstimator(completion_prune_rate=0.5, completion_scheme="length")
    assert est.needs_lengths and not DPPOEstimator(completion_prune_rate=0.5).needs_lengths
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5]])
    with pytest.raises(ValueError, match="lengths"):
        est.weigh(adv, step=0)
    w = est.weigh(adv, step=0, lengths=torch.tensor([[4, 40, 4, 40]]))
    assert w.keep.shape == adv.shape and w.num_sequences == 4


def test_the_posterior_scheme_reads_the_history_with_its_half_life():
    est = DPPOEstimator(prompt_prune_rate=0.5, prompt_scheme="posterior", posterior_half_life=3.0, group_size=4)
    assert est.history.half_life == 3.0
    for step in range(3):  # "a" solved three times, "b" half right
        est.observe(["a", "b"], torch.tensor([[1.0, 1, 1, 1], [1.0, 0, 1, 0]]), torch.zeros(2, 4), step=step)
    sel = est.select(["a", "b", "c", "d"], step=3)
    assert sel.window == 4 and len(sel.probs) == len(sel.indices)
    soon, later = (est.prompt_probs(["a", "b", "c", "d"], step=s) for s in (3, 60))
    assert soon[0] < soon[1] and soon.sum() == pytest.approx(2.0)
    assert later[0] > soon[0] + 0.05  # the evidence fades: the solved prompt drifts back towards the prior
    never = DPPOEstimator(prompt_prune_rate=0.5, prompt_scheme="posterior", posterior_half_life=None, group_size=4)
    never.history = est.history  # assigning a history gives it the estimator's half-life
    assert never.history.half_life is None
    ids = ["a", "b", "c", "d"]
    assert torch.allclose(never.prompt_probs(ids, step=60), never.prompt_probs(ids, step=3))  # no discount
    est.history = never.history
    assert est.history.half_life == 3.0
    est.load_state_dict(est.state_dict())
    assert est.history.half_life == 3.0
