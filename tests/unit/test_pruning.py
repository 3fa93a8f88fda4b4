"""dppo_core.pruning (and dppo_core.posterior, dppo_core.biased_baselines) as pure functions: history, keep
probabilities, inclusion sampling, weights, baselines."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mutants import REWARD_RANGE_MUTANTS

from dppo_core import posterior, pruning
from dppo_core.biased_baselines import pods_keep
from dppo_core.posterior import beta_binomial_pmf, posterior_scores
from dppo_core.pruning import (
    PromptHistory,
    adaptive_rate,
    completion_keep_probs,
    cppo_keep,
    dense_window,
    effective_sample_size,
    expected_ess,
    fit_budget,
    greso_keep_probs,
    importance_weights,
    keep_probs_from_scores,
    prompt_keep_probs,
    sample_keep,
    step_generator,
)

# The keep probabilities are float64 (numpy's fit_budget, torch's sequential cumsum), compared at tolerances far
# above rounding or by frequency: only the test whose exact count rests on sums of probabilities computed from
# float32 advantages is marked `numerics` (run under the Makefile's second kernel setting too).


def _history():
    h = PromptHistory()
    rewards = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, unbiased=False, keepdim=True) + 1e-4)
    h.update(["easy", "hard", "even", "zero"], rewards, adv, step=3)
    return h


def test_history_records_the_last_group_and_round_trips():
    h = _history()
    assert h.get("easy").all_equal and h.get("zero").all_equal and not h.get("even").all_equal
    assert h.get("even").mean_abs_advantage == pytest.approx(1.0, abs=1e-3)
    assert h.get("hard").mean_reward == 0.25 and h.get("hard").step == 3
    assert h.all_equal_fraction() == 0.5
    assert h.get("easy").degenerate and not h.get("even").degenerate  # the former name, kept
    again = PromptHistory.from_state_dict(__import__("json").loads(__import__("json").dumps(h.state_dict())))
    assert again.records == h.records
    h.update(["even"], torch.zeros(1, 4), torch.zeros(1, 4), step=5)
    assert h.get("even").seen == 2 and h.get("even").all_equal
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
    assert set(ab.records) == {"p", "q", "r"} and ab.get("p").step == 2 and ab.get("p").all_equal


def test_prompt_keep_probs_unseen_get_one_and_floors_hold():
    h = _history()
    ids = ["easy", "hard", "even", "zero", "new"]
    for scheme in ("paper", "proportional"):
        p = prompt_keep_probs(h, ids, 0.8, scheme=scheme, min_keep_prob=0.15)
        assert p[4] == 1.0
        assert (p >= 0.15).all() and (p <= 1).all()
        assert p[2] >= p[0] and p[2] >= p[3]  # the informative prompt is kept at least as often
    paper = prompt_keep_probs(h, ids, 0.6, scheme="paper", min_keep_prob=0.1)
    # the lower half (2 of 4 seen prompts: the all-equal ones) kept with 1 - r, the rest with 1
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


@pytest.mark.numerics
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


def test_greso_skips_only_prompts_all_equal_last_time():
    h = _history()
    p = greso_keep_probs(h, ["easy", "even", "zero", "new"], 0.7)
    assert p.tolist() == pytest.approx([0.3, 1.0, 0.3, 1.0])


def test_step_generator_is_a_function_of_seed_step_and_stage():
    a = torch.rand(3, generator=step_generator(0, 5, "prompts"))
    assert torch.equal(a, torch.rand(3, generator=step_generator(0, 5, "prompts")))
    assert not torch.equal(a, torch.rand(3, generator=step_generator(0, 6, "prompts")))
    assert not torch.equal(a, torch.rand(3, generator=step_generator(0, 5, "completions")))


# --- variance-aware schemes (#22): a posterior over prompts, a token budget over completions ---------------


def test_history_keeps_discounted_evidence_and_old_records_still_load():
    h = PromptHistory(half_life=10.0)
    h.update(["p"], torch.tensor([[1.0, 1, 1, 0]]), torch.zeros(1, 4), step=0)
    h.update(["p"], torch.tensor([[1.0, 1, 0, 0]]), torch.zeros(1, 4), step=10)
    # the first group counts half at step 10: 0.5 * (3, 1) + (2, 2)
    assert h.evidence("p", 10) == pytest.approx((3.5, 2.5))
    assert h.evidence("p", 20) == pytest.approx((1.75, 1.25))  # and half again ten steps on
    assert h.evidence("unseen", 20) == (0.0, 0.0)
    again = PromptHistory.from_state_dict(h.state_dict(), half_life=10.0)
    assert again.evidence("p", 20) == pytest.approx(h.evidence("p", 20))
    old = {"records": {"q": {"mean_reward": 0.75, "reward_std": 0.4, "mean_abs_advantage": 0.8, "step": 1, "seen": 1}}}
    assert PromptHistory.from_state_dict(old).evidence("q", 1) == pytest.approx((0.75, 0.25))
    assert PromptHistory(half_life=None).half_life is None


def test_a_stale_record_starts_its_evidence_afresh():
    """With max_age, a record older than that is read as unseen, so a new group does not add to its evidence."""
    for max_age, expected in ((None, (5.0, 3.0)), (5, (2.0, 2.0))):
        h = PromptHistory()
        h.update(["p"], torch.tensor([[1.0, 1, 1, 0]]), torch.zeros(1, 4), step=0, max_age=max_age)
        h.update(["p"], torch.tensor([[1.0, 1, 0, 0]]), torch.zeros(1, 4), step=10, max_age=max_age)
        assert h.evidence("p", 10) == pytest.approx(expected)
        assert h.get("p").seen == 2
    h = PromptHistory()  # within max_age the evidence still adds up
    h.update(["p"], torch.tensor([[1.0, 1, 1, 0]]), torch.zeros(1, 4), step=0, max_age=5)
    h.update(["p"], torch.tensor([[1.0, 1, 0, 0]]), torch.zeros(1, 4), step=5, max_age=5)
    assert h.evidence("p", 5) == pytest.approx((5.0, 3.0))


def test_beta_binomial_and_the_posterior_score_match_their_definitions():
    pmf = beta_binomial_pmf(2.0, 3.0, 4)
    # Monte Carlo over p ~ Beta(2, 3), k ~ Binomial(4, p)
    gen = torch.Generator().manual_seed(0)
    p = torch.distributions.Beta(2.0, 3.0).sample((200_000,))
    k = torch.binomial(torch.full_like(p, 4.0), p, generator=gen)
    freq = torch.bincount(k.long(), minlength=5).double() / p.numel()
    assert abs(pmf.sum() - 1) < 1e-12 and (torch.from_numpy(pmf) - freq).abs().max() < 5e-3
    h = PromptHistory()
    g = 8
    unseen = float(posterior_scores(h, ["new"], g)[0])
    assert unseen == pytest.approx(math.sqrt(1 - 2 / (g + 1)))  # uniform prior: E[p^G] = 1 / (G + 1)
    h.update(["solved", "mixed"], torch.tensor([[1.0] * 8, [1.0] * 4 + [0.0] * 4]), torch.zeros(2, 8), step=0)
    h.update(["solved"], torch.ones(1, 8), torch.zeros(1, 8), step=1)
    s = posterior_scores(h, ["solved", "mixed", "new"], g, step=1).tolist()
    assert s[0] < min(s[1], s[2])  # twice solved is the least informative
    # Beta(17, 1): P(informative) = 1 - E[p^8] - E[(1-p)^8] with E[p^8] = 17/25
    all_wrong = math.exp(math.lgamma(9) + math.lgamma(18) - math.lgamma(26))  # E[(1-p)^8] = B(17, 9) / B(17, 1)
    assert s[0] ** 2 == pytest.approx(1 - 17 / 25 - all_wrong, rel=1e-9)
    # evidence fades: long after, the solved prompt is nearly back at the prior
    h.half_life = 5.0
    assert float(posterior_scores(h, ["solved"], g, step=61)[0]) == pytest.approx(unseen, abs=1e-3)
    # unscaled advantages: the rewards' variance k (G - k) / G², not the informative indicator
    none = float(posterior_scores(PromptHistory(), ["new"], 2, scale_rewards="none")[0])
    assert none**2 == pytest.approx(1 / 3 * 0.25)  # P(k = 1) = 1/3 under the uniform prior, variance 1/4


def test_posterior_prompt_scheme_spends_the_budget_where_signal_is_likely():
    h = PromptHistory()
    for step in range(3):
        h.update(["solved", "mixed"], torch.tensor([[1.0] * 8, [1.0] * 3 + [0.0] * 5]), torch.zeros(2, 8), step=step)
    ids = ["solved", "mixed", "new", "new2"]
    p = prompt_keep_probs(h, ids, 0.5, scheme="posterior", min_keep_prob=0.1, step=3, group_size=8)
    assert p.sum() == pytest.approx(2.0) and (p >= 0.1).all() and (p <= 1).all()
    assert p[0] < p[2] and p[0] < p[1]
    # nothing is forced to 1: an unseen prompt is scored by the prior, not kept for sure
    assert p[2] < 1
    with pytest.raises(ValueError, match="scheme"):
        prompt_keep_probs(h, ids, 0.5, scheme="length")


def _history_with_pass_counts(counts: list[int], g: int = 8) -> PromptHistory:
    """A history whose prompts' last groups had k = 0..G passes ``counts[k]`` times."""
    h = PromptHistory(half_life=20.0)
    rows = [[1.0] * k + [0.0] * (g - k) for k, n in enumerate(counts) for _ in range(n)]
    r = torch.tensor(rows, dtype=torch.float64)
    h.update([f"q{i}" for i in range(len(rows))], r, _advantages(r, "group"), step=0)
    return h


