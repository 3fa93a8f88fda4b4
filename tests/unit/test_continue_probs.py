"""The pilot's continue probabilities c_q against an independent computation (issue #64).

A wrong c_q (the pilot's side swapped, its k rewards dropped, the fitted prior or the history's discount ignored)
leaves the estimator unbiased (it weighs each continued group by 1 / c_q, whatever c_q is), so the exact tests cannot
see it; it silently costs efficiency, and `benchmarks/pilot_replay.py` would report wrong numbers. Here c_q is
recomputed from its definition: the largest of the floor and 1 - P(the rest of the group all land on the pilot's
side), with p ~ Beta(prior + the prompt's discounted successes and failures + the pilot), the prior fitted to a pool
of 40 prompts (past the uniform fallback). P = E[p^n] is the product of Beta moments Π (a + i) / (a + b + i) (the
package uses log-gamma functions), the evidence summed group by group from the recorded rewards (each group's
weight 2^(-age / half-life)); nothing is taken from the package but the fitted prior (itself checked against an
independent fit in test_pilot_evidence.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mutants import CONTINUE_MUTANTS

from dppo_core import posterior
from dppo_core.history import MIN_PRIOR_GROUPS, PromptHistory

G, K, HALF_LIFE, FLOOR = 8, 2, 20.0, 0.1


def _pool() -> tuple[PromptHistory, dict[str, list[tuple[int, list[float]]]]]:
    """A history of 40 prompts (J-shaped pass counts, so the fit is far from uniform), some seen at several steps, and
    every group it recorded per prompt (step, rewards)."""
    h = PromptHistory(half_life=HALF_LIFE)
    groups: dict[str, list[tuple[int, list[float]]]] = {}
    rng = np.random.default_rng(0)
    for step in (0, 7, 15):
        for q in range(40):
            if step and q % 3:
                continue  # a third of the prompts come back
            p = 0.97 if q < 16 else 0.03 if q < 28 else 0.5
            r = [float(x) for x in rng.random(G) < p]
            t = torch.tensor([r], dtype=torch.float64)
            h.update([f"q{q}"], t, t - t.mean(), step=step)
            groups.setdefault(f"q{q}", []).append((step, r))
    return h, groups


def _expected(prior: tuple[float, float], groups: list[tuple[int, list[float]]], pilot_value: float, step: int
              ) -> float:
    s = f = 0.0
    for at, r in groups:  # each group's evidence discounted by its own age
        w = 0.5 ** ((step - at) / HALF_LIFE)
        s, f = s + w * sum(r), f + w * (len(r) - sum(r))
    a, b = prior[0] + s, prior[1] + f
    a, b = (a + K, b) if pilot_value == 1.0 else (a, b + K)
    side = a if pilot_value == 1.0 else b  # the pilot's side: E[p^n] (or E[(1-p)^n]) as a product of moments
    all_same = math.prod((side + i) / (a + b + i) for i in range(G - K))
    return max(FLOOR, 1.0 - all_same)


def _check(history: PromptHistory, groups: dict[str, list[tuple[int, list[float]]]]) -> None:
    prior = history.fitted_prior(G)
    assert sum(history.pass_counts(G)) >= MIN_PRIOR_GROUPS and prior != (1.0, 1.0)
    step = 30
    ids = ["q0", "q3", "q16", "q18", "q30", "q33", "new"]  # solved, unsolved, coin prompts, one unseen
    for value in (1.0, 0.0):
        pilots = torch.full((len(ids), K), value, dtype=torch.float64)
        got = posterior.continue_probs(pilots, FLOOR, "posterior", history=history, prompt_ids=ids, group_size=G,
                                       step=step)
        want = [_expected(prior, groups.get(i, []), value, step) for i in ids]
        assert got.tolist() == pytest.approx(want, abs=1e-9), (value, got.tolist(), want)
    mixed = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # a pilot that differs: always continued
    assert posterior.continue_probs(mixed, FLOOR, "posterior", history=history, prompt_ids=["q0"], group_size=G,
                          step=step).tolist() == [1.0]


def test_continue_probabilities_equal_an_independent_computation():
    history, groups = _pool()
    _check(history, groups)
    # the values vary: the check is not passed by a constant
    ones = torch.ones(3, K, dtype=torch.float64)
    got = posterior.continue_probs(ones, FLOOR, "posterior", history=history, prompt_ids=["q0", "q16", "q30"],
                                   group_size=G, step=30)
    assert got.max() - got.min() > 0.2


@pytest.mark.parametrize("mutant", list(CONTINUE_MUTANTS), ids=repr)
def test_continue_mutants_are_caught(monkeypatch, mutant):
    mutant.install(monkeypatch)
    history, groups = _pool()
    with pytest.raises(AssertionError):
        _check(history, groups)
