"""What each prompt's rollouts showed: :class:`PromptHistory`, the record that prompt pruning reads (the last
group's rewards and advantages, and the decayed evidence on each prompt's success rate), kept across steps and
in checkpoints.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: A fitted prior needs at least this many prompts seen; with fewer, :meth:`PromptHistory.fitted_prior` is
#: uniform.
MIN_PRIOR_GROUPS = 20


@dataclass
class PromptRecord:
    """What the last rollout of one prompt showed."""

    mean_reward: float
    reward_std: float
    mean_abs_advantage: float
    step: int
    seen: int = 1
    successes: float | None = None  # decayed evidence on the success rate, as of ``step`` (None: an old
                                    # record)
    failures: float | None = None
    size: int | None = None  # the group's rewards: G, or k for a pilot stopped after k (None: an old record,
                             # G)
    streak: int | None = None  # consecutive all-equal groups of one value ending with this one (0: it was
                               # mixed)
    outside_unit_at: int | None = None  # the step of the first group in this evidence with a reward outside
                                        # [0, 1]

    @property
    def equal_streak(self) -> int:
        """How many groups in a row, ending with the last, were all equal at the same reward (0 after a mixed
        one; a record from before streaks were kept counts its last group only)."""
        return self.streak if self.streak is not None else int(self.all_equal)

    @property
    def all_equal(self) -> bool:
        """All the group's rewards were equal (an all-equal group): it gave no learning signal (A = 0
        everywhere)."""
        return self.reward_std == 0.0

    @property
    def degenerate(self) -> bool:
        """:attr:`all_equal`'s former name (the DPPO paper's word), kept so that old code runs."""
        return self.all_equal


@functools.lru_cache(maxsize=16)
def _beta_binomial_grid(group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`PromptHistory.fitted_prior`'s grid of (a, b) and log P(k | a, b) under Beta-binomial(G, a, b),
    k = 0..G, without the binomial coefficient (constant in a, b). The same for every call with this G:
    computed once (read, never written, by the callers)."""
    grid = torch.logspace(math.log10(0.02), math.log10(50.0), 80, dtype=torch.float64)
    a, b, k = grid[:, None, None], grid[None, :, None], torch.arange(group_size + 1, dtype=torch.float64)
    log_p = (torch.lgamma(k + a) + torch.lgamma(group_size - k + b) - torch.lgamma(group_size + a + b)
             - torch.lgamma(a) - torch.lgamma(b) + torch.lgamma(a + b))
    return grid, log_p