def test_the_fitted_prior_recovers_the_pool_it_was_drawn_from():
    """Pass counts in the exact proportions of a Beta-binomial: the maximum marginal likelihood is at its (a, b),
    to the grid's spacing (a factor 1.104); a J-shaped pool gives a, b < 1, a bell-shaped one a, b > 1."""
    for a, b in ((0.3, 0.15), (5.0, 5.0), (2.0, 0.5)):
        counts = [round(10_000 * x) for x in beta_binomial_pmf(a, b, 8)]
        fa, fb = _history_with_pass_counts(counts).fitted_prior(8)
        assert fa == pytest.approx(a, rel=0.12) and fb == pytest.approx(b, rel=0.12), (a, b, fa, fb)
    # a pool solved always or never, and one solved half the time: the two shapes a uniform prior cannot tell apart
    assert max(_history_with_pass_counts([40, 0, 0, 0, 0, 0, 0, 5, 55]).fitted_prior(8)) < 1
    assert min(_history_with_pass_counts([0, 2, 10, 25, 30, 25, 10, 2, 0]).fitted_prior(8)) > 1


def test_the_fitted_prior_is_uniform_until_enough_prompts_were_seen():
    from dppo_core.history import MIN_PRIOR_GROUPS

    few = _history_with_pass_counts([MIN_PRIOR_GROUPS - 1, 0, 0, 0, 0, 0, 0, 0, 0])
    assert few.fitted_prior(8) == (1.0, 1.0) and PromptHistory().fitted_prior(8) == (1.0, 1.0)
    assert _history_with_pass_counts([MIN_PRIOR_GROUPS, 0, 0, 0, 0, 0, 0, 0, 0]).fitted_prior(8) != (1.0, 1.0)
    assert few.pass_counts(8).tolist() == [MIN_PRIOR_GROUPS - 1] + [0.0] * 8


