"""The ``posterior`` and ``fitted`` prompt schemes' scores: what a prompt's whole history says about its next
group.

A prompt's success rate is given a Beta posterior from the discounted passes and failures of every group it
had (:meth:`~dppo_core.history.PromptHistory.evidence`); the passes of its next group of G are then
Beta-binomial (:func:`beta_binomial_pmf`), and :func:`posterior_scores` is √E[Σ A² / G] of that group
(:func:`group_signal`): √P(the next group is informative) with group-scaled advantages.
:func:`dppo_core.pruning.prompt_keep_probs` keeps prompts ``proportional`` to it (``posterior``), to its
square under a prior fitted to the pool (``fitted``, :meth:`~dppo_core.history.PromptHistory.fitted_prior`),
or to that square recalibrated by the run's own record of prompts after a run of all-equal groups (``streak``,
:class:`StreakCalibration`). The posterior reads rewards as pass rates in [0, 1] and refuses a record that
such rewards cannot have (:func:`check_pass_rates`); the other prompt schemes read the rewards only through
|A|.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from dppo_core.history import PromptHistory, PromptRecord


def beta_binomial_pmf(alpha: float, beta: float, n: int) -> np.ndarray:
    """P(k successes in n) for k = 0..n when the success rate is Beta(alpha, beta) distributed."""
    k = np.arange(n + 1)
    log_choose = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in k])
    log_b = np.array([math.lgamma(i + alpha) + math.lgamma(n - i + beta) - math.lgamma(n + alpha + beta)
                      for i in k])
    log_b0 = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    pmf = np.exp(log_choose + log_b - log_b0)
    return cast(np.ndarray, pmf / pmf.sum())  # numpy types a ufunc's result's dtype, and so this, as Any


def group_signal(k: np.ndarray, group_size: int, scale_rewards: str = "group") -> np.ndarray:
    """Σ_i A_i² / G of a group of pass/fail rewards with k passes: what its gradient's squared size scales
    with.

    Group-scaled advantages have Σ A² = G in every group that is not all right or all wrong (up to eps), so 1
    there and 0 at k = 0 or G; unscaled (``none``) ones have Σ A² / G = k (G - k) / G², the rewards' variance.
    """
    k = np.asarray(k, dtype=np.float64)
    if scale_rewards == "none":
        return cast(np.ndarray, k * (group_size - k) / group_size**2)  # numpy: Any (see beta_binomial_pmf)
    return ((k > 0) & (k < group_size)).astype(np.float64)


def check_pass_rates(prompt_id: str, record: PromptRecord, tol: float = 1e-9) -> None:
    """Refuse a prompt's record whose rewards cannot all have been in [0, 1], naming the prompt and the
    rewards.

    :func:`posterior_scores` reads a group's rewards as pass rates: its evidence is G x the mean reward passes
    (:meth:`PromptHistory.update`), the mean clipped into [0, 1]. Rewards outside [0, 1] (a sum of reward
    functions such as accuracy + format, rewards in {-1, 2}, continuous scores such as 3.7) make that evidence
    wrong (2 passes of 8 at rewards in {-1, 2} have mean -0.25 and count as 0 passes; 3.7 counts as all
    passed). Rewards in [0, 1] have a mean m in [0, 1] and a variance of at most m (1 - m) (x² <= x on [0, 1],
    equality for pass/fail rewards), so a record outside those bounds cannot come from them. Every group whose
    rewards left [0, 1] is remembered in the record (``outside_unit_at``, the first one's step, kept until the
    prompt's evidence is dropped as stale), so an earlier such group is refused even after a group inside
    [0, 1]; the bounds are the check of a record written before that was kept.
    """
    m, v = record.mean_reward, record.reward_std ** 2
    if record.outside_unit_at is not None:
        raise ValueError(
            f"prompt_scheme 'posterior' (and 'fitted') reads rewards as pass rates in [0, 1], but prompt "
            f"{prompt_id!r} had a group (step {record.outside_unit_at}) with rewards outside [0, 1] (its "
            f"last group's mean reward {m:.6g}, std {record.reward_std:.6g}): its evidence was clipped into "
            "[0, 1] and the posterior would be wrong. Rescale the rewards into [0, 1] (e.g. (r - min) / "
            "(max - min), or combine_rewards with weights summing to 1 over rewards in [0, 1]), or use "
            "prompt_scheme 'paper' or 'proportional', which read only |A|")
    if not (-tol <= m <= 1 + tol and v <= m * (1 - m) + tol):
        raise ValueError(
            f"prompt_scheme 'posterior' (and 'fitted') reads rewards as pass rates in [0, 1], but prompt "
            f"{prompt_id!r}'s last group (step {record.step}) had mean reward {m:.6g} and std "
            f"{record.reward_std:.6g}, which rewards in [0, 1] cannot have: its evidence was clipped into "
            "[0, 1] and the posterior would be wrong. Rescale the rewards into [0, 1] (e.g. (r - min) / "
            "(max - min), or combine_rewards with weights summing to 1 over rewards in [0, 1]), or use "
            "prompt_scheme 'paper' or 'proportional', which read only |A|")


def posterior_scores(history: PromptHistory, prompt_ids: Sequence[str], group_size: int, *,
                     step: int | None = None, max_age: int | None = None,
                     prior: tuple[float, float] = (1.0, 1.0), scale_rewards: str = "group") -> torch.Tensor:
    """Each prompt's expected learning signal from everything its history shows: √E[Σ A² / G] of its next
    group.

    The prompt's success rate is Beta(prior + discounted successes, prior + discounted failures)
    (:meth:`PromptHistory.evidence`); the next group's passes k are then Beta-binomial over ``group_size``
    draws, and the score is √(Σ_k P(k) · :func:`group_signal` (k)). With group-scaled advantages that is
    √P(the group is informative) = √(1 - E[p^G] - E[(1 - p)^G]). The square root because the
    variance-optimal inclusion probability of a prompt is ∝ √E‖S_q‖² (docs/estimator.md), and E‖S_q‖² scales
    with E[Σ A²] when completions' gradients are of similar size. Unseen prompts (and, with ``max_age``,
    prompts last seen longer ago) get the prior's score. Rewards must lie in [0, 1] (those strictly inside
    count as fractional passes): a record that rewards in [0, 1] cannot have raises ValueError
    (:func:`check_pass_rates`). Returns float64, shape (len(prompt_ids),).
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be at least 1 (the completions per prompt, G)")
    if min(prior) <= 0:
        raise ValueError(f"prior={prior!r}: both Beta parameters must be > 0, e.g. (1, 1) (uniform)")
    k = np.arange(group_size + 1)
    signal = group_signal(k, group_size, scale_rewards)
    cache: dict[tuple[float, float], float] = {}
    out = []
    for pid in prompt_ids:
        rec = history.get(pid)
        stale = rec is not None and max_age is not None and step is not None and step - rec.step > max_age
        if rec is not None and not stale:
            check_pass_rates(pid, rec)
        s, f = (0.0, 0.0) if rec is None or stale else history.evidence(pid, step)
        key = (round(prior[0] + s, 9), round(prior[1] + f, 9))
        if key not in cache:
            cache[key] = math.sqrt(max(0.0, float(beta_binomial_pmf(*key, group_size) @ signal)))
        out.append(cache[key])
    return torch.tensor(out, dtype=torch.float64)


