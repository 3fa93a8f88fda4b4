"""What DPPO's pruning leaves biased: the optimizer's update, gradient-norm clipping and a second PPO epoch.

Made with (from the repository root; 12 minutes with one torch thread on a 2-core machine that other jobs
kept busy, load average 4; per-part times in the JSON's ``timings_s``):

    DPPO_CACHE_DIR=.cache/dppo ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/update_bias.py --output benchmarks/results/update_bias.json

(the Markdown summary goes next to the JSON, ``update_bias.md``; both record the command.)

The pruned loss L̂(θ) and its gradient at parameters fixed before the draw are unbiased for full-batch
GRPO's (tests/system/test_unbiased.py). What the optimizer does with them is not, and this measures by how much,
on the embedded warm-started tiny model and the arithmetic task with the ``cpu-full`` bench preset's
configurations (:func:`dppo_core.tools.bench.presets.method_config`): ``dppo`` (the bench method ``dppo_paper``, what
``dppo`` was when the results were made: prompt rate 0.8 with the paper
scheme, completion rate 0.5 proportional to |A|, floors 0.2, fixed-size sampling, packing) against
``grpo`` (no pruning), both β = 0, AdamW (betas 0.9, 0.99) at lr 1e-4, ``max_grad_norm`` 1.0, 32 prompts
x 8 completions.

Setup. ``--warm-steps`` full-batch GRPO steps through :meth:`DPPOTrainer.train_step` move the model to θ_K and
give AdamW a warm state S_K. A measured batch: ``--prompts`` prompts of the training pool rolled out once
for the prompt history (what prompt pruning reads: the prompts' previous visit), then again: the batch
every draw prunes. Rewards and group advantages as the trainer computes them. One DPPO draw = the
trainer's ``select_prompts`` + its estimator's ``weigh`` with the draw's index as the step (the pruning
randomness is a function of the step). The gradient of a draw is Σ_kept w_qi g_qi, where g_qi is
completion (q, i)'s gradient of the loss term with the full batch's normaliser C = |B| G (β = 0, one epoch:
completions with A = 0 have none); the g_qi are computed once (one backward each), and each draw's
gradient is checked against the one the trainer's ``update`` backpropagates (packed micro-batches).

(a) The gradient. From the Gram matrix K = [g_i · g_j] every draw's ‖ĝ‖, ‖ĝ - g‖ and the mean's
    ‖mean ĝ - g‖ are exact quadratic forms in the draws' weight vectors, over ``--gram-draws`` draws.
    ``noise`` is the Monte-Carlo error the mean would have if unbiased: sqrt(tr Cov(ĝ) / N) (the whole
    gradient vector's variance), so ``‖mean ĝ - g‖ / noise`` is about 1 for an unbiased estimator.
(b) One optimizer step. Each draw's gradient is clipped at ``max_grad_norm`` as
    ``torch.nn.utils.clip_grad_norm_`` does and stepped by AdamW's arithmetic (vectorised over draws;
    checked against ``torch.optim.AdamW`` itself) with the trainer's hyper-parameters, from a fresh state
    and from S_K (and from S_K without clipping, to separate the two);
    the update Δθ̂ is compared with the full-batch GRPO update Δθ from the same state:
    ‖E[Δθ̂] - Δθ‖ / ‖Δθ‖ over ``--update-draws`` draws, with the Monte-Carlo noise floor, the
    noise-corrected bias sqrt(‖mean Δθ̂ - Δθ‖² - tr Cov / N) and its standard error (from 8 batches of
    draws; conservative), cos(E[Δθ̂], Δθ) and ‖E[Δθ̂]‖ / ‖Δθ‖. This arithmetic is checked against the
    trainer's own ``update`` (its AdamW, lr and clipping) on the first ``--check-draws`` draws and on the
    full batch: ``trainer_check`` holds the relative differences.
(c) Clipping. Per draw, whether ‖ĝ‖ (the pre-clip norm, what ``grad_norm`` logs) exceeds
    ``max_grad_norm``, for DPPO and for full-batch GRPO, on ``--clip-batches`` batches (the measured one
    and others, each with its own history rollout), ``--gram-draws`` draws each; and what clipping does to
    the expected gradient: ‖E[clip(ĝ)] - g‖ / ‖g‖ and the share of g's direction E[clip(ĝ)] keeps.
    For another rule (reported, not implemented): the clip rate at a threshold scaled by sqrt(E‖ĝ‖²) / ‖g‖
    (how much larger DPPO's norms are than GRPO's; a history of norms could set it), and the threshold at
    which DPPO would clip 1% of draws. Also
    how often clipping fired in the committed ``cpu-full`` bench logs (``grad_norm`` there is the norm
    returned by ``clip_grad_norm_``: the total norm before clipping).
(d) The second epoch (``num_iterations`` 2, from θ_K and S_K, through the trainer's ``update``): the
    gradient of each epoch is recorded before clipping, for the full batch and for ``--epoch2-draws``
    draws (all kept). The first epoch's is unbiased (the control: its ``z`` shows what chance gives); the
    second is taken at θ_1 = θ_K + Δθ̂(draw), which depends on the draw, against the full batch's g_2 at
    θ_1^full. Standard errors by the delete-one jackknife of the noise-corrected squared bias (exact from
    the Gram matrix of the stored draws); ``z`` = b² / SE(b²).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dppo_core.data import prompt_key
from dppo_core.estimator import make_estimator
from dppo_core.grpo import group_advantages
from dppo_core.logprobs import completion_logprobs_with_grad
from dppo_core.rollout import RolloutBatch
from dppo_core.tools.bench.presets import bench_preset, method_config
from dppo_core.trainer import DPPOTrainer, micro_batch_loss

ENV_KEYS = ("DPPO_CACHE_DIR", "ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
GROUPS = 8  # batches of draws for the standard error of a noise-corrected bias


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------------
# Parameters as one flat vector
# --------------------------------------------------------------------------------------------------


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]  # the optimizer's order


def flat_params(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in params])


def flat_grads(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten() for p in params])


def set_params(params, flat: torch.Tensor) -> None:
    with torch.no_grad():
        i = 0
        for p in params:
            p.copy_(flat[i : i + p.numel()].view_as(p))
            i += p.numel()


def flat_state(optimizer, params) -> dict | None:
    """AdamW's state (exp_avg, exp_avg_sq, step) as flat vectors; None for a fresh optimizer."""
    if not optimizer.state:
        return None
    st = [optimizer.state[p] for p in params]
    steps = {float(s["step"]) for s in st}
    assert len(steps) == 1, "every parameter has taken the same number of steps"
    return {"exp_avg": torch.cat([s["exp_avg"].flatten() for s in st]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].flatten() for s in st]), "step": steps.pop()}