def test_the_fitted_scheme_is_proportional_to_p_informative_under_the_fitted_prior():
    """``fitted``: π ∝ P(the next group is informative) (the square of the posterior score), the prior fitted to the
    pool; on a J-shaped pool it keeps a prompt last seen all correct much less often than a mixed one, and less
    often than ``posterior`` does at the same rate (issue #50's sharper rule)."""
    h = _history_with_pass_counts([40, 2, 2, 3, 3, 3, 5, 10, 55])
    ids = ["q0", "q45", "q48", "q100", "new"]  # all wrong, 3 of 8, 4 of 8, all correct, unseen
    prior = h.fitted_prior(8)
    p_inf = posterior_scores(h, ids, 8, step=1, prior=prior) ** 2
    fitted = prompt_keep_probs(h, ids, 0.5, scheme="fitted", min_keep_prob=0.05, step=1, group_size=8)
    assert torch.equal(fitted, pruning.keep_probs_from_scores(p_inf, 0.5, min_keep_prob=0.05))
    posterior = prompt_keep_probs(h, ids, 0.5, scheme="posterior", min_keep_prob=0.05, step=1, group_size=8)
    for solved in (0, 3):
        assert fitted[solved] / fitted[2] < posterior[solved] / posterior[2] < 1
    assert fitted[3] / fitted[2] < 0.35  # the uniform prior's √ rule keeps it at more than 0.5 of a mixed one
    with pytest.raises(ValueError, match="'fitted'"):
        bad = PromptHistory()
        bad.update(["x"], torch.tensor([[2.0, 0.0]]), torch.zeros(1, 2), step=0)
        prompt_keep_probs(bad, ["x"], 0.5, scheme="fitted", step=1, group_size=2)


