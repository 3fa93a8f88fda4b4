"""The exact expectation of a DPPO step's loss and gradient over every draw, and its full-batch GRPO reference, on
small steps (a few candidate prompts, G = 3 completions of 0-4 tokens, per-token log-probs as the parameters θ),
through the trainer's own functions; and the matrices of settings they are checked on, generated from the config's
own tuples. What they are for, and what they must give: tests/unit/test_exact_expectation.py (its docstring); the
sampling matrix, the slow part (a few minutes on 2 cores), runs in tests/system/test_exact_sampling_matrix.py."""

from __future__ import annotations

import copy
import itertools

import torch
from enumeration import Enumerator

from dppo_core import pruning
from dppo_core.config import (
    COMPLETION_SCHEMES,
    CONTINUE_SCHEMES,
    FIXED_SIZE_DESIGNS,
    LOSS_TYPES,
    PROMPT_SCHEMES,
    SCALE_REWARDS,
    DPPOConfig,
    preset,
)
from dppo_core.distributed import DistInfo
from dppo_core.estimator import make_estimator
from dppo_core.grpo import group_advantages
from dppo_core.plans import pilot
from dppo_core.posterior import StreakCalibration
from dppo_core.pruning import PromptHistory
from dppo_core.rollout import Completion, RolloutBatch, RolloutGroup
from dppo_core.trainer import DPPOTrainer, micro_batch_loss

G = 3
STEP = 7
TOL = 1e-9
# rewards of each candidate prompt's G completions: degenerate groups (all equal) and informative ones
# (q6, last: its first two rewards are equal and its group is not, for the pilot's tests)
REWARDS = {"q0": [1.0, 0.0, 0.0], "q1": [1.0, 0.5, 0.0], "q5": [1.0, 1.0, 1.0], "q2": [0.0, 1.0, 0.5],
           "q3": [0.0, 0.0, 0.0], "q4": [1.0, 0.0, 1.0], "q6": [1.0, 1.0, 0.0]}
LENGTHS = {"q0": [2, 3, 1], "q1": [1, 2, 2], "q5": [1, 3, 2], "q2": [3, 0, 2], "q3": [2, 1, 1], "q4": [4, 1, 2],
           "q6": [2, 1, 3]}
PAST = {  # the rewards each prompt's group got at steps STEP - 2 and STEP - 1 (q5 was never rolled out)
    STEP - 2: {"q0": [0.0, 0.0, 0.0], "q1": [1.0, 0.0, 0.0], "q3": [1.0, 1.0, 1.0], "q4": [0.0, 0.5, 1.0]},
    STEP - 1: {"q0": [1.0, 0.0, 0.0], "q1": [0.0, 0.0, 0.0], "q2": [1.0, 1.0, 0.0], "q3": [0.0, 0.0, 0.0],
               "q4": [0.0, 1.0, 0.0]},
}


#: The ``streak`` scheme's counts before STEP: after one all-equal group, prompts were rarely informative next.
STREAK_COUNTS = {f"1:{b}": [1.0, 30.0] for b in range(5)}


def history_before(until: int = STEP) -> PromptHistory:
    """The history before step ``until``: q1 and q3 looked degenerate last time (q1 has signal now), q5 is unseen."""
    h = PromptHistory()
    for step, rows in PAST.items():
        if step < until:
            r = torch.tensor(list(rows.values()))
            h.update(list(rows), r, group_advantages(r), step)
    return h


