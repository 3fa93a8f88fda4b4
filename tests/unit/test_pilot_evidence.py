"""A stopped pilot's evidence enters the history as what it is: k rewards, not a group of G (issue #64).

The pilot rolls out k of a group's G completions first and stops an all-equal pilot's group with probability
1 - c. The stop depends only on what was observed, so the likelihood of the observed rewards is the Beta-binomial of
k trials for a stopped group and of G for a continued one: the fitted prior (maximum marginal likelihood) from a
pilot run's history estimates the same pool as the one from every group recorded whole, with the wider spread of
fewer trials. Recording a stopped pilot as a group of 0 or G passes (``pass_counts`` rounding G x its mean, as before
the fix) fits a U shape to a uniform pool: on this test's pool Beta(0.22, 0.22), P(informative) 0.38 against a true
0.78, where the fix fits Beta(0.95, 0.95), 0.77, as the whole groups do.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from mutants import PILOT_EVIDENCE_MUTANTS

from dppo_core.history import PromptHistory, _beta_binomial_grid

G, K, C = 8, 2, 0.1


def _histories(n_prompts: int = 3000, seed: int = 0) -> tuple[PromptHistory, PromptHistory, int]:
    """The same groups of a uniform pool (p ~ U(0, 1)) recorded whole, and as a pilot run records them (an all-equal
    pilot of K stopped with probability 1 - C: only its K rewards observed)."""
    rng = random.Random(seed)
    whole, pilot, stops = PromptHistory(), PromptHistory(), 0
    for q in range(n_prompts):
        p = rng.random()
        r = torch.tensor([[float(rng.random() < p) for _ in range(G)]], dtype=torch.float64)
        whole.update([f"q{q}"], r, r - r.mean(), step=0)
        stopped = bool((r[0, :K] == r[0, 0]).all()) and rng.random() >= C
        seen, stops = (r[:, :K] if stopped else r), stops + stopped
        pilot.update([f"q{q}"], seen, seen - seen.mean(), step=0)
    return whole, pilot, stops


def _log_likelihood(history: PromptHistory) -> Callable[[float, float], float]:
    """Σ over records of log Beta-binomial(passes | its size, a, b) (without the binomial coefficients), written with
    math.lgamma record by record (not the package's tensors)."""
    cases: dict[tuple[int, int], int] = {}
    for rec in history.records.values():
        n = rec.size or G
        key = (round(n * rec.mean_reward), n)
        cases[key] = cases.get(key, 0) + 1

    def ll(a: float, b: float) -> float:
        return sum(c * (math.lgamma(k + a) + math.lgamma(n - k + b) - math.lgamma(n + a + b) - math.lgamma(a)
                        - math.lgamma(b) + math.lgamma(a + b)) for (k, n), c in cases.items())
    return ll


def _check_the_fit_is_the_maximum(history: PromptHistory) -> None:
    """The package's fit reaches the independent likelihood's maximum over the same grid (to float rounding: two grid
    points within rounding of each other may be picked either way on another CPU's sums)."""
    ll, grid = _log_likelihood(history), [float(x) for x in _beta_binomial_grid(G)[0]]
    best = max(ll(a, b) for a in grid for b in grid)
    assert ll(*history.fitted_prior(G)) >= best - 1e-9 * abs(best)


def _p_informative(a: float, b: float) -> float:
    """P(a group of G is not all equal) for p ~ Beta(a, b): 1 - E[p^G] - E[(1-p)^G]."""
    def moment(x: float, y: float) -> float:
        return math.exp(math.lgamma(x + G) + math.lgamma(x + y) - math.lgamma(x) - math.lgamma(x + y + G))
    return 1 - moment(a, b) - moment(b, a)


def _check_fit(whole: PromptHistory, pilot: PromptHistory) -> None:
    truth = _p_informative(1.0, 1.0)  # 7/9: a uniform pool
    for h in (whole, pilot):
        a, b = h.fitted_prior(G)
        _check_the_fit_is_the_maximum(h)
        # both estimate the pool: within 0.05 of P(informative) = 7/9 with 3,000 prompts (the pilot's fewer trials
        # widen it; the whole groups' fit lands within 0.01 here)
        assert abs(_p_informative(a, b) - truth) < 0.05, (a, b)


def test_the_fitted_prior_of_a_pilot_run_estimates_the_pool_its_whole_groups_do():
    whole, pilot, stops = _histories()
    assert stops > 300, "the pilot stopped groups, so the check sees them"
    assert all(r.size == G for r in whole.records.values())
    assert {r.size for r in pilot.records.values()} == {K, G}
    _check_fit(whole, pilot)
    # the stopped groups' evidence in the record is K trials (what the posterior reads), and survives a checkpoint
    rec = next(r for r in pilot.records.values() if r.size == K)
    assert rec.successes + rec.failures == K
    assert PromptHistory.from_state_dict(pilot.state_dict()).fitted_prior(G) == pilot.fitted_prior(G)
    # a record from before the size was kept reads as a whole group
    old = PromptHistory.from_state_dict({"records": {k: {kk: vv for kk, vv in v.items() if kk != "size"}
                                                     for k, v in whole.state_dict()["records"].items()}})
    assert old.fitted_prior(G) == whole.fitted_prior(G) and old.pass_counts(G).tolist() == whole.pass_counts(G).tolist()


@pytest.mark.parametrize("mutant", list(PILOT_EVIDENCE_MUTANTS), ids=repr)
def test_pilot_evidence_mutants_are_caught(monkeypatch, mutant):
    mutant.install(monkeypatch)
    whole, pilot, _ = _histories()
    with pytest.raises(AssertionError):
        _check_fit(whole, pilot)