def test_fit_budget_with_costs_hits_the_expected_cost():
    scores = torch.tensor([3.0, 1.0, 0.5, 0.0, 2.0])
    costs = torch.tensor([10.0, 40.0, 5.0, 20.0, 25.0])
    p = fit_budget(scores, 40.0, 0.1, costs)
    assert float((p * costs).sum()) == pytest.approx(40.0)
    assert p[3] == pytest.approx(0.1) and (p <= 1).all()
    inner = (p > 0.1 + 1e-9) & (p < 1 - 1e-9)
    ratio = p[inner] / scores[inner]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio))
    with pytest.raises(ValueError, match="costs"):
        fit_budget(scores, 40.0, 0.1, torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))


def test_length_scheme_keeps_a_fraction_of_the_tokens_and_prefers_short_large_advantages():
    adv = torch.tensor([[1.0, -1.0, 0.5, 0.0, -0.5, 1.0]])
    lengths = torch.tensor([[10, 40, 10, 30, 5, 40]])
    p = completion_keep_probs(adv, 0.5, scheme="length", lengths=lengths, min_keep_prob=0.1, length_exponent=0.5)
    assert p[0, 3] == 0  # A = 0, beta 0: dropped at no bias
    assert float((p * lengths).sum()) == pytest.approx(0.5 * float(lengths.sum()))
    assert p[0, 0] > p[0, 5]  # the same |A|, four times the length
    free = (p > 0.1 + 1e-9) & (p < 1 - 1e-9)
    score = adv.abs() / lengths.double() ** 0.5
    assert torch.allclose((p / score)[free], (p / score)[free][0].expand(int(free.sum())))
    with pytest.raises(ValueError, match="lengths"):
        completion_keep_probs(adv, 0.5, scheme="length")
    with pytest.raises(ValueError, match="shape"):
        completion_keep_probs(adv, 0.5, scheme="length", lengths=torch.ones(2, 6))
    with pytest.raises(ValueError, match="scheme"):
        completion_keep_probs(adv, 0.5, scheme="posterior")