class Params:
    """θ: one float64 leaf of per-token log-probs per completion, with fixed old and reference log-probs."""

    def __init__(self, ids: list[str], ratio: bool):
        g = torch.Generator().manual_seed(3)
        self.leaves, self.old, self.ref = {}, {}, {}
        for q in ids:
            for i, n in enumerate(LENGTHS[q]):
                lp = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.1
                self.leaves[q, i] = lp.requires_grad_(True)
                # old log-probs 0.3 apart from θ: ratios outside [0.8, 1.2], so the clip acts on some tokens
                self.old[q, i] = lp.detach() + (0.3 * torch.randn(n, generator=g, dtype=torch.float64) if ratio else 0)
                self.ref[q, i] = lp.detach() + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)

    def flat_grad(self, loss: torch.Tensor | None) -> torch.Tensor:
        leaves = list(self.leaves.values())
        if loss is None:
            return torch.zeros(sum(x.numel() for x in leaves), dtype=torch.float64)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return torch.cat([torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads, strict=True)])


def _pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(x.numel() for x in rows)
    mask = torch.zeros(len(rows), t)
    out = torch.stack([torch.cat([x, torch.zeros(t - x.numel(), dtype=torch.float64)]) for x in rows])
    for j, x in enumerate(rows):
        mask[j, : x.numel()] = 1
    return out, mask


class Candidates:
    """A prompt source holding the step's candidates, handed out as the trainer's ``prompts.sample`` does."""

    def __init__(self, ids: list[str]):
        self.rows = [{"id": q, "prompt": [{"role": "user", "content": q}]} for q in ids]

    def sample(self, seed: int, step: int, n: int) -> list[dict]:
        assert n <= len(self.rows), f"the step asks for {n} candidates; the test holds {len(self.rows)}"
        return self.rows[:n]


class StepParts:
    """``DPPOTrainer``'s own functions for the parts of ``train_step`` that choose and weigh (and, handed this
    stand-in, the pilot plan's continue draw), on a stand-in that holds only what they read (the config, the
    estimator, the prompt source): no model, no engine."""

    select_prompts = DPPOTrainer.select_prompts
    weigh = DPPOTrainer.weigh

    def __init__(self, config: DPPOConfig, estimator, ids: list[str]):
        self.config, self.estimator, self.prompts = config, estimator, Candidates(ids)
        self.dist = DistInfo()  # one process: rank 0's draws are these


def run_step(config: DPPOConfig, estimator, ids: list[str], theta: Params, scale: bool = False,
             observe: bool = True) -> tuple[float, torch.Tensor, int]:
    """One step's loss L̂(θ), its gradient and the window |B|, through the trainer's code in ``train_step``'s order
    (``observe=False``: the estimator's ``weigh`` right after ``select``, the history untouched)."""
    parts = StepParts(config, estimator, ids)
    sel = parts.select_prompts(STEP)  # the candidates from the prompt source, as train_step draws them
    kept = [ids[i] for i in sel.indices]
    rewards = torch.tensor([REWARDS[q] for q in kept]).view(len(kept), G)
    lengths = torch.tensor([LENGTHS[q] for q in kept]).view(len(kept), G)
    if config.pilot_size:  # roll_out's order: the pilot's k rewards, the continue draw, the rest of the continued
        k = config.pilot_size
        sel, cont = pilot.Pilot(config).continue_groups(parts, sel, rewards[:, :k], STEP, observe=observe)
        on = cont.positions
        rewards = pilot.join(rewards[:, :k], rewards[on][:, k:], on)
        lengths = pilot.join(lengths[:, :k], lengths[on][:, k:], on)
        kept = [kept[j] for j in on]
    # observe: train_step's order (advantages, the history records this step's groups, then weigh)
    adv, weighting = parts.weigh(sel, rewards, lengths, STEP, observe=observe)
    batch = RolloutBatch([RolloutGroup(q, [1, 2], [Completion(list(range(3, 3 + n)), "", [], "stop")
                                                   for n in LENGTHS[q]]) for q in kept])
    seqs = DPPOTrainer.sequences(batch, adv, weighting)
    if not len(seqs):
        return 0.0, theta.flat_grad(None), sel.window
    cells = [(kept[gi], ci) for gi, ci in seqs.origin]
    logp, mask = _pad([theta.leaves[c] for c in cells])
    old, _ = _pad([theta.old[c] for c in cells])
    ref, _ = _pad([theta.ref[c] for c in cells])
    old, ref = old if config.num_iterations > 1 else None, ref if config.beta > 0 else None
    loss, _ = micro_batch_loss(config, seqs, list(range(len(seqs))), logp, mask, old, ref)
    if scale:  # the loss's size: Σ |each completion's term| (the normalisers are the step's, so terms add up)
        return sum(abs(micro_batch_loss(config, seqs, [j], logp[j:j + 1], mask[j:j + 1],
                                        None if old is None else old[j:j + 1],
                                        None if ref is None else ref[j:j + 1])[0].item()) for j in range(len(seqs)))
    return loss.item(), theta.flat_grad(loss), sel.window


