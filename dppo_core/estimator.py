"""The pruned-batch estimator: which prompts to roll out, which completions to train on, and with what weight.

One class per selection mode, each with the same small interface, so any GRPO loop (ours, TRL's, verl's,
a hand-written one) can call it with plain lists and tensors; no trainer, model or engine inside:

    est = make_estimator(config)                       # or e.g. DPPOEstimator(prompt_prune_rate=0.5, ...)
    ids = draw(est.num_candidates(k))                  # candidate prompt ids for the step (k wanted)
    sel = est.select(ids, step, size=k)                # before rollout: kept positions, keep probs, |B|
    ... roll out ids[i] for i in sel.indices (G each), reward, advantages A over whole groups ...
    (a pilot, dppo_core.plans.pilot: roll out k each and reward them, then
     cont = est.continue_groups(ids_rolled_out, R_pilot, step)   # which groups get the rest, and c_q
     roll out the rest (G - k) of the groups in cont.keep; sel = cont.applied(sel): π_q c_q)
    w = est.weigh(A, sel, step)                        # after reward: keep mask, weights, normaliser C
                                                       # (pods: rewards=R, and train on w.advantages)
    loss = sum over kept (q, i) of w.weights[q, i] * l_qi(theta), divided by w.num_sequences
    est.observe([ids[i] for i in sel.indices], rewards, A, step)     # the history prompt pruning reads
    est.state_dict() / est.load_state_dict(state)      # checkpoint it with the optimizer

The estimator (the full-batch GRPO loss over the candidate window B, and what ``dppo`` trains on):

    L(θ) = (1/C) Σ_{q∈B} Σ_{i=1..G} ℓ_{q,i}(θ)          L̂(θ) = (1/C) Σ_{kept} ℓ_{q,i}(θ) / (π_q p_{q,i})

with C = |B|·G fixed before the draw. Keep probabilities π_q (prompts, from history) and p_{q,i} (completions,
from |A|) come from :mod:`dppo_core.pruning` (with a pilot, :mod:`dppo_core.plans.pilot`, π_q is multiplied by
c_q, the probability that the group was continued after its first k completions:
:func:`dppo_core.posterior.continue_probs`, 1 where the pilot's rewards differ) (the baselines' rules from
:mod:`dppo_core.biased_baselines`); E[L̂(θ)] = L(θ) for every θ fixed before the draw, so the loss and its
gradient at the step's parameters are unbiased, for ℓ with the ``grpo`` or ``dr_grpo`` normaliser (``dapo``
under completion pruning only) and advantages scaled per group or not at all (batch-wide only without prompt
pruning); docs/estimator.md has the proof. That is all: the optimizer's update is not an unbiased estimate of
the full-batch update (AdamW is not linear, gradient-norm clipping shrinks heavy-weight draws), and from a
second PPO epoch on θ depends on the draw.

Modes (``ESTIMATORS``, chosen once by name): ``none`` (plain GRPO: everything, weight 1), ``dppo``
(random pruning with importance weights; unbiased as above), and the BIASED baselines ``cppo`` (top-k
completions by |A|, no weights, normalised by the number kept), ``greso`` (skip prompts whose last
group was all-equal, no weights) and ``pods`` (the completions whose rewards vary most, no weights).
Not to be confused with Divergence PPO (arXiv 2602.04879), which TRL and verl also call "DPPO".
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch

from dppo_core import biased_baselines, posterior, pruning, registry
from dppo_core.grpo import group_advantages
from dppo_core.history import PromptHistory


@dataclass
class Selection:
    """The prompts a step rolls out: positions in the candidate window and their keep probabilities π_q."""

    indices: list[int]  # position of each kept prompt in the window, ascending
    probs: torch.Tensor  # (len(indices),) float64 π_q of each kept prompt
    window: int  # |B|: the candidate prompts the step's objective is over (kept or not)

    @property
    def num_pruned(self) -> int:
        return self.window - len(self.indices)


@dataclass
class Weighting:
    """What a step trains on: a keep mask and weights over the rolled-out (P, G) completions, and C."""

    keep: torch.Tensor  # (P, G) bool
    weights: torch.Tensor  # (P, G) float64: 1 / (π_q p_qi) where kept (DPPO), 1 for the others; 0 where
                           # dropped
    num_sequences: int  # the normaliser C of the grpo / dr_grpo losses: |B|·G (dppo), P·G (none, greso), kept
                        # (cppo)
    advantages: torch.Tensor | None = None  # (P, G) replaces the step's advantages where kept (pods); None:
                                            # keep them


@dataclass
class Continuation:
    """After a pilot: which rolled-out groups get the rest of their completions, and the probability c_q of
    that."""

    keep: torch.Tensor  # (P,) bool
    probs: torch.Tensor  # (P,) float64 c_q: 1 where the pilot's rewards are not all equal

    @property
    def positions(self) -> list[int]:
        """The continued groups' positions among the rolled-out ones, ascending."""
        return self.keep.nonzero().flatten().tolist()

    @property
    def stopped(self) -> list[int]:
        """The stopped groups' positions (their pilot all equal, and the draw said stop), ascending."""
        return (~self.keep).nonzero().flatten().tolist()

    def applied(self, selection: Selection) -> Selection:
        """The continued groups as a :class:`Selection`: their window positions, with inclusion probabilities
        π_q c_q (the weights 1 / (π_q c_q p_qi) then follow from :meth:`Estimator.weigh`), over the same
        window."""
        kept = self.positions
        return Selection([selection.indices[j] for j in kept], selection.probs[kept] * self.probs[kept],
                         selection.window)