def test_sample_keep_sorts_by_the_key_so_a_group_keeps_both_signs():
    """Through ``sample_keep`` itself: half of a group kept by a sorted design always has both signs of the
    advantage; in a random order (or with the key ignored) some draws keep one sign only."""
    p = torch.full((6,), 0.5, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.2, 0.8, -1.0, -0.9, -1.1])
    gen = torch.Generator().manual_seed(0)
    for design, one_sided_possible in (("systematic", True), ("sorted", False), ("pivotal", False)):
        one_sided = 0
        for _ in range(1000):
            keep = sample_keep(p, gen, True, design=design, order_key=adv)
            assert int(keep.sum()) == 3
            one_sided += bool((adv[keep] > 0).all() or (adv[keep] < 0).all())
        assert (one_sided > 0) == one_sided_possible, f"{design}: {one_sided} one-sided draws of 1000"


@pytest.mark.parametrize("design", ["systematic", "sorted", "pivotal"])
def test_every_fixed_size_design_matches_its_probabilities_by_frequency(design):
    p = torch.tensor([[0.2, 0.9, 0.5, 0.4, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    key = torch.tensor([[1.0, -2.0, 0.5, 0.5, 3.0, 0.0], [1.0, -1.0, 2.0, -2.0, 0.1, -0.1]])
    gen = torch.Generator().manual_seed(5)
    n = 4000
    total = torch.zeros_like(p)
    for _ in range(n):
        keep = sample_keep(p, gen, True, design=design, order_key=key)
        assert int(keep[0].sum()) == 3 and int(keep[1].sum()) == 3
        total += keep.double()
    assert (total / n - p).abs().max() < 0.035  # about 4.5 standard errors at p = 0.5
    with pytest.raises(ValueError, match="design"):
        sample_keep(p, gen, True, design="stratified")
    with pytest.raises(ValueError, match="order_key"):
        sample_keep(p, gen, True, design=design, order_key=torch.ones(3))


def test_expected_ess_and_the_adaptive_rate():
    pi = torch.tensor([1.0, 0.5], dtype=torch.float64)
    p = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.5, 0.0]], dtype=torch.float64)
    # items: weights 1, 1 (π = 1, p = 1); 2 (π = .5, p = 1) and 4 (π = .5, p = .5) -> (1+1+2+2)² / (1+1+4+8)
    assert expected_ess(pi, p) == pytest.approx(36 / 14)
    # by Monte Carlo: E[Σw]² / E[Σw²] over independent completion draws of the rolled-out prompts
    gen = torch.Generator().manual_seed(1)
    keep = torch.rand(20000, 2, 3, generator=gen) < p
    w = keep.double() / (pi[:, None] * p.clamp(min=1e-9))
    assert (w.sum((1, 2)).mean() ** 2 / (w**2).sum((1, 2)).mean()).item() == pytest.approx(36 / 14, rel=0.03)
    adv = torch.tensor([[1.0, -1.0, 0.5, -0.5, 1.2, -1.2, 0.3, -0.3]] * 4)

    def at(r):
        return completion_keep_probs(adv, r, min_keep_prob=0.1)

    ones = torch.ones(4, dtype=torch.float64)
    full = expected_ess(ones, at(0.0))
    assert full == pytest.approx(32.0)
    r = adaptive_rate(ones, 20.0, 0.7, at)
    assert expected_ess(ones, at(r)) >= 20.0 and (r == 0.7 or expected_ess(ones, at(r + 0.05)) < 20.0)
    assert adaptive_rate(ones, 40.0, 0.7, at) == 0.0  # unreachable: nothing pruned
    assert adaptive_rate(ones, 1.0, 0.5, at) == 0.5  # never more than the configured rate
    with pytest.raises(ValueError, match="target_ess"):
        adaptive_rate(ones, 0.0, 0.5, at)