class Snapshot:
    """The trainer's parameters and optimizer state, to return to after each draw."""

    def __init__(self, trainer: DPPOTrainer, fresh_optimizer: bool = False):
        self.params = flat_params(trainer_params(trainer)).clone()
        self.opt = None if fresh_optimizer else copy.deepcopy(trainer.optimizer.state_dict())

    def restore(self, trainer: DPPOTrainer) -> None:
        set_params(trainer_params(trainer), self.params)
        if self.opt is None:
            trainer.optimizer.state.clear()  # a fresh AdamW: the state is created at the first step
        else:
            trainer.optimizer.load_state_dict(copy.deepcopy(self.opt))


def trainer_params(trainer):
    return trainable(trainer.model)


class GradRecorder:
    """Records the gradient (flat, before clipping) and the parameters at each ``clip_grad_norm_`` call of
    :meth:`DPPOTrainer.update` (one per epoch), without changing what it does."""

    def __init__(self):
        self.grads: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        self.norms: list[float] = []

    def __enter__(self):
        self._orig = torch.nn.utils.clip_grad_norm_

        def clip(parameters, max_norm, *args, **kwargs):
            parameters = list(parameters)
            self.grads.append(flat_grads(parameters).clone())
            self.params.append(flat_params(parameters).clone())
            norm = self._orig(parameters, max_norm, *args, **kwargs)
            self.norms.append(float(norm))
            return norm

        torch.nn.utils.clip_grad_norm_ = clip
        return self

    def __exit__(self, *exc):
        torch.nn.utils.clip_grad_norm_ = self._orig


# --------------------------------------------------------------------------------------------------
# Batches, draws and per-completion gradients
# --------------------------------------------------------------------------------------------------


def use(trainer: DPPOTrainer, config) -> None:
    """Switch the trainer to ``config`` (and its estimator), keeping the prompt history."""
    history = trainer.history
    trainer.config = config
    trainer.estimator = make_estimator(config)
    trainer.history = history


class Batch:
    """Prompts rolled out once for their history, then again: the rollouts every draw prunes."""

    def __init__(self, trainer: DPPOTrainer, index: int, prompts: int):
        c = trainer.config
        self.rows = trainer.prompts.sample(c.seed, 10_000 + index, prompts)
        ids = [prompt_key(r) for r in self.rows]
        past = trainer.generate(20_000 + index, self.rows)
        r_past = trainer.score(self.rows, past)
        trainer.estimator.observe(ids, r_past, group_advantages(r_past, c.scale_rewards), 20_000 + index)
        self.batch = trainer.generate(30_000 + index, self.rows)
        self.rewards = trainer.score(self.rows, self.batch)
        self.adv = group_advantages(self.rewards, c.scale_rewards)
        self.P, self.G = self.adv.shape
        self.history_zero_std = float((r_past.std(1) == 0).float().mean())
        self.zero_std = float((self.rewards.std(1) == 0).float().mean())
        lens = [len(comp.token_ids) for grp in self.batch.groups for comp in grp.completions]
        flat_adv = self.adv.flatten()
        # completions with a gradient (β = 0, one epoch: A = 0 or no tokens means a loss that is identically 0)
        self.items = [j for j in range(self.P * self.G) if flat_adv[j] != 0 and lens[j] > 0]

    def info(self) -> dict:
        return {"prompts": self.P, "num_generations": self.G, "reward_mean": round(float(self.rewards.mean()), 4),
                "zero_std_groups": round(self.zero_std, 4), "history_zero_std_groups": round(self.history_zero_std, 4),
                "completions_with_gradient": len(self.items)}

    def full_sequences(self, trainer: DPPOTrainer):
        """Every completion, weight 1, C = P G: full-batch GRPO (the trainer must be on the grpo config)."""
        assert trainer.config.pruning == "none"
        return trainer.sequences(self.batch, *trainer.weigh(None, None, torch.tensor(self.batch.lengths()), 0,
                                                         advantages=self.adv, observe=False))

    def draw(self, trainer: DPPOTrainer, m: int):
        """Draw m through the trainer's selection and weighting (its estimator must be dppo's)."""
        sel = trainer.select_prompts(m, candidates=self.rows)
        adv = self.adv[sel.indices]
        weighting = trainer.estimator.weigh(adv, sel, m)
        assert weighting.num_sequences == self.P * self.G, "C = |B| G"
        w = torch.zeros(self.P, self.G, dtype=torch.float64)
        if sel.indices:
            w[sel.indices] = weighting.weights * weighting.keep.to(torch.float64)
        return sel, weighting, w.flatten()[self.items]

    def draw_sequences(self, trainer: DPPOTrainer, m: int):
        sel, weighting, u = self.draw(trainer, m)
        sub = RolloutBatch(groups=[self.batch.groups[i] for i in sel.indices])
        return trainer.sequences(sub, self.adv[sel.indices], weighting), u