def fitted_informative(history: PromptHistory, prompt_ids: Sequence[str], group_size: int, *,
                       step: int | None = None, max_age: int | None = None) -> torch.Tensor:
    """P(the next group of ``group_size`` is informative, not all equal) of each prompt under the prior fitted
    to the pool (:meth:`PromptHistory.fitted_prior`) and the prompt's discounted history: what ``streak``
    calibrates."""
    prior = history.fitted_prior(group_size)
    return posterior_scores(history, prompt_ids, group_size, step=step, max_age=max_age, prior=prior) ** 2


def continue_probs(pilot_rewards: torch.Tensor, floor: float, scheme: str = "constant", *,
                   history: PromptHistory | None = None, prompt_ids: Sequence[str] = (), group_size: int = 0,
                   step: int | None = None, max_age: int | None = None) -> torch.Tensor:
    """c_q: the probability that each group gets the rest of its completions after its pilot
    (``pilot_rewards``, shape (P, k)). 1 where the pilot's rewards are not all equal (the group is informative
    whatever comes next); where they are all equal, ``floor`` (``constant``), or (``posterior``) the larger of
    ``floor`` and the probability that the remaining ``group_size`` - k completions are not all equal to the
    pilot's value, under the prompt's success rate's Beta posterior: the pool's fitted prior
    (:meth:`PromptHistory.fitted_prior`), the prompt's discounted history and its pilot. A pilot all equal at
    a value other than 0 or 1 (not pass/fail) gets ``floor``. Everything it reads is known when the decision
    is drawn (the history before the step, the pilot), so weighing a continued group 1 / c_q keeps the
    estimate unbiased. Returns float64, shape (P,)."""
    pilot = torch.as_tensor(pilot_rewards, dtype=torch.float64)
    equal = ((pilot == pilot[:, :1]).all(dim=1) if pilot.numel()
             else torch.zeros(pilot.shape[0], dtype=torch.bool))
    probs = torch.ones(pilot.shape[0], dtype=torch.float64)
    probs[equal] = floor
    if scheme == "constant" or not equal.any():
        return probs
    if history is None or len(prompt_ids) != pilot.shape[0] or group_size <= pilot.shape[1]:
        raise ValueError("continue_probs(scheme='posterior') needs the history, one prompt id per pilot and "
                         f"the group size G > k (got {len(prompt_ids)} ids for {pilot.shape[0]} pilots, "
                         f"G={group_size})")
    a0, b0 = history.fitted_prior(group_size)
    k, rest = pilot.shape[1], group_size - pilot.shape[1]
    for q in equal.nonzero().flatten().tolist():
        value, pid = float(pilot[q, 0]), prompt_ids[q]
        if value not in (0.0, 1.0):
            continue
        rec = history.get(pid)
        stale = rec is not None and max_age is not None and step is not None and step - rec.step > max_age
        if rec is not None and not stale:
            check_pass_rates(pid, rec)
        s, f = (0.0, 0.0) if rec is None or stale else history.evidence(pid, step)
        a, b = (a0 + s + k, b0 + f) if value == 1.0 else (b0 + f + k, a0 + s)  # a: the pilot's side
        # P(every one of the rest lands on the pilot's side) = E[p^rest] under Beta(a, b)
        log_same = math.lgamma(a + rest) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(a + b + rest)
        probs[q] = max(floor, 1.0 - math.exp(log_same))
    return probs