# --- rewards outside [0, 1] (issue #52) ----------------------------------------------------------------------------
# Completion keep probabilities and the paper/proportional prompt scores read the rewards only through |A|: any
# finite rewards work, and rewards a r + b (a > 0) give the probabilities of r. The posterior prompt scheme reads
# rewards as pass rates in [0, 1] (PromptHistory clips a group's mean into [0, 1]), so it refuses a record that
# rewards in [0, 1] cannot have, naming the prompt. Each check below is run through the module (pruning.<fn>,
# posterior.<fn>), so that the mutants of tests/helpers/mutants.py (REWARD_RANGE_MUTANTS) can be put in its place.

PASS_FAIL = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1],
                          [0, 1, 0, 1, 0, 1, 0, 1]])
CONTINUOUS = torch.tensor([[3.7, 0, 0, 0, 0, 0, 0, 0], [3.7, -0.4, 1.25, 3.7, 0.0, 2.5, -1.5, 3.7], [3.7] * 8],
                          dtype=torch.float64)


def _advantages(rewards, scale):
    """Group advantages in float64 (grpo.group_advantages computes in float32, exact for these dyadic rewards only)."""
    r = rewards.double()
    centred = r - r.mean(1, keepdim=True)
    return centred / (r.std(1, unbiased=False, keepdim=True) + 1e-4) if scale == "group" else centred


def _check_completion_probs_take_any_rewards():
    floor, rate, g = 0.1, 0.5, 8
    for rewards in (PASS_FAIL, 3 * PASS_FAIL - 1, 1 + PASS_FAIL, CONTINUOUS):  # {0, 1}, {-1, 2}, {1, 2}, continuous
        for scale in ("none", "group"):
            adv = _advantages(rewards, scale)
            for scheme in ("proportional", "paper"):
                p = pruning.completion_keep_probs(adv, rate, scheme=scheme, min_keep_prob=floor)
                assert (p[adv == 0] == 0).all()  # an all-equal group (all 2s, all 3.7s): a zero loss, never trained
                live = p[adv != 0]
                assert ((live >= floor - 1e-12) & (live <= 1 + 1e-12)).all(), (scheme, scale, p)
                if scheme == "proportional":
                    for row, a in zip(p, adv, strict=True):
                        assert float(row.sum()) == pytest.approx(min((1 - rate) * g, int((a != 0).sum())))
                    if rewards is not CONTINUOUS:  # equal |A|, half above the mean, half below: all alike
                        assert p[3].tolist() == pytest.approx([1 - rate] * g), scale
    # one outlying reward: kept for sure, the rest share the remaining budget evenly (|A| equal), 3/7 each
    p = pruning.completion_keep_probs(_advantages(CONTINUOUS, "none"), rate, min_keep_prob=floor)
    assert p[0].tolist() == pytest.approx([1.0] + [3 / 7] * 7) and p[2].tolist() == [0.0] * 8
    # rewards a r + b: the probabilities of r (unscaled advantages are a x those of r)
    base = pruning.completion_keep_probs(_advantages(PASS_FAIL, "none"), rate, min_keep_prob=floor)
    for a, b in ((3.0, -1.0), (1.0, 1.0), (0.5, 3.7)):
        moved = pruning.completion_keep_probs(_advantages(a * PASS_FAIL + b, "none"), rate, min_keep_prob=floor)
        assert moved.tolist() == [pytest.approx(row, rel=1e-12) for row in base.tolist()]


def test_completion_keep_probabilities_take_rewards_outside_the_unit_interval():
    _check_completion_probs_take_any_rewards()


