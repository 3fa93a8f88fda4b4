"""Mutants of the DPPO estimator: the mistakes an implementation is likely to make.

Each must be caught by the unbiasedness tests, which shows that those tests have the power to see a small
bias, not only a large one: ``MUTANTS`` by both tests/test_exact_expectation.py (exact enumeration, in the
trainer's order) and tests/test_unbiased.py (Monte Carlo through the trainer, on a real model's gradient);
``EXACT_MUTANTS`` by the exact enumeration only (their bias is below what a few thousand random draws see, or
shows only when ``observe`` runs between ``select`` and ``weigh``, as in ``DPPOTrainer.train_step``).
"""

from __future__ import annotations

import torch

from dppo_core.estimator import DPPOEstimator, Selection, Weighting
from dppo_core.pruning import PromptHistory


class ScaledRandomWeights(DPPOEstimator):
    """Weights of the randomly kept completions (p < 1) 5% too large."""

    factor = 1.05

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        w = super().weigh(advantages, selection, step, **kwargs)
        probs = self.completion_probs(advantages, kwargs.get("lengths"), None if selection is None else selection.probs)
        random = (probs < 1) & w.keep
        return Weighting(w.keep, torch.where(random, w.weights * self.factor, w.weights), w.num_sequences)


class NoPromptFloor(DPPOEstimator):
    """The floor ignored: prompts whose last group was degenerate get keep probability 0 (never rolled out)."""

    def prompt_probs(self, ids, step, budget=None):
        p = super().prompt_probs(ids, step, budget)
        scores = torch.tensor([self.history.score(i, step, self.history_max_age) or 0.0 for i in ids])
        return torch.where((scores == 0) & (p < 1), torch.zeros_like(p), p)


class StalePromptProbs(DPPOEstimator):
    """π taken one step stale: the prompts are drawn with today's π, but weighted by the previous step's."""

    stale: PromptHistory | None = None

    def select(self, candidate_ids, step, size=None):
        sel = super().select(candidate_ids, step, size)
        now, self.history = self.history, self.stale
        try:
            sel.probs = self.prompt_probs([candidate_ids[i] for i in sel.indices], step)
        finally:
            self.history = now
        return sel


class KeptCountNormaliser(DPPOEstimator):
    """C = the number of completions kept (a ratio), instead of the constant |B|·G."""

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        w = super().weigh(advantages, selection, step, **kwargs)
        return Weighting(w.keep, w.weights, max(1, int(w.keep.sum())))


class SlightlyScaledRandomWeights(ScaledRandomWeights):
    """Weights of the randomly kept completions (p < 1) 3% too large."""

    factor = 1.03


class StaleDensePromptProbs(DPPOEstimator):
    """π one step stale in dense windows only: a dense window is drawn with today's π and weighted with the
    previous step's (over the same window and budget); a step whose candidates are given is right."""

    dense_only = True  # the same as the real estimator without dense prompts
    stale: PromptHistory | None = None

    def select(self, candidate_ids, step, size=None):
        sel = super().select(candidate_ids, step, size)
        if size is None or not self.dense_prompts:
            return sel
        now, self.history = self.history, self.stale
        try:
            sel.probs = self.prompt_probs(list(candidate_ids[:sel.window]), step, budget=size)[sel.indices]
        finally:
            self.history = now
        return sel


class ProbsFromUpdatedHistory(DPPOEstimator):
    """π_q recomputed in ``weigh`` from the history, which ``observe`` has just updated with this step's own
    groups (the trainer observes before it weighs): the prompts are drawn with one π and weighted with another.
    Called without ``observe`` in between, it is the real estimator."""

    def select(self, candidate_ids, step, size=None):
        sel = super().select(candidate_ids, step, size)
        dense = size is not None and self.dense_prompts
        self.window_ids, self.budget = list(candidate_ids[:sel.window]), size if dense else None
        return sel

    def weigh(self, advantages, selection=None, step=0, **kwargs):
        probs = self.prompt_probs(self.window_ids, step, budget=self.budget)
        selection = Selection(selection.indices, probs[selection.indices], selection.window)
        return super().weigh(advantages, selection, step, **kwargs)


MUTANTS = (ScaledRandomWeights, NoPromptFloor, StalePromptProbs, KeptCountNormaliser)
EXACT_MUTANTS = (SlightlyScaledRandomWeights, StaleDensePromptProbs, ProbsFromUpdatedHistory)
