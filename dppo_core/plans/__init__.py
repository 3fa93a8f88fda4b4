"""Rollout plans: how a step turns its prompts into rolled-out, rewarded groups.

:meth:`dppo_core.trainer.DPPOTrainer.train_step` asks its plan (``trainer.plan``, built once from the config's
``rollout_plan``, :func:`make_plan`) for two things, and does the rest (advantages, weights, update) itself::

    selection = plan.select(trainer, step)           # which prompts (default: the estimator's draw)
    out = plan.roll_out(trainer, selection, timer)   # -> RolledOut: the groups to train, rewarded

The plans (each declared in :data:`dppo_core.registry.ROLLOUT_PLANS`, with what it reads and where it runs):

- :class:`Plain`: G completions for each selected prompt in one engine call, this rank its contiguous share.
- :class:`~dppo_core.plans.pilot.Pilot`: k completions first, the continue draw, the rest of the continued
  groups.
- :class:`~dppo_core.plans.dynamic_sampling.DynamicSampling`: DAPO's refill until enough groups are
  informative.
- :class:`~dppo_core.plans.offline_filter.OfflineFilter`: the pool filtered once before the first step, then
  plain.

A plan reads the trainer, never subclasses it: it calls :meth:`~dppo_core.trainer.DPPOTrainer.generate` (one
engine call, the step's random stream), :meth:`~dppo_core.trainer.DPPOTrainer.score` (the reward functions)
and the estimator. A new plan is one module here plus its entry in the registry (``target``:
``module:Class``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

from dppo_core.data import PromptSource
from dppo_core.distributed import DistInfo, gather_groups, shard
from dppo_core.estimator import Estimator, Selection
from dppo_core.registry import ROLLOUT_PLANS
from dppo_core.rollout import RolloutBatch

if TYPE_CHECKING:
    from dppo_core.run import PhaseTimer


@dataclass
class PromptSelection(Selection):
    """A :class:`~dppo_core.estimator.Selection` with the kept prompts' rows, as sent to the rollout
    engine."""

    rows: list[dict[str, Any]] = field(default_factory=list)


class Trainer(Protocol):
    """What a plan reads and calls of the trainer (:class:`~dppo_core.trainer.DPPOTrainer` is one)."""

    config: Any  # the run's DPPOConfig
    step: int  # the steps done (the step being taken is step + 1)
    dist: DistInfo
    estimator: Estimator  # the prompt history, the draws
    prompts: PromptSource  # the pool the steps' candidates are drawn from

    def select_prompts(self, step: int) -> PromptSelection: ...

    def generate(self, step: int, rows: list[dict[str, Any]], n: int | None = None, call: int = 0
                 ) -> RolloutBatch: ...

    def score(self, rows: list[dict[str, Any]], batch: RolloutBatch, means: dict[str, float] | None = None,
              parts: dict[str, torch.Tensor] | None = None) -> torch.Tensor: ...

    def log(self, record: dict[str, Any]) -> None: ...


class StoppedGroups(NamedTuple):
    """Groups rolled out but not trained on (a pilot's stopped ones): logged in ``groups.jsonl`` under
    ``"stopped"``."""

    ids: list[str]
    probs: torch.Tensor  # (S,) their π_q
    rewards: torch.Tensor  # (S, k)
    lengths: torch.Tensor  # (S, k)


@dataclass
class RolloutCounts:
    """What a step rolled out, where a plan rolls out more than the groups it hands on to train (a pilot's
    stopped groups, a refill's rounds): the step's line counts these instead of the trained groups."""

    prompts_rolled_out: int
    completions: int  # completions generated (a stopped pilot's k included)
    tokens: int  # completion tokens generated
    #: the candidates the step drew from, where not the selection's window
    prompts_candidates: int | None = None
    #: (R, G) every rolled-out group's rewards, which the line's reward statistics are over (None: the trained
    #: ones)
    rewards: torch.Tensor | None = None
    #: the rollout tokens the pruned prompts would have cost, where the plan knows
    tokens_saved_est: int | None = None


@dataclass
class RolledOut:
    """What a plan hands the rest of the step: the groups to train, rewarded, and what the plan measured."""

    #: the trained groups' prompts and inclusion probabilities (π_q; π_q c_q after a pilot)
    selection: PromptSelection
    offset: int  # the position of this rank's first group among every rank's
    batch: RolloutBatch  # this rank's groups, G completions each
    rewards: torch.Tensor  # (P, G): every rank's groups
    lengths: list[int]  # every rank's completions' token counts, P·G in group order
    means: dict[str, float]  # the mean of each reward function
    #: what the step rolled out, where it is more than the groups above (None: those groups are all of it)
    counts: RolloutCounts | None = None
    #: the plan's own keys of the step's line (:data:`dppo_core.metrics.PLAN_KEYS`; never a key of ``STEP``)
    plan_stats: dict[str, Any] = field(default_factory=dict)
    stopped: StoppedGroups | None = None  # a pilot's stopped groups
    #: the step's ``groups.jsonl`` line when the plan writes its own (every group it rolled out, trained or
    #: not)
    group_line: dict[str, Any] | None = None
    #: a step that trains none of the groups is logged ``skipped`` (not by a plan that paid for groups it
    #: dropped by its own rule, as dynamic sampling's no-signal steps: their time is a step's like any other)
    mark_skipped: bool = True


class Generated(NamedTuple):
    """One engine call's groups, rewarded: this rank's batch, every rank's rewards (P, n), lengths and
    means."""

    batch: RolloutBatch
    rewards: torch.Tensor
    lengths: list[int]
    means: dict[str, float]


def generate_scored(trainer: Trainer, rows: list[dict[str, Any]], n: int, call: int, timer: PhaseTimer
                    ) -> Generated:
    """``n`` completions for each of this rank's ``rows`` (engine call ``call`` of the step), rewarded; every
    rank then holds every rank's rewards, lengths and means. Laps ``rollout`` and ``reward`` on ``timer``."""
    batch = trainer.generate(trainer.step, rows, n, call) if rows else RolloutBatch([])
    timer.lap("rollout")
    means: dict[str, float] = {}
    rewards = trainer.score(rows, batch, means) if rows else torch.zeros(0, n)
    lengths = [comp.length for g in batch.groups for comp in g.completions]
    rewards, lengths, means = gather_groups(rewards, lengths, means, trainer.dist)
    timer.lap("reward")
    return Generated(batch, rewards, lengths, means)


def single_process(trainer: Trainer, name: str) -> None:
    """Refuse data parallelism for plan ``name`` where its registry entry declares it runs on one process."""
    if trainer.dist.world_size > 1 and not ROLLOUT_PLANS[name].data_parallel:
        raise RuntimeError(f"the rollout plan {name} runs on one process; launch it without torchrun")


class RolloutPlan:
    """The plain plan's interface: :meth:`select`, then :meth:`roll_out`; :meth:`prepare` before each step."""

    name: ClassVar[str] = "plain"

    def __init__(self, config: Any):
        self.config = config

    def prepare(self, trainer: Trainer) -> None:
        """Before each step, outside its timer (the offline filter's pass over the pool): nothing here."""

    def select(self, trainer: Trainer, step: int) -> PromptSelection:
        """The step's prompts: the estimator's draw over the step's candidates."""
        return trainer.select_prompts(step)

    def roll_out(self, trainer: Trainer, selection: PromptSelection, timer: PhaseTimer) -> RolledOut:
        """G completions for each selected prompt (this rank its contiguous share), rewarded."""
        mine = shard(len(selection.rows), trainer.dist)
        out = generate_scored(trainer, selection.rows[mine.start:mine.stop], self.config.num_generations, 0,
                              timer)
        return RolledOut(selection, mine.start, out.batch, out.rewards, out.lengths, out.means)


class Plain(RolloutPlan):
    """G completions for each selected prompt, in one engine call."""


def plan_class(name: str) -> type[RolloutPlan]:
    """The class registered as rollout plan ``name`` (:data:`dppo_core.registry.ROLLOUT_PLANS`)."""
    try:
        module, _, cls = ROLLOUT_PLANS[name].target.partition(":")
    except KeyError:
        raise ValueError(f"rollout_plan={name!r}: choose one of auto, {', '.join(ROLLOUT_PLANS)}") from None
    return getattr(importlib.import_module(module), cls)


def make_plan(config: Any) -> RolloutPlan:
    """The rollout plan of ``config`` (its ``plan``: ``rollout_plan`` with ``auto`` resolved)."""
    return plan_class(config.plan)(config)