class PromptHistory:
    """Per prompt id, the statistics of its most recent rollout group.

    ``update`` after each step's rewards; ``state_dict``/``from_state_dict`` for checkpoints (plain
    JSON-serialisable data); ``merge`` combines the histories of data-parallel ranks (the most recent
    record of each prompt wins, so every rank ends with the same history).

    Besides the last group, each record carries the evidence of every group so far on the prompt's success
    rate (``successes``, ``failures``: G x mean reward and G x (1 - mean reward), rewards clipped into
    [0, 1]), each group's evidence discounted by 2^(-age / ``half_life``) steps as the policy moves
    (``half_life`` None: no discount). :func:`~dppo_core.posterior.posterior_scores` reads it.
    """

    def __init__(self, records: dict[str, PromptRecord] | None = None, half_life: float | None = None):
        self.records: dict[str, PromptRecord] = dict(records or {})
        self.half_life = half_life

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self.records

    def get(self, prompt_id: str) -> PromptRecord | None:
        return self.records.get(prompt_id)

    def update(self, prompt_ids: Sequence[str], rewards: torch.Tensor, advantages: torch.Tensor, step: int,
               max_age: int | None = None) -> None:
        """Record each prompt's group: ``rewards`` and ``advantages`` have shape (len(prompt_ids), G).

        ``max_age``: a record last updated more than this many steps ago is stale (read as unseen by
        :meth:`score` and :func:`~dppo_core.posterior.posterior_scores`), so its evidence is dropped and the
        new group starts afresh.
        """
        rewards = torch.as_tensor(rewards, dtype=torch.float64)
        advantages = torch.as_tensor(advantages, dtype=torch.float64)
        if rewards.ndim != 2 or rewards.shape[0] != len(prompt_ids) or advantages.shape != rewards.shape:
            raise ValueError(f"rewards {tuple(rewards.shape)} and advantages {tuple(advantages.shape)} must "
                             f"both have shape ({len(prompt_ids)}, G), one row per prompt id")
        # which groups had a reward outside [0, 1] (the posterior's evidence clips it: check_pass_rates
        # refuses it)
        outside_rows = ((rewards < -1e-9) | (rewards > 1 + 1e-9)).any(dim=1).tolist()
        for pid, r, a, out_of_range in zip(prompt_ids, rewards, advantages, outside_rows, strict=True):
            prev = self.records.get(pid)
            stale = prev is not None and max_age is not None and step - prev.step > max_age
            s_prev, f_prev = (0.0, 0.0) if stale else self.evidence(pid, step)
            mean, std = float(r.mean()), float(r.std(unbiased=False))
            hits = r.numel() * min(1.0, max(0.0, mean))
            same = prev is not None and not stale and prev.all_equal and prev.mean_reward == mean
            outside = prev.outside_unit_at if prev is not None and not stale else None
            if outside is None and out_of_range:
                outside = int(step)
            streak = 0 if std != 0.0 else (prev.equal_streak + 1 if same and prev is not None else 1)
            self.records[pid] = PromptRecord(
                mean_reward=mean, reward_std=std, streak=streak, outside_unit_at=outside,
                mean_abs_advantage=float(a.abs().mean()), step=int(step), seen=(prev.seen + 1) if prev else 1,
                successes=s_prev + hits, failures=f_prev + r.numel() - hits, size=r.numel())

    def evidence(self, prompt_id: str, step: int | None = None) -> tuple[float, float]:
        """(successes, failures) seen for the prompt, discounted to ``step`` (0, 0 if unseen)."""
        rec = self.records.get(prompt_id)
        if rec is None:
            return 0.0, 0.0
        if rec.successes is None or rec.failures is None:  # a record from before the evidence was kept
            return min(1.0, max(0.0, rec.mean_reward)), 1.0 - min(1.0, max(0.0, rec.mean_reward))
        decay = 1.0
        if self.half_life is not None and step is not None and step > rec.step:
            decay = 0.5 ** ((step - rec.step) / self.half_life)
        return rec.successes * decay, rec.failures * decay

    def score(self, prompt_id: str, step: int | None = None, max_age: int | None = None) -> float | None:
        """The prompt's expected learning signal (its last mean |A|), or None if unseen or too old."""
        rec = self.records.get(prompt_id)
        if rec is None or (max_age is not None and step is not None and step - rec.step > max_age):
            return None
        return rec.mean_abs_advantage

    def pass_counts(self, group_size: int) -> torch.Tensor:
        """How many prompts' last groups of ``group_size`` rewards had k = 0..G passes (G x the mean reward,
        rounded; rewards in [0, 1]); records of another size (a stopped pilot's k) are
        :meth:`pass_count_table`'s."""
        return self.pass_count_table(group_size).get(group_size,
                                                     torch.zeros(group_size + 1, dtype=torch.float64))

    def pass_count_table(self, group_size: int) -> dict[int, torch.Tensor]:
        """Per group size n, how many prompts' last groups of n rewards had 0..n passes: n is G for a whole
        group (and for a record written before the size was kept), k for a pilot stopped after its k equal
        rewards, which is k trials' evidence, not G's."""
        by_size: dict[int, list[int]] = {}
        for r in self.records.values():
            n = r.size or group_size
            by_size.setdefault(n, []).append(round(n * min(1.0, max(0.0, r.mean_reward))))
        return {n: torch.bincount(torch.tensor(ks, dtype=torch.long),
                                  minlength=n + 1)[: n + 1].to(torch.float64)
                for n, ks in sorted(by_size.items())}

    def fitted_prior(self, group_size: int) -> tuple[float, float]:
        """A Beta(a, b) prior on a prompt's success rate fitted to the pool: the maximum marginal likelihood
        (Beta-binomial) of every seen prompt's last pass count out of its group's size
        (:meth:`pass_count_table`: G, or k for a stopped pilot), on a log grid over a, b in [0.02, 50]
        (empirical Bayes). Real pools are J- or U-shaped (many prompts solved always or never), which a
        uniform prior cannot say: after one 8/8 group Beta(1, 1) still puts P(the next group is mixed) at
        0.47, where a pool like that has about 0.2. Uniform (1, 1) while fewer than :data:`MIN_PRIOR_GROUPS`
        prompts have been seen. The fit reads only groups already rolled out, so a keep probability built on
        it is still fixed before the step's draw."""
        table = self.pass_count_table(group_size)
        if sum(float(c.sum()) for c in table.values()) < MIN_PRIOR_GROUPS:
            return 1.0, 1.0
        total = None
        for n, counts in table.items():
            grid, log_p = _beta_binomial_grid(n)
            ll = (log_p * counts).sum(-1)
            total = ll if total is None else total + ll
        assert total is not None
        i, j = divmod(int(total.argmax()), grid.numel())
        return float(grid[i]), float(grid[j])

    def all_equal_fraction(self) -> float:
        """The share of the prompts seen whose last group was all equal."""
        return sum(r.all_equal for r in self.records.values()) / max(1, len(self.records))

    def degenerate_fraction(self) -> float:
        """:meth:`all_equal_fraction`'s former name, kept so that old code runs."""
        return self.all_equal_fraction()

    def state_dict(self) -> dict[str, Any]:
        return {"records": {k: asdict(v) for k, v in self.records.items()}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], half_life: float | None = None) -> PromptHistory:
        try:
            return cls({k: PromptRecord(**v) for k, v in state["records"].items()}, half_life=half_life)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a PromptHistory state (expected {{'records': {{id: record}}}}): "
                             f"{exc}") from exc

    @classmethod
    def merge(cls, histories: Iterable[PromptHistory]) -> PromptHistory:
        """One history from several (e.g. one per data-parallel rank): per prompt, the latest record wins.

        Ties on the step (two ranks rolled the same prompt out in one step) keep the record with more
        sightings, then the larger mean |A|, so the result does not depend on the ranks' order.
        """
        out: dict[str, PromptRecord] = {}
        half_life = None
        for h in histories:
            half_life = h.half_life if half_life is None else half_life
            for pid, rec in h.records.items():
                cur = out.get(pid)
                if cur is None or ((rec.step, rec.seen, rec.mean_abs_advantage)
                                   > (cur.step, cur.seen, cur.mean_abs_advantage)):
                    out[pid] = rec
        return cls(out, half_life=half_life)