def _memo(fn):
    """``fn`` of tensors (or None), remembered by their values: the paths through a step's draws share the
    completions' keep probabilities of each prompt outcome (with the adaptive rate, a search over rates)."""
    found: dict = {}

    def memo(*args):
        key = tuple(None if a is None else (a.numpy().tobytes(), tuple(a.shape), str(a.dtype)) for a in args)
        if key not in found:
            found[key] = fn(*args)
        return found[key].clone()

    return memo


class _FreshPromptProbs:
    """The estimator's ``prompt_probs`` remembered by its arguments while the path still holds the fresh copies of
    the history (and the ``streak`` scheme's counts) that every path starts from: until something on the path
    observes, every path asks the same question of the same state. A call after ``observe``, or with another
    history swapped in (the stale-π mutants), is computed, not remembered."""

    def __init__(self, estimator):
        self.estimator, self.fn, self.found, self.fresh = estimator, estimator.prompt_probs, {}, None
        self.observe = estimator.observe

    def state(self) -> tuple:
        return self.estimator.history, getattr(self.estimator, "calibration", None)

    def start(self) -> None:  # the path's copies are in place
        self.fresh = self.state()

    def observing(self, *args, **kwargs):
        self.fresh = None
        return self.observe(*args, **kwargs)

    def __call__(self, ids, step, budget=None):
        if self.fresh is None or any(a is not b for a, b in zip(self.fresh, self.state(), strict=True)):
            return self.fn(ids, step, budget=budget)
        key = (tuple(ids), step, budget)
        if key not in self.found:
            self.found[key] = self.fn(ids, step, budget=budget)
        return self.found[key].clone()


def exact_expectation(monkeypatch, config: DPPOConfig, estimator, ids: list[str], theta: Params,
                      observe: bool = True):
    """E[L̂(θ)], E[∇L̂(θ)] over every draw, the number of outcomes, and the (draw-independent) window. Each path
    starts from the same history (``observe`` adds the step's groups to it)."""
    enum = Enumerator()
    monkeypatch.setattr(pruning, "sample_keep", enum.sample_keep)
    if hasattr(estimator, "completion_probs"):  # a function of its arguments: computed once per distinct step
        monkeypatch.setattr(estimator, "completion_probs", _memo(estimator.completion_probs))
    fresh = None
    # the same on every path until it observes: computed once (not GRESO's adaptive rule, whose π moves each call)
    if hasattr(estimator, "prompt_probs") and getattr(estimator, "exploration", None) is None:
        fresh = _FreshPromptProbs(estimator)
        monkeypatch.setattr(estimator, "prompt_probs", fresh)
        monkeypatch.setattr(estimator, "observe", fresh.observing)
    loss, grad, total, n, windows = 0.0, 0.0, 0.0, 0, set()
    before = copy.deepcopy(estimator.history)
    calibration = copy.deepcopy(getattr(estimator, "calibration", None))  # streak's counts: observe adds to them
    while True:
        enum.start()
        estimator.history = copy.deepcopy(before)
        if calibration is not None:
            estimator.calibration = copy.deepcopy(calibration)
        if fresh is not None:
            fresh.start()
        lv, gv, window = run_step(config, estimator, ids, theta, observe=observe)
        loss, grad, total, n = loss + enum.prob * lv, grad + enum.prob * gv, total + enum.prob, n + 1
        windows.add(window)
        if not enum.advance():
            break
    monkeypatch.undo()
    estimator.history = before
    if calibration is not None:
        estimator.calibration = calibration
    assert abs(total - 1) < 1e-12 and len(windows) == 1
    return loss, grad, n, windows.pop()