def per_completion_grads(trainer: DPPOTrainer, b: Batch) -> torch.Tensor:
    """(n, d) float32: row k is the gradient of completion items[k]'s loss term (normaliser P G) at the
    trainer's parameters, through the trainer's loss (:func:`micro_batch_loss`)."""
    seqs = b.full_sequences(trainer)
    where = {b.G * gi + ci: j for j, (gi, ci) in enumerate(seqs.origin)}
    model, params, c = trainer.model, trainer_params(trainer), trainer.config
    pad = trainer.tokenizer.pad_token_id
    out = torch.empty(len(b.items), sum(p.numel() for p in params), dtype=torch.float32)
    model.train()
    for k, item in enumerate(b.items):
        j = where[item]
        model.zero_grad(set_to_none=True)
        logp, mask = completion_logprobs_with_grad(model, [seqs.prompt_ids[j]], [seqs.completion_ids[j]],
                                                   c.temperature, pad)
        loss, _ = micro_batch_loss(c, seqs, [j], logp, mask)
        loss.backward()
        out[k] = flat_grads(params)
    model.zero_grad(set_to_none=True)
    return out


def gram(g: torch.Tensor, centre: torch.Tensor | None = None, block: int = 1 << 16) -> torch.Tensor:
    """(G - centre)(G - centre)ᵀ in float64, from float32 blocks of columns."""
    k = torch.zeros(g.shape[0], g.shape[0], dtype=torch.float64)
    for s in range(0, g.shape[1], block):
        part = g[:, s : s + block]
        if centre is not None:
            part = part - centre[s : s + block]
        k += (part @ part.T).double()
    return k


