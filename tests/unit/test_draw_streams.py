"""The estimator's random draws are independent of each other (issue #64): the prompt keep draw, the pilot's continue
draw and the completion keep draw, through the estimator's own code and its real generators (``step_generator``).

The exact tests (tests/unit/test_exact_expectation.py) enumerate every draw but hand the estimator a sampler of their
own, so they cannot see two draws that share one random stream. The smallest case of that bug: one prompt kept with
probability π = 0.5, its pilot continued with c = 0.25, a completion kept with p = 0.5; an estimate weighted
1 / (π c p) is unbiased only if the three draws are independent. Were the continue draw made from the prompt draw's
uniforms, a kept prompt (u < 0.5) would be continued whenever u < 0.25, half the time instead of a quarter, and the
estimate would be 2.0x the truth. Each check here fails on a deliberately wrong line (``STREAM_MUTANTS``).
"""

from __future__ import annotations

import math

import pytest
import torch
from mutants import STREAM_MUTANTS

from dppo_core.estimator import DPPOEstimator

PI, C, P = 0.5, 0.25, 0.5
STEPS = 12_000


def _estimator(seed: int = 3) -> DPPOEstimator:
    """DPPO (whose continue draw a pilot of one completion asks), Bernoulli draws, and its keep probabilities fixed
    at π, c and p (the draws themselves are the estimator's own)."""
    est = DPPOEstimator(prompt_prune_rate=0.5, completion_prune_rate=0.5, fixed_size_sampling=False,
                        seed=seed)
    est.prompt_probs = lambda ids, step, budget=None: torch.full((len(ids),), PI, dtype=torch.float64)
    est.continue_probs = lambda ids, pilot, step: torch.full((len(ids),), C, dtype=torch.float64)
    est.completion_probs = lambda adv, lengths=None, prompt_probs=None: torch.full(adv.shape, P, dtype=torch.float64)
    return est


def _draws(est: DPPOEstimator, steps: int) -> list[tuple[bool, bool, bool]]:
    """Per step: (prompt kept, its all-equal pilot continued, its first completion kept), each drawn only if the
    one before was (as the trainer draws them)."""
    out = []
    for step in range(steps):
        sel = est.select(["q"], step, size=1)
        kept = bool(sel.indices)
        cont = kept and bool(est.continue_groups(["q"], torch.ones(1, 1), step).keep[0])
        comp = cont and bool(est.weigh(torch.tensor([[1.0, -1.0]]), sel, step).keep[0, 0])
        out.append((kept, cont, comp))
    return out


def _check_joint(draws: list[tuple[bool, bool, bool]]) -> None:
    """E[1{kept, continued, completion kept} / (π c p)] = 1, and each stage at its own probability."""
    n = len(draws)
    estimate = sum(comp for _, _, comp in draws) / (PI * C * P) / n
    se = math.sqrt((1 / (PI * C * P) - 1) / n)  # of a Bernoulli(πcp) / (πcp) mean
    assert abs(estimate - 1) < 5 * se, f"the joint estimate is {estimate:.3f} (standard error {se:.3f}), not 1"
    kept = [d for d in draws if d[0]]
    assert abs(len(kept) / n - PI) < 5 * math.sqrt(PI * (1 - PI) / n)
    continued = [d for d in kept if d[1]]
    assert abs(len(continued) / len(kept) - C) < 5 * math.sqrt(C * (1 - C) / len(kept))


def _check_steps(draws: list[tuple[bool, bool, bool]]) -> None:
    """Consecutive steps' prompt draws are independent: P(kept at s and at s + 1) = π²."""
    kept = [d[0] for d in draws]
    both = sum(a and b for a, b in zip(kept, kept[1:], strict=False)) / (len(kept) - 1)
    assert abs(both - PI * PI) < 5 * math.sqrt(PI * PI * (1 - PI * PI) / (len(kept) - 1)), both


def test_the_prompt_continue_and_completion_draws_are_independent():
    draws = _draws(_estimator(), STEPS)
    _check_joint(draws)
    _check_steps(draws)


def test_seeds_draw_differently():
    a, b = (_draws(_estimator(seed), 200) for seed in (3, 4))
    assert a != b


@pytest.mark.parametrize("mutant", list(STREAM_MUTANTS), ids=repr)
def test_stream_mutants_are_caught(monkeypatch, mutant):
    mutant.install(monkeypatch)
    draws = _draws(_estimator(), STEPS)
    with pytest.raises(AssertionError):
        (_check_joint if STREAM_MUTANTS[mutant] == "joint" else _check_steps)(draws)