def full_batch(config: DPPOConfig, ids: list[str], window: int, theta: Params) -> tuple[float, torch.Tensor, float]:
    """Full-batch GRPO over the window (every candidate and completion, weight 1) through the same code: its
    loss, gradient and Σ |per-completion terms| (the loss itself may nearly cancel: advantages sum to 0)."""
    full = config.with_overrides({"pruning": "none", "prompt_prune_rate": 0.0, "completion_prune_rate": 0.0,
                                  "prompts_per_step": window, "dense_prompts": False, "pilot_size": 0})
    loss, grad, _ = run_step(full, make_estimator(full), ids[:window], theta)
    return loss, grad, run_step(full, make_estimator(full), ids[:window], theta, scale=True)


def relative_bias(monkeypatch, config: DPPOConfig, estimator=None, random: bool = True, observe: bool = True,
                  ids: list[str] | None = None):
    """Relative bias of the loss (against the size of its terms) and of the gradient, and the number of outcomes.
    The candidates (``ids``, default): ``prompts_per_step`` (times ``prompt_window_factor`` with dense prompts) from
    ``REWARDS``."""
    k = config.prompts_per_step
    ids = ids or list(REWARDS)[: k * config.prompt_window_factor if config.dense_prompts else k]
    if estimator is None:
        estimator = make_estimator(config)
        estimator.history = history_before()
        if config.prompt_scheme == "streak":  # counts that move q1's and q3's π (z = 1) away from fitted's
            estimator.calibration = StreakCalibration(STREAK_COUNTS)
    theta = Params(ids, ratio=config.num_iterations > 1)
    loss, grad, n, window = exact_expectation(monkeypatch, config, estimator, ids, theta, observe)
    full_loss, full_grad, scale = full_batch(config, ids, window, theta)
    assert full_grad.abs().max() > 0 and (n > 1 or not random), "the setting should have a gradient and random draws"
    return abs(loss - full_loss) / scale, float((grad - full_grad).norm() / full_grad.norm()), n


def dppo_config(**overrides) -> DPPOConfig:
    base = dict(model="unused", pruning="dppo", prompts_per_step=3, num_generations=G, max_completion_length=4,
                prompt_prune_rate=0.5, completion_prune_rate=0.5, min_prompt_keep_prob=0.2,
                min_completion_keep_prob=0.2, beta=0.04, num_iterations=2)
    return DPPOConfig(**(base | overrides))


# --- the matrices, generated from the config's tuples ------------------------------------------------------

DESIGNS = {"bernoulli": dict(fixed_size_sampling=False),
           **{name: dict(fixed_size_sampling=True, fixed_size_design=name) for name in FIXED_SIZE_DESIGNS}}
ADAPTIVE = 4.0  # completion_target_ess: the rate is chosen per step from the advantages and π (before the draw)


def window_settings(dense: bool) -> dict:
    """Dense prompts look ahead over 2 × 2 candidates for 2 prompts; otherwise the step's 3 candidates."""
    return dict(dense_prompts=True, prompts_per_step=2, prompt_window_factor=2) if dense else {}