def quad(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Row-wise uᵀ K u for a (N, n) or (n,) u."""
    return ((u @ k) * u).sum(-1)


# --------------------------------------------------------------------------------------------------
# (a) and (c): the gradient and clipping, from the Gram matrix
# --------------------------------------------------------------------------------------------------


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``torch.nn.utils.clip_grad_norm_`` multiplies the gradients by."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def gram_analysis(u: torch.Tensor, k: torch.Tensor, max_norm: float) -> dict:
    """Every gradient number that is a quadratic form in the draws' weights u (N, n)."""
    n_draws = u.shape[0]
    one = torch.ones(u.shape[1], dtype=torch.float64)
    g2 = float(quad(one, k))
    g = math.sqrt(g2)
    norms = quad(u, k).clamp(min=0).sqrt()
    err = quad(u - one, k).clamp(min=0).sqrt() / g
    ubar = u.mean(0)
    mean_err = math.sqrt(max(float(quad(ubar - one, k)), 0.0)) / g
    tr_cov = float(quad(u - ubar, k).sum()) / (n_draws - 1)
    noise = math.sqrt(tr_cov / n_draws) / g
    clipped = norms > max_norm
    rate = float(clipped.double().mean())
    s = clip_scale(norms, max_norm)
    vbar = (s[:, None] * u).mean(0)  # E[clip(ĝ)] = vbarᵀ G
    clip_err = math.sqrt(max(float(quad(vbar - one, k)), 0.0)) / g
    along = float(vbar @ k @ one) / g2  # the share of g's direction that E[clip(ĝ)] keeps
    grpo_clipped = g > max_norm
    q = torch.quantile(norms, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    rms = math.sqrt(float((norms**2).mean()))
    return {
        "draws": n_draws,
        "grpo_grad_norm": g,
        "grpo_clipped": bool(grpo_clipped),
        "dppo_grad_norm_median": q[0], "dppo_grad_norm_p90": q[1], "dppo_grad_norm_p99": q[2],
        "dppo_grad_norm_max": float(norms.max()),
        "dppo_grad_norm_rms_over_grpo": rms / g,  # sqrt(E‖ĝ‖²) / ‖g‖ = sqrt(1 + tr Cov / ‖g‖²)
        "dppo_clip_rate": rate, "dppo_clip_rate_se": math.sqrt(rate * (1 - rate) / n_draws),
        # a threshold scaled by how much larger DPPO's norms are (a rule a norm history could set):
        "dppo_clip_rate_at_threshold_x_rms_ratio": float((norms > max_norm * rms / g).double().mean()),
        "dppo_threshold_clipping_1pct_of_draws": float(torch.quantile(norms, 0.99)),
        "per_draw_rel_error_mean": float(err.mean()), "per_draw_rel_error_median": float(err.median()),
        "per_draw_rel_error_rms": math.sqrt(float((err**2).mean())),
        "mean_rel_error": mean_err, "mean_rel_noise": noise, "mean_rel_error_over_noise": mean_err / noise,
        "clipped_mean_rel_error": clip_err,
        "clipped_mean_along_g": along,
        "grpo_clipped_along_g": float(clip_scale(torch.tensor(g), max_norm)),
    }


# --------------------------------------------------------------------------------------------------
# (b): one optimizer step
# --------------------------------------------------------------------------------------------------


def adamw_delta(grads: torch.Tensor, theta: torch.Tensor, state: dict | None, hp: dict) -> torch.Tensor:
    """Δθ of one AdamW step for each row of ``grads`` (k, d), every row from ``state`` (None: fresh).

    The arithmetic of ``torch.optim.AdamW`` (its single-tensor path, op for op), vectorised over k draws;
    AdamW is element-wise, so row r is the step the flat model takes with gradient row r.
    :func:`torch_adamw_delta` runs the real optimizer for the check.
    """
    b1, b2 = hp["betas"]
    lr, eps, wd = hp["lr"], hp["eps"], hp["weight_decay"]
    step = (state["step"] if state is not None else 0.0) + 1
    if state is None:
        m = grads * (1 - b1)  # exp_avg.lerp_(grad, 1 - b1) from 0
        v = grads * grads * (1 - b2)
    else:
        m = torch.lerp(state["exp_avg"].expand_as(grads), grads, 1 - b1)
        v = (state["exp_avg_sq"] * b2).expand_as(grads).addcmul(grads, grads, value=1 - b2)
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    denom = v.sqrt_().div_(bc2**0.5).add_(eps)
    delta = m.div_(denom).mul_(-lr / bc1)
    if wd:
        delta.sub_(theta, alpha=lr * wd)  # decoupled decay, on θ before the step
    return delta


def torch_adamw_delta(grads: torch.Tensor, theta: torch.Tensor, state: dict | None, hp: dict) -> torch.Tensor:
    """The same with ``torch.optim.AdamW`` itself on a (k, d) parameter (slower; for the check)."""
    k = grads.shape[0]
    p = torch.nn.Parameter(theta.expand(k, -1).clone())
    p.grad = grads.clone()
    opt = torch.optim.AdamW([p], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                            amsgrad=hp["amsgrad"])
    if state is not None:
        opt.state[p] = {"step": torch.tensor(state["step"]), "exp_avg": state["exp_avg"].expand(k, -1).clone(),
                        "exp_avg_sq": state["exp_avg_sq"].expand(k, -1).clone()}
    opt.step()
    return p.detach() - theta


def clip_rows(grads: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row scaled as ``torch.nn.utils.clip_grad_norm_`` scales a gradient."""
    norms = grads.norm(dim=1).double()
    return grads * clip_scale(norms, max_norm).to(grads.dtype)[:, None]


class Accumulator:
    """Mean, trace of the covariance and batch means of a stream of vectors, against a reference vector
    (too many draws to keep: the SE of the noise-corrected bias comes from ``groups`` batches of draws)."""

    def __init__(self, ref: torch.Tensor, groups: int, total: int):
        self.ref = ref.double()
        self.scale = float(self.ref.norm())
        self.s2 = torch.zeros_like(self.ref)
        self.group_s1 = torch.zeros(groups, ref.numel(), dtype=torch.float64)
        self.group_n = [0] * groups
        self.total, self.groups, self.n = total, groups, 0
        self.per_draw: list[float] = []

    def add(self, x: torch.Tensor) -> None:  # (k, d), all rows in one batch of draws
        gi = self.n * self.groups // self.total
        assert (self.n + x.shape[0] - 1) * self.groups // self.total == gi, "a chunk spans two batches of draws"
        self.per_draw += ((x - self.ref.to(x.dtype)).norm(dim=1).double() / self.scale).tolist()
        self.group_s1[gi] += x.sum(0).double()  # sums of at most a chunk in float32, then float64
        self.s2 += (x * x).sum(0).double()
        self.group_n[gi] += x.shape[0]
        self.n += x.shape[0]

    def result(self) -> dict:
        n, ref, scale = self.n, self.ref, self.scale
        mean = self.group_s1.sum(0) / n
        tr_cov = float((self.s2 - n * mean * mean).sum()) / (n - 1)
        raw2 = float(((mean - ref) ** 2).sum())
        bias2 = raw2 - tr_cov / n
        group_bias2 = [float(((self.group_s1[j] / self.group_n[j] - ref) ** 2).sum()) - tr_cov / self.group_n[j]
                       for j in range(self.groups)]
        se2 = statistics.stdev(group_bias2) / math.sqrt(self.groups)
        bias = math.sqrt(max(bias2, 0.0))
        d = self.ref
        return {
            "draws": n,
            "rel_error_of_mean": math.sqrt(raw2) / scale,
            "rel_noise_floor": math.sqrt(tr_cov / n) / scale,  # what rel_error_of_mean would be if unbiased
            "rel_bias_corrected": bias / scale,  # sqrt(‖mean - ref‖² - tr Cov / N) / ‖scale‖
            # standard error of rel_bias_corrected (delta method on the batch-means SE of the squared bias;
            # conservative); where the corrected bias is 0, the SE of its square root
            "rel_bias_corrected_se": (se2 / (2 * bias) if bias > math.sqrt(se2) else math.sqrt(se2)) / scale,
            "cos_mean_vs_ref": float(mean @ d) / (float(mean.norm()) * float(d.norm())),
            "norm_mean_over_ref": float(mean.norm()) / scale,
            "per_draw_rel_error_mean": statistics.fmean(self.per_draw),
            "per_draw_rel_error_median": statistics.median(self.per_draw),
        }


def draw_stats(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Bias of the mean of the N stored draws x (N, d) against ref, with a jackknife standard error.

    From the Gram matrix M of y_i = x_i - ref: ‖ȳ‖², tr Cov and the noise-corrected squared bias
    b² = ‖ȳ‖² - tr Cov / N of any subset are functions of M, so the delete-one jackknife is exact and
    cheap. ``z`` = b² / SE(b²) tests b² > 0 (about N(0, 1) for an unbiased estimator).
    """
    n = x.shape[0]
    m = gram(x, ref)
    scale = float(ref.double().norm())
    total, trace, diag, rows = float(m.sum()), float(m.trace()), m.diag(), m.sum(1)

    def bias2(k: int, s: float, tr: float) -> float:
        mean2 = s / k**2
        return mean2 - (tr - k * mean2) / (k - 1) / k

    b2 = bias2(n, total, trace)
    jack = torch.tensor([bias2(n - 1, total - 2 * float(rows[i]) + float(diag[i]), trace - float(diag[i]))
                         for i in range(n)], dtype=torch.float64)
    se2 = math.sqrt((n - 1) / n * float(((jack - jack.mean()) ** 2).sum()))
    b = math.sqrt(max(b2, 0.0))
    mean = x.double().mean(0)
    tr_cov = (trace - total / n) / (n - 1)
    return {
        "draws": n,
        "rel_error_of_mean": math.sqrt(max(total, 0.0)) / n / scale,
        "rel_noise_floor": math.sqrt(tr_cov / n) / scale,
        "rel_bias_corrected": b / scale,
        "rel_bias_corrected_se": (se2 / (2 * b) if b > math.sqrt(se2) else math.sqrt(se2)) / scale,
        "z": b2 / se2 if se2 > 0 else float("nan"),
        "cos_bias_vs_ref": float((mean - ref.double()) @ ref.double()) / (float((mean - ref.double()).norm()) * scale),
        "norm_mean_over_ref": float(mean.norm()) / scale,
        "per_draw_rel_error_median": float(diag.clamp(min=0).sqrt().median()) / scale,
    }


# --------------------------------------------------------------------------------------------------
# The trainer's own update, for the checks and for the second epoch
# --------------------------------------------------------------------------------------------------


def trainer_update(trainer: DPPOTrainer, seqs, snap: Snapshot) -> tuple[torch.Tensor, GradRecorder, dict]:
    """Δθ of the trainer's ``update`` on ``seqs`` from ``snap`` (restored after), with its recorded gradients."""
    snap.restore(trainer)
    with GradRecorder() as rec:
        stats = trainer.update(seqs)
    delta = flat_params(trainer_params(trainer)).double() - snap.params.double()
    snap.restore(trainer)
    return delta, rec, stats


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --------------------------------------------------------------------------------------------------
# The committed cpu-full logs
# --------------------------------------------------------------------------------------------------


def cpu_full_clipping(root: Path) -> dict:
    """Per method and seed: steps whose logged grad_norm (the total norm before clipping) exceeds max_grad_norm."""
    out: dict = {"source": str(root), "methods": {}}
    for method_dir in sorted((root / "runs").glob("*")):
        runs, clipped, total, norms = {}, 0, 0, []
        for seed_dir in sorted(method_dir.glob("seed-*")):
            cfg = json.loads((seed_dir / "config.json").read_text()) if (seed_dir / "config.json").exists() else {}
            rows = [json.loads(line) for line in (seed_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            g = [r["grad_norm"] for r in rows if r.get("grad_norm") is not None and not r.get("skipped")]
            if not g:
                runs[seed_dir.name] = {"steps": len(rows), "grad_norm_logged": False}
                continue
            max_norm = cfg.get("max_grad_norm", 1.0)
            c = sum(x > max_norm for x in g)
            runs[seed_dir.name] = {"steps": len(g), "max_grad_norm": max_norm, "clipped_steps": c,
                                   "clip_rate": round(c / len(g), 4),
                                   "grad_norm_median": round(statistics.median(g), 4),
                                   "grad_norm_max": round(max(g), 4)}
            clipped, total, norms = clipped + c, total + len(g), norms + g
        entry: dict = {"runs": runs}
        if total:
            entry.update({"clipped_steps": clipped, "steps": total, "clip_rate": round(clipped / total, 4),
                          "grad_norm_median": round(statistics.median(norms), 4)})
        else:
            entry["note"] = "no grad_norm in its metrics.jsonl (the TRL runner does not log it)"
        out["methods"][method_dir.name] = entry
    return out


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _f(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def write_markdown(rep: dict, path: Path) -> None:
    s = rep["setup"]
    lines = ["# What DPPO leaves biased: the optimizer step, clipping, a second epoch", "",
             f"Command: `{rep['command']}`", "",
             f"Warm-started tiny model, arithmetic task, the `{s['preset']}` bench configurations (`dppo`: prompt "
             f"rate {s['dppo']['prompt_prune_rate']} {s['dppo']['prompt_scheme']}, completion rate "
             f"{s['dppo']['completion_prune_rate']} {s['dppo']['completion_scheme']}, floors "
             f"{s['dppo']['min_prompt_keep_prob']}/{s['dppo']['min_completion_keep_prob']}, fixed-size sampling "
             f"{s['dppo']['fixed_size_sampling']}; against `grpo`), β {s['beta']}, AdamW lr {s['lr']} betas "
             f"{s['betas']}, max_grad_norm {s['max_grad_norm']}; {s['warm_steps']} full-batch GRPO steps first "
             f"(θ_K, AdamW state S_K). Measured batch: {rep['batches'][0]['prompts']} prompts x "
             f"{rep['batches'][0]['num_generations']} completions, {rep['batches'][0]['completions_with_gradient']} "
             f"with a gradient. Relative errors are against the full-batch GRPO quantity; `noise` is the "
             f"Monte-Carlo error an unbiased mean would show; ± is one standard error. The script's docstring "
             f"defines each number. {rep['elapsed_s']:.0f} s on {rep['machine']['threads']} thread(s).", ""]
    a = rep["gradient"]
    lines += ["## (a) The gradient at θ_K (unbiased: the control)", "",
              f"{a['draws']} draws: ‖mean ĝ − g‖/‖g‖ = {_f(a['mean_rel_error'])} against a noise of "
              f"{_f(a['mean_rel_noise'])} (ratio {_f(a['mean_rel_error_over_noise'])}); per draw ‖ĝ − g‖/‖g‖: mean "
              f"{_f(a['per_draw_rel_error_mean'])}, median {_f(a['per_draw_rel_error_median'])}; "
              f"sqrt(E‖ĝ‖²)/‖g‖ = {_f(a['dppo_grad_norm_rms_over_grpo'])}.", ""]
    lines += ["## (b) One AdamW step through the trainer's update rule", "",
              "| optimizer state | ‖mean Δθ̂ − Δθ‖/‖Δθ‖ | noise | bias (noise-corrected) | cos(E Δθ̂, Δθ) "
              "| ‖E Δθ̂‖/‖Δθ‖ | per draw ‖Δθ̂ − Δθ‖/‖Δθ‖ (median) |", "|---|---|---|---|---|---|---|"]
    for name, r in rep["update"]["variants"].items():
        lines.append(f"| {name} | {_f(r['rel_error_of_mean'])} | {_f(r['rel_noise_floor'])} | "
                     f"{_f(r['rel_bias_corrected'])} ± {_f(r['rel_bias_corrected_se'], 2)} | "
                     f"{_f(r['cos_mean_vs_ref'])} | "
                     f"{_f(r['norm_mean_over_ref'])} | {_f(r['per_draw_rel_error_median'])} |")
    ck = rep["update"]["trainer_check"]
    lines += ["", f"{rep['update']['draws']} draws. Checked against `DPPOTrainer.update` on {ck['draws']} draws and "
              f"the full batch: largest relative difference of the gradient {_f(ck['max_grad_rel_diff'], 2)}, of "
              f"Δθ {_f(ck['max_delta_rel_diff'], 2)}.", ""]
    lines += ["## (c) Gradient-norm clipping (pre-clip norm > max_grad_norm)", "",
              "| batch | GRPO ‖g‖ | GRPO clipped | DPPO ‖ĝ‖ median / p90 / p99 | DPPO clip rate | "
              "‖E clip(ĝ) − g‖/‖g‖ | E clip(ĝ) along g | rate at threshold × RMS ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(rep["clipping"]["batches"]):
        lines.append(f"| {i} | {_f(c['grpo_grad_norm'])} | {'yes' if c['grpo_clipped'] else 'no'} | "
                     f"{_f(c['dppo_grad_norm_median'])} / {_f(c['dppo_grad_norm_p90'])} / "
                     f"{_f(c['dppo_grad_norm_p99'])} | {_f(c['dppo_clip_rate'])} ± {_f(c['dppo_clip_rate_se'], 2)} | "
                     f"{_f(c['clipped_mean_rel_error'])} | "
                     f"{_f(c['clipped_mean_along_g'])} | {_f(c['dppo_clip_rate_at_threshold_x_rms_ratio'])} |")
    cs = rep["clipping"]["summary"]
    lines += ["", f"Over the {cs['batches']} batches: GRPO clipped on {cs['grpo_clipped_batches']}; DPPO's mean "
              f"clip rate "
              f"{_f(cs['dppo_clip_rate_mean'])}.", "", "Committed `cpu-full` logs (`grad_norm` = the norm before "
              "clipping):", "", "| method | steps | clipped | rate | median grad_norm |", "|---|---|---|---|---|"]
    for m, e in rep["cpu_full_logs"]["methods"].items():
        if "steps" in e:
            lines.append(f"| {m} | {e['steps']} | {e['clipped_steps']} | {e['clip_rate']} | {e['grad_norm_median']} |")
        else:
            lines.append(f"| {m} | - | - | - | {e['note']} |")
    d = rep["second_epoch"]
    lines += ["", "## (d) The second PPO epoch (num_iterations 2, from θ_K and S_K)", "",
              f"{d['draws']} draws; g₁, g₂: the full batch's gradients of epochs 1 and 2 (‖g₂ − g₁‖/‖g₁‖ = "
              f"{_f(d['full_epoch2_vs_epoch1'])}); ‖θ₁(draw) − θ₁^full‖/‖θ₁^full − θ_K‖ median "
              f"{_f(d['theta1_rel_distance_median'])}. z = b²/SE(b²), about N(0, 1) where unbiased.", "",
              "| estimate | ‖mean − ref‖/‖ref‖ | noise | bias (noise-corrected) | z | cos(bias, ref) "
              "| ‖mean‖/‖ref‖ |", "|---|---|---|---|---|---|---|"]
    names = {"epoch1": "epoch 1: mean ĝ₁ vs g₁ (control, unbiased)", "epoch2": "epoch 2: mean ĝ₂ vs g₂"}
    for key, label in names.items():
        r = d[key]
        lines.append(f"| {label} | {_f(r['rel_error_of_mean'])} | {_f(r['rel_noise_floor'])} | "
                     f"{_f(r['rel_bias_corrected'])} ± {_f(r['rel_bias_corrected_se'], 2)} | {_f(r['z'], 2)} | "
                     f"{_f(r['cos_bias_vs_ref'], 2)} | {_f(r['norm_mean_over_ref'])} |")
    lines.append("")
    if rep.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in rep["notes"]] + [""]
    path.write_text("\n".join(lines))


# --------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/update_bias.json"))
    parser.add_argument("--preset", default="cpu-full",
                        help="the bench preset whose grpo and dppo configurations are used")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per batch (the preset's prompts_per_step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-steps", type=int, default=3, help="full-batch GRPO steps before measuring")
    parser.add_argument("--gram-draws", type=int, default=2000, help="draws per batch for (a) and (c)")
    parser.add_argument("--update-draws", type=int, default=256, help="draws for (b)")
    parser.add_argument("--check-draws", type=int, default=3, help="draws of (b) also run through DPPOTrainer.update")
    parser.add_argument("--clip-batches", type=int, default=4, help="batches for (c), the measured one included")
    parser.add_argument("--epoch2-draws", type=int, default=48, help="draws for (d)")
    parser.add_argument("--chunk", type=int, default=16, help="draws per vectorised AdamW step in (b)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logs", type=Path, default=Path("benchmarks/results/cpu-full"),
                        help="committed bench results whose metrics.jsonl clipping rates are reported")
    args = parser.parse_args()
    if args.update_draws % (GROUPS * args.chunk):
        parser.error(f"--update-draws must be a multiple of {GROUPS} x --chunk")

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tmp = tempfile.mkdtemp(prefix="update-bias-")
    preset = bench_preset(args.preset)
    shared = [f"prompts_per_step={args.prompts}", "eval_steps=0", "save_steps=0"]
    # "dppo" here is the paper rule (the bench method dppo_paper), what the committed results measured
    cfg = {m: method_config(preset, name, args.seed, tmp, shared)
           for m, name in (("grpo", "grpo"), ("dppo", "dppo_paper"))}
    cfg2 = {m: c.with_overrides({"num_iterations": 2}) for m, c in cfg.items()}
    for c in cfg.values():
        assert c.beta == 0 and c.num_iterations == 1 and c.loss_type == "grpo"
    trainer = DPPOTrainer(cfg["grpo"], progress=False)
    trainer.engine = trainer.make_engine()
    params = trainer_params(trainer)
    group = trainer.optimizer.param_groups[0]
    hp = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
    max_norm = cfg["dppo"].max_grad_norm
    assert max_norm == cfg["grpo"].max_grad_norm
    log(f"model {trainer.model_path}: {sum(p.numel() for p in params)} parameters; AdamW {hp}")

    # warm steps: full-batch GRPO through the trainer's own step
    warm_log = []
    for _ in range(args.warm_steps):
        rec = trainer.train_step()
        warm_log.append({k: rec[k] for k in ("step", "reward_mean", "grad_norm", "loss")})
        log(f"warm step {rec['step']}: reward {rec['reward_mean']:.3f}, grad_norm {rec['grad_norm']:.3f}")
    theta = flat_params(params).clone()
    warm_state = flat_state(trainer.optimizer, params)
    snap_warm = Snapshot(trainer)
    snap_fresh = Snapshot(trainer, fresh_optimizer=True)
    timings = {"warm_steps_s": time.perf_counter() - t_start}

    # the measured batch and the per-completion gradients
    t = time.perf_counter()
    batches = [Batch(trainer, 0, args.prompts)]
    b = batches[0]
    log(f"measured batch: {b.info()}")
    g_items = per_completion_grads(trainer, b)
    k0 = gram(g_items)
    timings["batch0_s"] = time.perf_counter() - t

    # draws through the dppo estimator
    t = time.perf_counter()
    use(trainer, cfg["dppo"])
    n_draws = max(args.gram_draws, args.update_draws)
    u0 = torch.stack([b.draw(trainer, m)[2] for m in range(n_draws)])
    timings["draws_s"] = time.perf_counter() - t
    grad_report = gram_analysis(u0[: args.gram_draws], k0, max_norm)
    clip_reports = [grad_report]
    log(f"(a) {grad_report['mean_rel_error']:.4f} vs noise {grad_report['mean_rel_noise']:.4f}; per draw "
        f"{grad_report['per_draw_rel_error_median']:.3f}; clip rate {grad_report['dppo_clip_rate']:.4f}, GRPO norm "
        f"{grad_report['grpo_grad_norm']:.3f}")

    # (b) the optimizer step: full-batch reference, the trainer checks, then the draws
    t = time.perf_counter()
    g_full = g_items.sum(0)
    states = {"fresh": None, "warm": warm_state}
    variants = {"fresh AdamW state, clipped": ("fresh", True), "warm AdamW state S_K, clipped": ("warm", True),
                "warm AdamW state S_K, no clipping": ("warm", False)}
    ref = {name: adamw_delta(clip_rows(g_full[None], max_norm) if clip else g_full[None], theta, states[s], hp)[0]
           for name, (s, clip) in variants.items()}
    check = {"draws": args.check_draws, "grad_rel_diff": [], "delta_rel_diff": []}
    snaps = {"fresh": snap_fresh, "warm": snap_warm}
    use(trainer, cfg["grpo"])
    seqs_full = b.full_sequences(trainer)
    for s, snap in snaps.items():  # the full batch
        delta, rec, _ = trainer_update(trainer, seqs_full, snap)
        check["grad_rel_diff"].append(rel(rec.grads[0], g_full))
        check["delta_rel_diff"].append(rel(delta, adamw_delta(clip_rows(g_full[None], max_norm), theta,
                                                             states[s], hp)[0]))
    use(trainer, cfg["dppo"])
    for m in range(args.check_draws):  # DPPO draws
        seqs, u = b.draw_sequences(trainer, m)
        g_draw = u.float() @ g_items
        for s, snap in snaps.items():
            delta, rec, _ = trainer_update(trainer, seqs, snap)
            check["grad_rel_diff"].append(rel(rec.grads[0], g_draw))
            check["delta_rel_diff"].append(rel(delta, adamw_delta(clip_rows(g_draw[None], max_norm), theta,
                                                                 states[s], hp)[0]))
    check["vectorised_vs_torch_adamw"] = {}
    check["max_grad_rel_diff"] = max(check["grad_rel_diff"])
    check["max_delta_rel_diff"] = max(check["delta_rel_diff"])
    log(f"(b) trainer check: gradient {check['max_grad_rel_diff']:.2e}, update {check['max_delta_rel_diff']:.2e}")
    acc = {name: Accumulator(ref[name], GROUPS, args.update_draws) for name in variants}
    clip_flags = []
    for s0 in range(0, args.update_draws, args.chunk):
        grads = u0[s0 : s0 + args.chunk].float() @ g_items
        clipped = clip_rows(grads, max_norm)
        clip_flags += (grads.norm(dim=1) > max_norm).tolist()
        for name, (s, clip) in variants.items():
            delta = adamw_delta(clipped if clip else grads, theta, states[s], hp)
            if s0 == 0:  # the vectorised arithmetic against torch.optim.AdamW itself, on the first chunk
                ref_delta = torch_adamw_delta(clipped if clip else grads, theta, states[s], hp)
                check["vectorised_vs_torch_adamw"][name] = max(rel(x, y) for x, y in zip(delta, ref_delta, strict=True))
            acc[name].add(delta)
        del grads, clipped
    update_report = {"draws": args.update_draws, "clip_rate_in_these_draws": statistics.fmean(clip_flags),
                     "variants": {name: a.result() for name, a in acc.items()}, "trainer_check": check,
                     "full_update_norm": {name: float(r.norm()) for name, r in ref.items()}}
    del acc
    for name, r in update_report["variants"].items():
        log(f"(b) {name}: {r['rel_error_of_mean']:.4f} (noise {r['rel_noise_floor']:.4f}), bias "
            f"{r['rel_bias_corrected']:.4f} ± {r['rel_bias_corrected_se']:.4f}, cos {r['cos_mean_vs_ref']:.4f}")
    timings["update_s"] = time.perf_counter() - t
    del g_items

    # (c) clipping on more batches
    t = time.perf_counter()
    for i in range(1, args.clip_batches):
        use(trainer, cfg["grpo"])
        bi = Batch(trainer, i, args.prompts)
        batches.append(bi)
        k = gram(per_completion_grads(trainer, bi))
        use(trainer, cfg["dppo"])
        u = torch.stack([bi.draw(trainer, m)[2] for m in range(args.gram_draws)])
        clip_reports.append(gram_analysis(u, k, max_norm))
        log(f"(c) batch {i}: {bi.info()}; GRPO norm {clip_reports[-1]['grpo_grad_norm']:.3f}, DPPO clip rate "
            f"{clip_reports[-1]['dppo_clip_rate']:.4f}")
    timings["clip_batches_s"] = time.perf_counter() - t
    clipping = {"batches": clip_reports, "summary": {
        "batches": len(clip_reports), "grpo_clipped_batches": sum(c["grpo_clipped"] for c in clip_reports),
        "dppo_clip_rate_mean": statistics.fmean(c["dppo_clip_rate"] for c in clip_reports),
        "grpo_grad_norm_mean": statistics.fmean(c["grpo_grad_norm"] for c in clip_reports)}}

    # (d) the second epoch, through the trainer's update with num_iterations = 2
    t = time.perf_counter()
    use(trainer, cfg2["grpo"])
    seqs_full = b.full_sequences(trainer)
    _, rec_full, _ = trainer_update(trainer, seqs_full, snap_warm)
    g1_full, g2_full, theta1_full = rec_full.grads[0], rec_full.grads[1], rec_full.params[1]
    use(trainer, cfg2["dppo"])
    n2, dim = args.epoch2_draws, theta.numel()
    g1s, g2s = torch.zeros(n2, dim), torch.zeros(n2, dim)  # every draw's gradient of epochs 1 and 2 (pre-clip)
    theta_dist, e2_clip = [], []
    step_full = float((theta1_full.double() - snap_warm.params.double()).norm())
    for m in range(n2):
        seqs, _ = b.draw_sequences(trainer, m)
        if not len(seqs):  # every prompt pruned: the estimate is 0 in both epochs
            continue
        _, rec, _ = trainer_update(trainer, seqs, snap_warm)
        g1s[m], g2s[m] = rec.grads[0], rec.grads[1]
        theta_dist.append(float((rec.params[1].double() - theta1_full.double()).norm()) / step_full)
        e2_clip.append([n > max_norm for n in rec.norms])
    res = {"epoch1": draw_stats(g1s, g1_full), "epoch2": draw_stats(g2s, g2_full)}
    del g1s, g2s
    second = {"draws": n2, **res, "full_epoch2_vs_epoch1": rel(g2_full, g1_full),
              "full_grad_norms": rec_full.norms,
              "theta1_rel_distance_median": statistics.median(theta_dist) if theta_dist else None,
              "clip_rate_epoch1": statistics.fmean(c[0] for c in e2_clip),
              "clip_rate_epoch2": statistics.fmean(c[1] for c in e2_clip)}
    for name, r in res.items():
        log(f"(d) {name}: {r['rel_error_of_mean']:.4f} (noise {r['rel_noise_floor']:.4f}), bias "
            f"{r['rel_bias_corrected']:.4f} ± {r['rel_bias_corrected_se']:.4f}, z {r['z']:.2f}")
    timings["second_epoch_s"] = time.perf_counter() - t

    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ENV_KEYS if k in os.environ)
    d = cfg["dppo"]
    report = {
        "command": f"{env} .venv/bin/python benchmarks/update_bias.py {shlex.join(sys.argv[1:])}".strip(),
        "setup": {"preset": args.preset, "seed": args.seed, "warm_steps": args.warm_steps, "warm_log": warm_log,
                  "model": trainer.model_path, "parameters": int(theta.numel()), "beta": d.beta,
                  "lr": hp["lr"], "betas": list(hp["betas"]), "eps": hp["eps"], "weight_decay": hp["weight_decay"],
                  "max_grad_norm": max_norm,
                  "dppo": {k: getattr(d, k) for k in ("prompt_prune_rate", "prompt_scheme", "completion_prune_rate",
                                                      "completion_scheme", "min_prompt_keep_prob",
                                                      "min_completion_keep_prob", "fixed_size_sampling",
                                                      "drop_zero_advantage", "packing", "max_tokens_per_row")},
                  "grpo": {"pruning": cfg["grpo"].pruning, "packing": cfg["grpo"].packing}},
        "batches": [bb.info() for bb in batches],
        "gradient": grad_report,
        "update": update_report,
        "clipping": clipping,
        "cpu_full_logs": cpu_full_clipping(args.logs),
        "second_epoch": second,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "notes": [],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, args.output.with_suffix(".md"))
    log(f"wrote {args.output} and {args.output.with_suffix('.md')} in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