def full_selection(size: int) -> Selection:
    """Every one of ``size`` candidates kept with probability 1."""
    return Selection(list(range(size)), torch.ones(size, dtype=torch.float64), size)


#: An estimator setting whose :class:`~dppo_core.config.DPPOConfig` field has another name.
CONFIG_NAMES = {"group_size": "num_generations"}


@dataclass(kw_only=True)
class Estimator:
    """``none``: plain GRPO, every prompt and completion, weight 1, normaliser P·G.

    Subclasses override :meth:`prompt_probs` (prompt pruning, before rollout) and/or
    :meth:`weigh` (completion pruning, after reward). Every mode keeps the prompt history (it costs
    nothing and lets a run switch modes on resume).
    """

    name: ClassVar[str] = "none"
    #: ``weigh`` reads the step's rewards (``rewards=``); the trainer passes them only to such an estimator,
    #: so a subclass that overrides ``weigh(advantages, selection, step)`` keeps working
    needs_rewards: ClassVar[bool] = False
    seed: int = 0  # the pruning draws of step s are a function of (seed, s) only: resumable
    history_max_age: int | None = None  # forget a prompt's history after this many steps (then: unseen)
    history: PromptHistory = field(default_factory=PromptHistory)
    #: the rollout plan of the config this estimator was built from (dppo_core.registry.ROLLOUT_PLANS): the
    #: TRL and verl adapters, whose rollouts are their own, refuse one they cannot run (a pilot, dynamic
    #: sampling)
    rollout_plan: str = field(default="plain", init=False)

    @property
    def needs_lengths(self) -> bool:
        """``weigh`` needs the completions' token counts (``lengths=``, shape (P, G)): no mode here."""
        return False

    def drops_zero_advantage(self) -> bool:
        """Whether ``weigh`` gives a completion with A = 0 keep probability 0, which is exact only where its
        loss is 0 for every θ (no KL term): an adapter whose own loss has a KL term refuses it."""
        return False

    def group_size_read(self) -> int | None:
        """The G a prompt scheme that reads pass counts predicts each prompt's next group with (it must be
        the G rolled out), or None where the prompt stage reads no counts."""
        return None

    @classmethod
    def from_config(cls, config: Any) -> Estimator:
        """Built from a :class:`~dppo_core.config.DPPOConfig` (or anything with its field names and its
        ``plan``): each of this estimator's settings is the config field of the same name (``group_size`` is
        ``num_generations``); :attr:`rollout_plan` is the config's ``plan``."""
        settings = [f.name for f in fields(cls) if f.init and f.name != "history"]
        est = cls(**{name: getattr(config, CONFIG_NAMES.get(name, name)) for name in settings})
        est.rollout_plan = config.plan
        return est

    # --- before rollout ---------------------------------------------------------------------------
    def num_candidates(self, size: int) -> int:
        """How many candidate prompts to draw for a step that wants ``size`` (more for dense prompts)."""
        return size

    def select(self, candidate_ids: list[str], step: int, size: int | None = None) -> Selection:
        """Which candidates to roll out. ``size``: the prompts per step wanted (default: every candidate)."""
        return full_selection(len(candidate_ids) if size is None else min(size, len(candidate_ids)))

    # --- after a pilot (the pilot plan, dppo_core.plans.pilot, asks) -----------------------------------
    def continue_groups(self, prompt_ids: list[str], pilot_rewards: torch.Tensor, step: int) -> Continuation:
        """Which groups, given their pilot's rewards (P, k), get the rest of their completions: all of them
        here."""
        n = len(prompt_ids)
        return Continuation(torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.float64))

    # --- after reward -----------------------------------------------------------------------------
    def weigh(self, advantages: torch.Tensor, selection: Selection | None = None, step: int = 0,
              rewards: torch.Tensor | None = None) -> Weighting:
        """Keep mask, weights and normaliser for the (P, G) advantages of the rolled-out groups (``rewards``,
        of the same shape, only for a mode that reads them: ``pods``)."""
        p, g = advantages.shape
        return Weighting(torch.ones(p, g, dtype=torch.bool), torch.ones(p, g, dtype=torch.float64), p * g)

    # --- history ----------------------------------------------------------------------------------
    def observe(self, prompt_ids: list[str], rewards: torch.Tensor, advantages: torch.Tensor,
                step: int) -> None:
        """Record what each rolled-out prompt's group showed (rewards and advantages of shape (P, G))."""
        self.history.update(prompt_ids, rewards, advantages, step, max_age=self.history_max_age)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable state (the history's records, and the mode that wrote them)."""
        return {"mode": self.name, **self.history.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the history (raises ValueError, changing nothing, if ``state`` is not one)."""
        self.history = PromptHistory.from_state_dict(state, half_life=self.history.half_life)
        mode = state.get("mode")
        if mode is not None and mode != self.name:
            warnings.warn(f"the prompt history was written by a {mode!r} estimator and is loaded into a "
                          f"{self.name!r} one: its records are used as they are", stacklevel=2)


@dataclass(kw_only=True)
class PromptPruning(Estimator):
    """Shared by the modes that prune prompts before rollout: a history-based π_q and an inclusion draw."""

    prompt_prune_rate: float = 0.0
    fixed_size_sampling: bool = False  # a fixed-size design: the same π, a constant count kept
    fixed_size_design: str = "systematic"  # which one (config.FIXED_SIZE_DESIGNS); sorted by π for prompts
    dense_prompts: bool = False  # look ahead until ``size`` prompts are expected to be kept
    prompt_window_factor: int = 4  # at most this many times ``size`` candidates ahead

    def prompt_probs(self, ids: list[str], step: int, budget: float | None = None) -> torch.Tensor:
        raise NotImplementedError

    def prunes_prompts(self) -> bool:
        """Whether ``select`` can leave a candidate out (a prompt rate above 0, or a rule of its own)."""
        return self.prompt_prune_rate > 0

    def num_candidates(self, size: int) -> int:
        dense = self.dense_prompts and self.prunes_prompts()
        return size * self.prompt_window_factor if dense else size

    def select(self, candidate_ids: list[str], step: int, size: int | None = None) -> Selection:
        dense = size is not None and self.dense_prompts
        size = len(candidate_ids) if size is None else size
        if not self.prunes_prompts():
            return full_selection(min(size, len(candidate_ids)))
        ids = list(candidate_ids) if dense else list(candidate_ids[:size])
        probs = self.prompt_probs(ids, step)
        window = len(ids)
        if dense:
            window = pruning.dense_window(probs, size)
            probs = self.prompt_probs(ids[:window], step, budget=size)
        keep = pruning.sample_keep(probs, pruning.step_generator(self.seed, step, "prompts"),
                                   self.fixed_size_sampling, design=self.fixed_size_design, order_key=probs)
        kept = keep.nonzero().flatten().tolist()
        return Selection(kept, probs[kept], window)


@dataclass(kw_only=True)
class DPPOEstimator(PromptPruning):
    """``dppo``: random prompt and completion pruning, each kept item weighted 1 / (π_q p_qi); C = |B|·G.

    Departures from the paper (Algorithm 1), and why:
    1. Items are kept by random draws with known probabilities (Bernoulli or systematic PPS), not by a
       deterministic count: the unbiasedness proof needs random inclusion.
    2. Keep probabilities have floors (``min_*_keep_prob``): every item with a non-zero loss can be kept.
    3. ``proportional`` completion scheme by default (p ∝ |A|: for independent draws and a budget on the
       expected count, variance-minimising when a completion's gradient size is proportional to |A|); the
       paper's rule is ``completion_scheme="paper"``; ``"length"`` (p ∝ |A| / len^γ under a token budget)
       needs the completions' lengths: ``weigh(A, selection, step, lengths=L)`` (``needs_lengths``).
    4. ``prompt_scheme="posterior"`` scores prompts by a Beta-binomial posterior over their whole history
       (discounted with ``posterior_half_life`` steps) instead of the last group's mean |A|.
    5. Not in the paper: a pilot (the ``pilot`` rollout plan, :mod:`dppo_core.plans.pilot`) rolls out k
       completions per kept prompt first; a group whose pilot is all equal is continued with probability c_q
       (:meth:`continue_groups`) and weighted 1 / c_q.
    """

    name: ClassVar[str] = "dppo"
    completion_prune_rate: float = 0.0
    prompt_scheme: str = "paper"
    completion_scheme: str = "proportional"
    min_prompt_keep_prob: float = 0.1
    min_completion_keep_prob: float = 0.1
    drop_zero_advantage: bool = True  # with beta = 0, completions with A = 0 (loss ≡ 0) get p = 0
    beta: float = 0.0  # the KL weight: with beta > 0 a completion with A = 0 still has a loss
    group_size: int = 8  # G, for the posterior prompt scheme's prediction of the next group
    scale_rewards: str = "group"  # the advantages' scaling, for the same
    posterior_half_life: float | None = 20.0  # steps after which a group's evidence counts half (None: never)
    length_exponent: float = 0.5  # γ of the ``length`` completion scheme
    completion_target_ess: float | None = None  # adapt the completion rate per step (at most the rate above)
    continue_probability: float = 0.25  # c: an all-equal pilot's continue probability (posterior: the least)
    continue_scheme: str = "constant"  # or "posterior" (dppo_core.posterior.continue_probs)
    #: the ``streak`` prompt scheme's counts (:class:`~dppo_core.posterior.StreakCalibration`), checkpointed
    calibration: posterior.StreakCalibration = field(default_factory=posterior.StreakCalibration, init=False)

    def __post_init__(self) -> None:
        self.history.half_life = self.posterior_half_life

    def drops_zero_advantage(self) -> bool:
        return self.drop_zero_advantage and self.beta == 0

    def group_size_read(self) -> int | None:
        return self.group_size if "pass_counts" in registry.PROMPT_SCHEMES[self.prompt_scheme].reads else None

    def __setattr__(self, name: str, value: Any) -> None:
        # the history's evidence is discounted with this estimator's half-life, whichever history it is handed
        # (est.history = ..., trainer.history = ..., a checkpoint): a swapped-in history cannot silently stop
        # decaying
        if name == "history" and isinstance(value, PromptHistory) and "posterior_half_life" in self.__dict__:
            value.half_life = self.posterior_half_life
        elif name == "posterior_half_life" and "history" in self.__dict__:
            self.history.half_life = value
        super().__setattr__(name, value)

    @property
    def needs_lengths(self) -> bool:
        """``weigh`` needs the completions' token counts (``lengths=``): the ``length`` completion scheme."""
        return self.completion_scheme == "length" and self.completion_prune_rate > 0

    def prompt_probs(self, ids: list[str], step: int, budget: float | None = None) -> torch.Tensor:
        return pruning.prompt_keep_probs(self.history, ids, self.prompt_prune_rate, scheme=self.prompt_scheme,
                                         min_keep_prob=self.min_prompt_keep_prob, step=step,
                                         max_age=self.history_max_age, budget=budget,
                                         group_size=self.group_size, scale_rewards=self.scale_rewards,
                                         calibration=self.calibration)

    def observe(self, prompt_ids: list[str], rewards: torch.Tensor, advantages: torch.Tensor,
                step: int) -> None:
        # ``streak``: count each group into the calibration as the history before it predicted it, then record
        # it
        if registry.PROMPT_SCHEMES[self.prompt_scheme].calibrated and len(prompt_ids):
            p = posterior.fitted_informative(self.history, prompt_ids, self.group_size, step=step,
                                             max_age=self.history_max_age)
            self.calibration.record(self.history, prompt_ids, p,
                                    torch.as_tensor(rewards, dtype=torch.float64), self.group_size, step=step,
                                    max_age=self.history_max_age)
        super().observe(prompt_ids, rewards, advantages, step)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "calibration": self.calibration.state_dict()} if self.calibration.counts else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        calibration = posterior.StreakCalibration.from_state_dict(state.get("calibration", {"counts": {}}))
        super().load_state_dict(state)
        self.calibration = calibration

    def continue_probs(self, prompt_ids: list[str], pilot_rewards: torch.Tensor, step: int) -> torch.Tensor:
        """c_q of each group after its pilot (:func:`dppo_core.posterior.continue_probs`), shape (P,)."""
        return posterior.continue_probs(pilot_rewards, self.continue_probability, self.continue_scheme,
                                        history=self.history, prompt_ids=prompt_ids,
                                        group_size=self.group_size, step=step, max_age=self.history_max_age)

    def continue_groups(self, prompt_ids: list[str], pilot_rewards: torch.Tensor, step: int) -> Continuation:
        """Each group whose pilot is not all equal is continued; each other one with probability c_q (an
        independent draw of (seed, step) only: resumable). Call it before the history records this step's
        groups."""
        probs = self.continue_probs(prompt_ids, pilot_rewards, step)
        return Continuation(pruning.sample_keep(probs, pruning.step_generator(self.seed, step, "pilot")),
                            probs)

    def completion_probs(self, advantages: torch.Tensor, lengths: torch.Tensor | None = None,
                         prompt_probs: torch.Tensor | None = None) -> torch.Tensor:
        """p_qi of shape (P, G); all 1 when nothing is pruned (and no A = 0 completion may be dropped).

        With ``completion_target_ess`` the rate is chosen per step (:func:`pruning.adaptive_rate`, given the
        rolled-out prompts' ``prompt_probs``, default 1), at most ``completion_prune_rate``."""
        rate = self.completion_prune_rate
        if self.completion_target_ess is not None and rate > 0:
            pi = (torch.ones(advantages.shape[0], dtype=torch.float64) if prompt_probs is None
                  else prompt_probs)
            rate = pruning.adaptive_rate(pi, self.completion_target_ess, rate,
                                         lambda r: self._completion_probs_at(advantages, lengths, r))
        return self._completion_probs_at(advantages, lengths, rate)

    def _completion_probs_at(self, advantages: torch.Tensor, lengths: torch.Tensor | None,
                             rate: float) -> torch.Tensor:
        if rate > 0 or (self.drop_zero_advantage and self.beta == 0):
            scheme = self.completion_scheme if rate > 0 else "proportional"
            return pruning.completion_keep_probs(
                advantages, rate, scheme=scheme,
                min_keep_prob=self.min_completion_keep_prob, beta=self.beta,
                drop_zero=self.drop_zero_advantage, lengths=lengths, length_exponent=self.length_exponent)
        return torch.ones(advantages.shape, dtype=torch.float64)

    def weigh(self, advantages: torch.Tensor, selection: Selection | None = None, step: int = 0,
              rewards: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> Weighting:
        if selection is None:
            if self.prompt_prune_rate > 0:
                raise ValueError("DPPOEstimator.weigh: prompts are pruned, so pass the step's Selection (its "
                                 "keep probabilities and window are in the weights and the normaliser)")
            selection = full_selection(advantages.shape[0])
        if advantages.shape[0] == 0:  # every prompt pruned: nothing to train, the estimate is 0
            return Weighting(torch.zeros(advantages.shape, dtype=torch.bool),
                             torch.zeros(advantages.shape, dtype=torch.float64),
                             selection.window * advantages.shape[1])
        if self.needs_lengths and lengths is None:
            raise ValueError("DPPOEstimator.weigh: completion_scheme='length' needs the completions' token "
                             "counts (lengths=, shape (P, G)); pass them, or use "
                             "completion_scheme='proportional'")
        probs = self.completion_probs(advantages, lengths, selection.probs)
        # sorted designs order each group by its signed advantage: the kept set spans both signs
        keep = pruning.sample_keep(probs, pruning.step_generator(self.seed, step, "completions"),
                                   self.fixed_size_sampling, design=self.fixed_size_design,
                                   order_key=advantages)
        weights = pruning.importance_weights(selection.probs, probs, keep)
        return Weighting(keep, weights, selection.window * advantages.shape[1])


@dataclass(kw_only=True)
class CPPOEstimator(Estimator):
    """``cppo`` (BIASED baseline): the top ``G - round(r·G)`` completions of each group by |A|, weight 1,
    normalised by the number kept (as CPPO trains)."""

    name: ClassVar[str] = "cppo"
    completion_prune_rate: float = 0.0

    def weigh(self, advantages: torch.Tensor, selection: Selection | None = None, step: int = 0,
              rewards: torch.Tensor | None = None) -> Weighting:
        keep = biased_baselines.cppo_keep(advantages, self.completion_prune_rate)
        return Weighting(keep, keep.to(torch.float64), int(keep.sum()))


@dataclass(kw_only=True)
class GRESOEstimator(PromptPruning):
    """``greso`` (BIASED baseline): prompts whose last group was all-equal are skipped with probability r; the
    rest train with weight 1 and normaliser P·G over the kept prompts only. With
    ``greso_target_zero_variance`` set, GRESO's own rule instead: kept with max(p^z, 0.01) after z all-equal
    groups in a row, p adapted each step toward that target
    (:func:`~dppo_core.biased_baselines.greso_streak_keep_probs`,
    :class:`~dppo_core.biased_baselines.GRESOExploration`)."""

    name: ClassVar[str] = "greso"
    greso_target_zero_variance: float | None = None
    exploration: biased_baselines.GRESOExploration | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.greso_target_zero_variance is not None:
            self.exploration = biased_baselines.GRESOExploration(self.greso_target_zero_variance)

    def prunes_prompts(self) -> bool:
        return self.exploration is not None or super().prunes_prompts()

    def prompt_probs(self, ids: list[str], step: int, budget: float | None = None) -> torch.Tensor:
        # GRESO has no budget rule: a dense window keeps its skip probabilities as they are
        if self.exploration is not None:
            self.exploration.adapt(step)
            return biased_baselines.greso_streak_keep_probs(
                self.history, ids, self.exploration.p_solved, self.exploration.p_unsolved, step=step,
                max_age=self.history_max_age)
        return biased_baselines.greso_keep_probs(self.history, ids, self.prompt_prune_rate, step=step,
                                                 max_age=self.history_max_age)

    def observe(self, prompt_ids: list[str], rewards: torch.Tensor, advantages: torch.Tensor,
                step: int) -> None:
        super().observe(prompt_ids, rewards, advantages, step)
        if self.exploration is not None:
            self.exploration.count(rewards)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "exploration": asdict(self.exploration)} if self.exploration is not None else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # the run's probabilities, this config's target
        if self.exploration is not None and "exploration" in state:
            self.exploration = biased_baselines.GRESOExploration(
                **{**state["exploration"], "target": self.exploration.target})


@dataclass(kw_only=True)
class PODSEstimator(Estimator):
    """``pods`` (BIASED baseline; Xu et al. 2025, "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM
    Reasoning"): roll out G per prompt, train on the ``G - round(r·G)`` (at least 2) whose rewards have the
    largest variance, weight 1, advantages recomputed over the kept ones (PODS runs GRPO on the down-sampled
    group), normalised by the number kept. Needs the rewards: ``weigh(A, selection, step, rewards=R)``."""

    name: ClassVar[str] = "pods"
    needs_rewards: ClassVar[bool] = True
    completion_prune_rate: float = 0.0
    scale_rewards: str = "group"

    def num_kept(self, group_size: int) -> int:
        return max(2, group_size - round(self.completion_prune_rate * group_size))

    def weigh(self, advantages: torch.Tensor, selection: Selection | None = None, step: int = 0,
              rewards: torch.Tensor | None = None) -> Weighting:
        if rewards is None:
            raise ValueError("PODSEstimator.weigh needs the step's rewards (rewards=...): it keeps the "
                             "completions whose rewards vary most and recomputes their advantages")
        p, g = advantages.shape
        m = min(g, self.num_kept(g))
        keep = biased_baselines.pods_keep(rewards, m) if p else torch.zeros(p, g, dtype=torch.bool)
        adv = torch.zeros(p, g, dtype=advantages.dtype)
        if p:
            adv[keep] = group_advantages(torch.as_tensor(rewards)[keep].view(p, m),
                                         self.scale_rewards).flatten()
        return Weighting(keep, keep.to(torch.float64), int(keep.sum()), advantages=adv)


ESTIMATORS: dict[str, type[Estimator]] = {
    cls.name: cls for cls in (Estimator, DPPOEstimator, CPPOEstimator, GRESOEstimator, PODSEstimator)
}


def make_estimator(config: Any) -> Estimator:
    """The estimator of ``config.pruning`` (one of :data:`ESTIMATORS`), configured from ``config``."""
    try:
        cls = ESTIMATORS[config.pruning]
    except KeyError:
        raise ValueError(f"pruning={config.pruning!r}: choose one of {tuple(ESTIMATORS)}") from None
    return cls.from_config(config)