def _check_prompt_probs_from_rewards_outside_the_unit_interval():
    ids = ["one_pass", "half", "all_high", "all_low", "new"]
    rows = PASS_FAIL[[0, 3, 2]].tolist() + [[0.0] * 8]  # 1 of 8, 4 of 8, all, none
    probs = {}
    for lo, hi in ((0.0, 1.0), (-1.0, 2.0), (1.0, 2.0)):
        h = PromptHistory()
        r = lo + (hi - lo) * torch.tensor(rows)
        h.update(ids[:4], r, _advantages(r, "none"), step=0)
        assert [h.get(i).all_equal for i in ids[:4]] == [False, False, True, True]
        for scheme in ("paper", "proportional"):
            p = pruning.prompt_keep_probs(h, ids, 0.5, scheme=scheme, min_keep_prob=0.1, step=1)
            assert ((p >= 0.1) & (p <= 1)).all() and p[4] == 1.0  # unseen: kept
            assert max(p[2], p[3]) <= min(p[0], p[1])  # the all-equal groups' prompts are kept least
            probs.setdefault(scheme, []).append(p)
        assert pruning.greso_keep_probs(h, ids, 0.5).tolist() == [1.0, 1.0, 0.5, 0.5, 1.0]
    for scheme, (p01, *others) in probs.items():
        for p in others:  # rewards in {-1, 2} or {1, 2}: the probabilities of {0, 1}
            assert p.tolist() == pytest.approx(p01.tolist(), rel=1e-12), scheme
    assert probs["proportional"][0][2:4].tolist() == [0.1, 0.1]  # scored 0 (no signal): on the floor


def test_prompt_keep_probabilities_from_a_history_of_rewards_outside_the_unit_interval():
    _check_prompt_probs_from_rewards_outside_the_unit_interval()


#: groups no rewards in [0, 1] can give: (rewards, what they are)
OUTSIDE = [([2.0, 2, -1, -1, -1, -1, -1, -1], "{-1, 2}, 2 passes of 8: mean -0.25, read as 0 passes"),
           ([2.0, -1, 2, -1, 2, -1, 2, -1], "{-1, 2}, 4 of 8: mean 0.5, std 1.5"),
           ([2.0] * 8, "{-1, 2}, all passed: mean 2"),
           ([2.0, 1, 1, 1, 1, 1, 1, 1], "accuracy + format: mean 1.125, read as all passed"),
           ([3.7] * 8, "continuous, all 3.7"),
           ([3.7, 0, 0, 0, 0, 0, 0, 0], "continuous, mean 0.4625 in [0, 1] but std 1.22 > sqrt(m (1 - m))"),
           ([-0.5] * 8, "negative")]
#: groups rewards in [0, 1] can give, fractional ones included
INSIDE = [[1.0] * 8, [0.0] * 8, [1.0, 1, 1, 0, 0, 0, 0, 0], [0.25, 0.75, 0.5, 1, 0, 0.5, 0.25, 0.75], [0.5] * 8,
          torch.full((8,), 0.1, dtype=torch.float32).tolist(), [1.0, 0.999, 1, 1, 1, 1, 1, 1]]


def _check_the_posterior_refuses_rewards_outside_the_unit_interval():
    ok = [1.0, 0, 0, 1, 0, 0, 1, 0]
    for rewards, what in OUTSIDE:
        h = PromptHistory(half_life=20.0)
        r = torch.tensor([ok, rewards])
        h.update(["ok", "q-bad"], r, _advantages(r, "group"), step=3)
        with pytest.raises(ValueError, match=r"posterior.*'q-bad'.*step 3\).*mean reward"):
            posterior.posterior_scores(h, ["ok", "q-bad", "new"], 8, step=4)
        with pytest.raises(ValueError, match="'q-bad'"):
            pruning.prompt_keep_probs(h, ["q-bad", "ok"], 0.5, scheme="posterior", step=4, group_size=8)
        # a stale record is read as unseen: nothing of it is used, so nothing to refuse
        stale = posterior.posterior_scores(h, ["ok", "q-bad"], 8, step=10, max_age=5)
        assert stale.tolist() == pytest.approx([math.sqrt(1 - 2 / 9)] * 2), what
        # the schemes that read |A| take the same history
        assert (pruning.prompt_keep_probs(h, ["q-bad", "ok"], 0.5, scheme="proportional") >= 0.1).all()


def test_the_posterior_refuses_rewards_outside_the_unit_interval_naming_the_prompt():
    _check_the_posterior_refuses_rewards_outside_the_unit_interval()


