"""dppo_core.pruning as pure functions: history, keep probabilities, inclusion sampling, weights, baselines."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dppo_core.pruning import (
    PromptHistory,
    completion_keep_probs,
    cppo_keep,
    dense_window,
    effective_sample_size,
    fit_budget,
    greso_keep_probs,
    importance_weights,
    keep_probs_from_scores,
    pods_keep,
    prompt_keep_probs,
    sample_keep,
    step_generator,
)


def _history():
    h = PromptHistory()
    rewards = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, unbiased=False, keepdim=True) + 1e-4)
    h.update(["easy", "hard", "even", "zero"], rewards, adv, step=3)
    return h


def test_history_records_the_last_group_and_round_trips():
    h = _history()
    assert h.get("easy").degenerate and h.get("zero").degenerate and not h.get("even").degenerate
    assert h.get("even").mean_abs_advantage == pytest.approx(1.0, abs=1e-3)
    assert h.get("hard").mean_reward == 0.25 and h.get("hard").step == 3
    assert h.degenerate_fraction() == 0.5
    again = PromptHistory.from_state_dict(__import__("json").loads(__import__("json").dumps(h.state_dict())))
    assert again.records == h.records
    h.update(["even"], torch.zeros(1, 4), torch.zeros(1, 4), step=5)
    assert h.get("even").seen == 2 and h.get("even").degenerate
    with pytest.raises(ValueError, match="one row per prompt"):
        h.update(["a", "b"], torch.zeros(1, 4), torch.zeros(1, 4), step=6)
    with pytest.raises(ValueError, match="PromptHistory"):
        PromptHistory.from_state_dict({"wrong": 1})


def test_merge_keeps_the_latest_record_whatever_the_rank_order():
    a, b = PromptHistory(), PromptHistory()
    a.update(["p", "q"], torch.tensor([[1.0, 0], [1, 1]]), torch.tensor([[1.0, -1], [0, 0]]), step=1)
    b.update(["p", "r"], torch.tensor([[0.0, 0], [1, 0]]), torch.tensor([[0.0, 0], [1, -1]]), step=2)
    ab, ba = PromptHistory.merge([a, b]), PromptHistory.merge([b, a])
    assert ab.records == ba.records
    assert set(ab.records) == {"p", "q", "r"} and ab.get("p").step == 2 and ab.get("p").degenerate


def test_prompt_keep_probs_unseen_get_one_and_floors_hold():
    h = _history()
    ids = ["easy", "hard", "even", "zero", "new"]
    for scheme in ("paper", "proportional"):
        p = prompt_keep_probs(h, ids, 0.8, scheme=scheme, min_keep_prob=0.15)
        assert p[4] == 1.0
        assert (p >= 0.15).all() and (p <= 1).all()
        assert p[2] >= p[0] and p[2] >= p[3]  # the informative prompt is kept at least as often
    paper = prompt_keep_probs(h, ids, 0.6, scheme="paper", min_keep_prob=0.1)
    # the lower half (2 of 4 seen prompts: the degenerate ones) kept with 1 - r, the rest with 1
    assert sorted(paper[:4].tolist()) == pytest.approx([0.4, 0.4, 1.0, 1.0])
    assert prompt_keep_probs(h, ids, 0.9, step=10, max_age=5).tolist() == [1.0] * 5  # stale history is ignored
    assert prompt_keep_probs(h, ids, 0.0).tolist() == [1.0] * 5


def test_completion_keep_probs_zero_advantage_and_budgets():
    adv = torch.tensor([[0.0, 0, 0, 0, 0, 0, 0, 0], [2.0, -1, 0.5, -0.5, 0.1, -0.1, 1, -2]])
    p = completion_keep_probs(adv, 0.5)
    assert p[0].tolist() == [0.0] * 8  # A = 0, beta = 0: loss identically zero
    assert p[1].sum().item() == pytest.approx(4.0)  # (1 - r) G expected kept
    assert (p[1] >= 0.1).all()
    assert torch.all(p[1].argsort() == adv[1].abs().argsort()) or p[1][0] >= p[1][4]
    with_kl = completion_keep_probs(adv, 0.5, beta=0.04)
    assert (with_kl >= 0.1).all()  # the KL term makes every loss non-zero: no zeros allowed
    keep_all = completion_keep_probs(adv, 0.5, drop_zero=False)
    assert (keep_all > 0).all()
    paper = completion_keep_probs(adv, 0.5, scheme="paper")
    assert paper[1].sum().item() == pytest.approx(8 - 4 * 0.5)  # half the group are candidates, each 1 - r
    assert completion_keep_probs(adv, 0.0, drop_zero=False).tolist() == torch.ones(2, 8).tolist()


@pytest.mark.parametrize("bad", [dict(rate=1.0), dict(rate=-0.1), dict(min_keep_prob=0.0), dict(scheme="topk")])
def test_bad_arguments_are_named(bad):
    kw = dict(rate=0.5, min_keep_prob=0.1, scheme="proportional") | bad
    rate = kw.pop("rate")
    with pytest.raises(ValueError, match=r"rate|min_keep_prob|scheme"):
        keep_probs_from_scores(torch.ones(4), rate, **kw)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=40), st.floats(0, 1), st.floats(0.01, 1))
def test_fit_budget_hits_the_budget_within_bounds(scores, frac, floor):
    s = torch.tensor(scores, dtype=torch.float64)
    n = len(scores)
    budget = frac * n
    p = fit_budget(s, budget, floor)
    assert (p >= floor - 1e-12).all() and (p <= 1 + 1e-12).all()
    positive = int((s > 1e-12 * s.max()).sum()) if s.max() > 0 else 0
    reachable_max = positive + floor * (n - positive) if positive else n
    target = min(max(budget, floor * n), reachable_max)
    assert p.sum().item() == pytest.approx(target, abs=1e-7)
    if positive:  # monotone in the score
        order = s.argsort()
        assert (p[order].diff() >= -1e-12).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=30), st.integers(0, 10_000))
def test_fixed_size_sampling_keeps_floor_or_ceil_of_the_sum(probs, seed):
    p = torch.tensor(probs, dtype=torch.float64)
    keep = sample_keep(p, torch.Generator().manual_seed(seed), fixed_size=True)
    total = p.sum().item()
    assert math.floor(total + 1e-9) <= int(keep.sum()) <= math.ceil(total - 1e-9)
    assert not keep[p == 0].any() and keep[p == 1].all()


def test_fixed_size_sampling_keeps_exactly_the_expected_count_each_time():
    adv = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    probs = completion_keep_probs(adv, 0.5)  # every group: sum 4
    counts = {tuple(sample_keep(probs, step_generator(0, s, "c"), fixed_size=True).sum(1).tolist()) for s in range(200)}
    assert counts == {(4,) * 16}


@pytest.mark.parametrize("fixed_size", [False, True])
def test_inclusion_frequencies_match_the_probabilities(fixed_size):
    """Over many draws each item is kept with its probability (both designs): the first-order inclusion
    probabilities are what the weights assume. Tolerance: 5 binomial standard errors."""
    p = torch.tensor([0.1, 0.25, 0.5, 0.9, 1.0, 0.0, 0.35, 0.9], dtype=torch.float64)
    n = 4000
    freq = torch.stack([sample_keep(p, step_generator(1, s, "t"), fixed_size) for s in range(n)]).double().mean(0)
    se = (p * (1 - p) / n).sqrt().clamp(min=1e-9)
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)
    if fixed_size:  # sum is 4.0: exactly 4 every time
        assert sample_keep(p, step_generator(1, 0, "t"), True).sum() == 4


def test_expected_fraction_kept_matches_the_configured_rate():
    adv = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    for rate in (0.25, 0.5, 0.75):
        probs = completion_keep_probs(adv, rate, min_keep_prob=0.05)
        assert probs.mean().item() == pytest.approx(1 - rate, abs=1e-9)
        kept = torch.stack([sample_keep(probs, step_generator(0, s, "r")) for s in range(300)]).double().mean()
        assert kept.item() == pytest.approx(1 - rate, abs=0.01)


def test_importance_weights_and_ess():
    pi = torch.tensor([0.5, 1.0])
    p = torch.tensor([[0.5, 0.25], [1.0, 0.0]])
    keep = torch.tensor([[True, False], [True, False]])
    w = importance_weights(pi, p, keep)
    assert w.tolist() == [[4.0, 0.0], [1.0, 0.0]]
    assert importance_weights(pi, p)[1, 1] == 0.0  # probability 0: weight 0, never inf
    assert effective_sample_size(torch.ones(5)) == pytest.approx(5)
    assert effective_sample_size(torch.tensor([1.0, 0, 0, 9])) == pytest.approx(100 / 82)


def test_dense_window_reaches_the_generation_batch():
    probs = torch.tensor([1.0, 0.2, 0.2, 1.0, 0.5, 0.5, 0.1, 1.0])
    assert dense_window(probs, 2) == 4  # 1 + .2 + .2 + 1 = 2.4 >= 2
    assert dense_window(probs, 100) == 8
    assert dense_window(torch.ones(5), 3) == 3


def test_cppo_keeps_the_top_k_by_absolute_advantage():
    adv = torch.tensor([[0.1, -3.0, 2.0, 0.0], [1.0, 1.0, -1.0, -1.0]])
    keep = cppo_keep(adv, 0.5)
    assert keep.tolist() == [[False, True, True, False], [True, True, False, False]]


def test_pods_keeps_the_subset_whose_rewards_vary_most():
    import itertools

    rewards = torch.tensor([[1.0, 1, 1, 0, 0, 0, 0, 0], [0.1, 0.9, 0.5, 0.4, 0.0, 1.0, 0.6, 0.3]])
    keep = pods_keep(rewards, 4)
    assert keep.sum(1).tolist() == [4, 4]
    assert sorted(rewards[0][keep[0]].tolist()) == [0.0, 0.0, 1.0, 1.0]  # half right, half wrong
    for q in range(2):  # the largest variance of any 4-subset, found by brute force
        best = max(float(rewards[q, list(c)].var(unbiased=False)) for c in itertools.combinations(range(8), 4))
        assert float(rewards[q][keep[q]].var(unbiased=False)) == pytest.approx(best)
    assert pods_keep(rewards, 8).all()
    with pytest.raises(ValueError, match="num_keep"):
        pods_keep(rewards, 9)


def test_greso_skips_only_prompts_degenerate_last_time():
    h = _history()
    p = greso_keep_probs(h, ["easy", "even", "zero", "new"], 0.7)
    assert p.tolist() == pytest.approx([0.3, 1.0, 0.3, 1.0])


def test_step_generator_is_a_function_of_seed_step_and_stage():
    a = torch.rand(3, generator=step_generator(0, 5, "prompts"))
    assert torch.equal(a, torch.rand(3, generator=step_generator(0, 5, "prompts")))
    assert not torch.equal(a, torch.rand(3, generator=step_generator(0, 6, "prompts")))
    assert not torch.equal(a, torch.rand(3, generator=step_generator(0, 5, "completions")))