#: :class:`StreakCalibration`'s bins of the ``fitted`` P(informative), and its streak lengths (the last one:
#: that many or more all-equal groups in a row).
CALIBRATION_BINS: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
CALIBRATION_STREAKS = 3
#: Pseudo-groups at the ``fitted`` prediction that :class:`StreakCalibration` adds to each cell: with fewer
#: groups observed than this, the cell's estimate stays closer to the posterior's than to its own rate.
CALIBRATION_PSEUDO_GROUPS = 10.0


@dataclass
class StreakCalibration:
    """The ``streak`` prompt scheme's table: how often a prompt's next group was informative, given how many
    all-equal groups it had had in a row (z = 1, 2, 3+; :attr:`PromptRecord.equal_streak`) and the bin of what
    the ``fitted`` posterior predicted for it, counted over this run's own groups (issue #63, item 4).

    GRESO skips a prompt more often the longer its run of all-equal groups; the posterior reads every group
    but as draws from one fixed success rate, so after a run of equal groups it stays less sure than the logs
    are (benchmarks/results/realistic-pool/streaks.json: among prompts the posterior puts below 0.2, the next
    group is all equal 0.79 of the time after one all-equal group and 0.91 after two or more). :meth:`predict`
    replaces the posterior's P(informative) p of a prompt with an all-equal streak by
    (n_informative + m p) / (n + m) of its cell (m = :data:`CALIBRATION_PSEUDO_GROUPS`): the posterior's own
    value until the run has seen enough. Every count is of groups rolled out before the step, so keep
    probabilities built on it are fixed before the step's draw and weighing by 1 / π stays exact. Only whole
    groups count (a pilot stopped after its k equal rewards says nothing of the G it stood for)."""

    counts: dict[str, list[float]] = field(default_factory=dict)  # "z:bin" -> [informative, groups]

    @staticmethod
    def cell(streak: int, p: float) -> str:
        return f"{min(streak, CALIBRATION_STREAKS)}:{int(np.searchsorted(CALIBRATION_BINS, p, side='right'))}"

    def predict(self, history: PromptHistory, prompt_ids: Sequence[str], p: torch.Tensor, *,
                step: int | None = None, max_age: int | None = None) -> torch.Tensor:
        """Each prompt's P(informative): ``p`` (the ``fitted`` posterior's, float64 of shape
        (len(prompt_ids),)) where its last group was mixed (or it is unseen, or stale), the calibrated
        estimate of its cell where that group was all equal."""
        out = p.clone()
        for i, pid in enumerate(prompt_ids):
            z = self._streak(history, pid, step, max_age)
            if z:
                informative, groups = self.counts.get(self.cell(z, float(p[i])), (0.0, 0.0))
                out[i] = ((informative + CALIBRATION_PSEUDO_GROUPS * p[i])
                          / (groups + CALIBRATION_PSEUDO_GROUPS))
        return out

    def record(self, history: PromptHistory, prompt_ids: Sequence[str], p: torch.Tensor,
               rewards: torch.Tensor, group_size: int, *, step: int | None = None,
               max_age: int | None = None) -> None:
        """Count each whole group (``rewards`` of shape (len(prompt_ids), ``group_size``)) of a prompt with an
        all-equal streak into its cell: call it before ``history`` records the groups, with the ``p`` the keep
        probabilities were built on."""
        if rewards.shape[1] != group_size:
            return
        informative = (rewards != rewards[:, :1]).any(dim=1).tolist()
        for i, pid in enumerate(prompt_ids):
            z = self._streak(history, pid, step, max_age)
            if z:
                row = self.counts.setdefault(self.cell(z, float(p[i])), [0.0, 0.0])
                row[0] += float(informative[i])
                row[1] += 1.0

    @staticmethod
    def _streak(history: PromptHistory, pid: str, step: int | None, max_age: int | None) -> int:
        rec = history.get(pid)
        if rec is None or (max_age is not None and step is not None and step - rec.step > max_age):
            return 0
        return rec.equal_streak

    def state_dict(self) -> dict[str, Any]:
        return {"counts": {k: list(v) for k, v in self.counts.items()}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StreakCalibration:
        counts = state.get("counts")
        if not isinstance(counts, dict) or not all(isinstance(v, list) and len(v) == 2
                                                   for v in counts.values()):
            raise ValueError("not a StreakCalibration state "
                             "(expected {'counts': {'z:bin': [informative, groups]}})")
        return cls({str(k): [float(v[0]), float(v[1])] for k, v in counts.items()})