def _check_the_posterior_refuses_an_earlier_group_outside_the_unit_interval():
    """A group outside [0, 1] stays in the prompt's evidence after groups inside it: still refused, naming its step,
    until the evidence is dropped as stale."""
    h = PromptHistory(half_life=20.0)
    bad, ok = torch.tensor([[2.0, -1, 2, -1, 2, -1, 2, -1]]), torch.tensor([[1.0, 0, 0, 1, 0, 0, 1, 0]])
    h.update(["q"], bad, _advantages(bad, "group"), step=3)
    for step in (4, 5):
        h.update(["q"], ok, _advantages(ok, "group"), step=step)
    with pytest.raises(ValueError, match=r"posterior.*'q' had a group \(step 3\)"):
        posterior.posterior_scores(h, ["q"], 8, step=6)
    h.update(["q"], ok, _advantages(ok, "group"), step=40, max_age=10)  # stale: its evidence starts afresh
    assert 0 < float(posterior.posterior_scores(h, ["q"], 8, step=41, max_age=10)[0]) < 1


def test_the_posterior_refuses_an_earlier_group_outside_the_unit_interval():
    _check_the_posterior_refuses_an_earlier_group_outside_the_unit_interval()


def _check_the_posterior_takes_rewards_in_the_unit_interval():
    h = PromptHistory(half_life=20.0)
    ids = [f"q{i}" for i in range(len(INSIDE))]
    r = torch.tensor(INSIDE, dtype=torch.float64)
    h.update(ids, r, _advantages(r, "group"), step=0)
    h.update(ids, r, _advantages(r, "group"), step=1)  # the evidence of two groups
    s = posterior.posterior_scores(h, [*ids, "new"], 8, step=2)
    assert ((s >= 0) & (s <= 1)).all() and s[0] < s[-1] and s[1] < s[-1]  # twice solved / failed: less signal
    assert s[2] > s[0] and s[3] > s[0]  # 3 passes of 8, fractional rewards of mean 0.5: more than solved
    p = pruning.prompt_keep_probs(h, [*ids, "new"], 0.5, scheme="posterior", min_keep_prob=0.1, step=2, group_size=8)
    assert ((p >= 0.1) & (p <= 1)).all() and float(p.sum()) == pytest.approx(0.5 * (len(ids) + 1))
    old = PromptHistory.from_state_dict({"records": {"q": {"mean_reward": 0.75, "reward_std": 0.4,
                                                           "mean_abs_advantage": 0.8, "step": 1, "seen": 1}}})
    assert 0 < float(posterior.posterior_scores(old, ["q"], 8, step=1)[0]) < 1  # a record from before the evidence


def test_the_posterior_takes_every_reward_in_the_unit_interval():
    _check_the_posterior_takes_rewards_in_the_unit_interval()


REWARD_RANGE_CHECKS = {  # the check each kind of mutant must fail, and how it fails
    "completions": (_check_completion_probs_take_any_rewards, AssertionError),
    "prompts": (_check_prompt_probs_from_rewards_outside_the_unit_interval, AssertionError),
    "posterior_refuses": (_check_the_posterior_refuses_rewards_outside_the_unit_interval, pytest.fail.Exception),
    "posterior_refuses_earlier": (_check_the_posterior_refuses_an_earlier_group_outside_the_unit_interval,
                                  pytest.fail.Exception),
    "posterior_accepts": (_check_the_posterior_takes_rewards_in_the_unit_interval, ValueError),
}


@pytest.mark.parametrize("mutant", list(REWARD_RANGE_MUTANTS), ids=repr)
def test_reward_range_mutants_are_caught(monkeypatch, mutant):
    check, fails_with = REWARD_RANGE_CHECKS[REWARD_RANGE_MUTANTS[mutant]]
    mutant.install(monkeypatch)
    with pytest.raises(fails_with):
        check()
