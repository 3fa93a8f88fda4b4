"""Pilot, then continue (``pilot_size`` k > 0): roll out k completions for every kept prompt, reward them,
draw which groups continue (:meth:`dppo_core.estimator.DPPOEstimator.continue_groups`: every group whose
pilot's rewards differ, each other one with probability c_q), roll out and reward the rest of the continued
groups in a second engine call, then :func:`join` pilot and rest, so that a continued group's advantages,
weights and loss are those of one group of G. A stopped group's pilot is recorded in the prompt history and
the group log, generated but not trained on. Why it is exact: docs/estimator.md ("Pilot, then continue").

``pilot_size`` is read here and nowhere else after the config's checks: the estimator's continue draw is asked
only by this plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dppo_core.data import prompt_key
from dppo_core.distributed import from_main, shard
from dppo_core.estimator import Continuation
from dppo_core.grpo import group_advantages
from dppo_core.plans import (
    PromptSelection,
    RolledOut,
    RolloutCounts,
    RolloutPlan,
    StoppedGroups,
    Trainer,
    generate_scored,
)
from dppo_core.rollout import RolloutBatch, RolloutGroup

if TYPE_CHECKING:
    from dppo_core.run import PhaseTimer


def join(pilot: torch.Tensor, rest: torch.Tensor, continued: Sequence[int]) -> torch.Tensor:
    """The continued groups' (P', G) rows: each continued group's pilot row (of ``pilot``, (P, k)) followed by
    its row of ``rest`` ((P', G - k), in the order of ``continued``). The pilot's rewards are the group's too:
    the group's advantages are over all G."""
    return torch.cat([pilot[list(continued)], rest], dim=1)


def join_batches(pilot: RolloutBatch, rest: RolloutBatch, continued: Sequence[int]) -> RolloutBatch:
    """The continued groups of ``pilot`` (positions ``continued``), each with its completions of ``rest``
    after its pilot's."""
    groups = [pilot.groups[j] for j in continued]
    if len(groups) != len(rest.groups):
        raise ValueError(f"{len(groups)} continued groups but {len(rest.groups)} groups rolled out after the "
                         "pilot")
    return RolloutBatch([RolloutGroup(p.prompt, p.prompt_ids, p.completions + r.completions)
                         for p, r in zip(groups, rest.groups, strict=True)])


def join_means(first: dict[str, float], n_first: int, second: dict[str, float], n_second: int) -> dict[str,
                                                                                                       float]:
    """The mean of each reward function over both rounds' completions (``n_first`` and ``n_second`` of
    them)."""
    total = max(1, n_first + n_second)
    return {k: (first.get(k, 0.0) * n_first + second.get(k, 0.0) * n_second) / total for k in {*first,
                                                                                               *second}}


class Pilot(RolloutPlan):
    """k of each group's G first, the continue draw, the rest of the continued groups (module docstring)."""

    name: ClassVar[str] = "pilot"

    def __init__(self, config: Any):
        super().__init__(config)
        self.size = config.pilot_size  # k
        if not 0 < self.size < config.num_generations:
            raise ValueError(f"pilot_size={self.size!r}: the pilot plan rolls out 1 to num_generations - 1 "
                             f"(= {config.num_generations - 1}) completions first; set pilot_size, or "
                             "rollout_plan auto")

    def continue_groups(self, trainer: Trainer, selection: PromptSelection, pilot_rewards: torch.Tensor,
                        step: int, observe: bool = True) -> tuple[PromptSelection, Continuation]:
        """After the pilot (rewards (P, k) of the selection's groups): the estimator's continue draw (rank
        0's), and the continued groups as a selection whose probabilities are π_q c_q. ``observe``: the
        stopped groups' pilots go into the history (after the draw, which reads the history as it was before
        the step)."""
        ids = [prompt_key(r) for r in selection.rows]
        cont = from_main(trainer.estimator.continue_groups(ids, pilot_rewards, step), trainer.dist)
        if observe and cont.stopped:
            r = pilot_rewards[cont.stopped]
            trainer.estimator.observe([ids[j] for j in cont.stopped], r,
                                      group_advantages(r, trainer.config.scale_rewards), step)
        sel = cont.applied(selection)
        return PromptSelection(sel.indices, sel.probs, sel.window,
                               [selection.rows[j] for j in cont.positions]), cont

    def roll_out(self, trainer: Trainer, selection: PromptSelection, timer: PhaseTimer) -> RolledOut:
        g, k = self.config.num_generations, self.size
        mine = shard(len(selection.rows), trainer.dist)
        rows = selection.rows[mine.start:mine.stop]
        first = generate_scored(trainer, rows, k, 0, timer)
        continued, cont = self.continue_groups(trainer, selection, first.rewards, trainer.step)
        timer.lap("prune")
        mine_cont = [j - mine.start for j in cont.positions if j in mine]
        rest = generate_scored(trainer, [rows[j] for j in mine_cont], g - k, 1, timer)
        pilot_lens = torch.tensor(first.lengths).view(first.rewards.shape)
        joined = join(pilot_lens, torch.tensor(rest.lengths).view(rest.rewards.shape), cont.positions)
        generated = sum(first.lengths) + sum(rest.lengths)
        done = len(first.lengths) + len(rest.lengths)  # the stopped pilots' completions too
        counts = RolloutCounts(len(selection.rows), done, generated,
                               tokens_saved_est=round(selection.window * g * generated / done) - generated)
        stats = {"pilot_groups_stopped": len(cont.stopped), "pilot_tokens": sum(first.lengths),
                 "decode_steps": max(first.lengths, default=0) + max(rest.lengths, default=0)}
        stopped = StoppedGroups([prompt_key(selection.rows[j]) for j in cont.stopped],
                                selection.probs[cont.stopped],
                                first.rewards[cont.stopped], pilot_lens[cont.stopped])
        return RolledOut(continued, offset=sum(1 for j in cont.positions if j < mine.start),
                         batch=join_batches(first.batch, rest.batch, mine_cont),
                         rewards=join(first.rewards, rest.rewards, cont.positions),
                         lengths=joined.flatten().tolist(),
                         means=join_means(first.means, first.rewards.numel(), rest.means,
                                          rest.rewards.numel()),
                         counts=counts, plan_stats=stats, stopped=stopped)