# The other estimator settings, taken in turn by the sampling matrix's combinations (each setting meets every
# scheme and design): the KL term and zero-advantage dropping (β = 0: A = 0 completions get p = 0), a PPO ratio
# ≠ 1 (clipping active), the posterior's half-life, the length exponent, the floors, the history's age limit and
# the prune rates.
ROTATION = (
    dict(beta=0.0, drop_zero_advantage=True, num_iterations=1, posterior_half_life=20.0, length_exponent=0.5,
         min_prompt_keep_prob=0.2, min_completion_keep_prob=0.2, history_max_age=None, prompt_prune_rate=0.5,
         completion_prune_rate=0.5),
    dict(beta=0.0, drop_zero_advantage=False, num_iterations=2, posterior_half_life=None, length_exponent=1.0,
         min_prompt_keep_prob=0.4, min_completion_keep_prob=0.3, history_max_age=1, prompt_prune_rate=0.3,
         completion_prune_rate=0.7),
    dict(beta=0.04, drop_zero_advantage=True, num_iterations=2, posterior_half_life=5.0, length_exponent=0.0,
         min_prompt_keep_prob=0.2, min_completion_keep_prob=0.5, history_max_age=None, prompt_prune_rate=0.6,
         completion_prune_rate=0.4),
)
SAMPLING = [dict(prompt_scheme=ps, completion_scheme=cs, completion_target_ess=ess, **DESIGNS[design],
                 **window_settings(dense), **ROTATION[i % len(ROTATION)])
            for i, (ps, cs, design, dense, ess) in enumerate(itertools.product(
                PROMPT_SCHEMES, COMPLETION_SCHEMES, DESIGNS, (False, True), (None, ADAPTIVE)))]


# Pilot, then continue (G = 3): k = 1 (every pilot is all equal, so every group is continued with probability c_q,
# informative ones like q0 too) and k = 2 (q6's pilot is all equal and its group is not; q3's group is all equal), each
# continue scheme, alone and composed with prompt pruning, completion pruning and both, c and the designs in turn.
PILOT_IDS = ["q6", "q0", "q3", "q4"]
PILOT = [dict(pilot_size=k, continue_scheme=scheme, prompt_prune_rate=pr, completion_prune_rate=cr,
              continue_probability=(0.3, 0.7)[i % 2], **DESIGNS[("bernoulli", "sorted")[i // 2 % 2]])
         for i, (k, scheme, (pr, cr)) in enumerate(itertools.product(
             (1, 2), CONTINUE_SCHEMES, ((0.0, 0.0), (0.5, 0.0), (0.0, 0.5), (0.5, 0.5))))]


def pilot_id(settings: dict) -> str:
    return (f"k{settings['pilot_size']}-{settings['continue_scheme']}-c{settings['continue_probability']}"
            f"-prompts{settings['prompt_prune_rate']}-completions{settings['completion_prune_rate']}")


def sampling_id(settings: dict) -> str:
    design = settings.get("fixed_size_design", "systematic") if settings["fixed_size_sampling"] else "bernoulli"
    return "-".join([settings["prompt_scheme"], settings["completion_scheme"], design,
                     "dense" if settings.get("dense_prompts") else "window",
                     "adaptive" if settings["completion_target_ess"] else "fixed"])


LOSSES = list(itertools.product(LOSS_TYPES, SCALE_REWARDS, DESIGNS, (False, True)))
#: what DPPOConfig refuses with prompt pruning, because it depends on which prompts were kept (exact with
#: completion pruning only)
REFUSED = {"loss_type": {"dapo"}, "scale_rewards": {"batch"}}


def loss_settings(loss_type: str, scale_rewards: str, design: str, dense: bool) -> dict:
    settings = dict(loss_type=loss_type, scale_rewards=scale_rewards, **DESIGNS[design], **window_settings(dense))
    if loss_type in REFUSED["loss_type"] or scale_rewards in REFUSED["scale_rewards"]:
        settings["prompt_prune_rate"] = 0.0
    return settings


def default_config(**overrides) -> DPPOConfig:
    """tiny-dppo's own combination (posterior prompts, dense prompts, completions ∝ |A| / length, sorted
    systematic sampling, its rates, floors, β and half-life), at the enumeration's size."""
    return preset("tiny-dppo").with_overrides(
        dict(model="unused", num_generations=G, max_completion_length=4, **window_settings(True)) | overrides)
