"""DPPO on verl: prompt and completion pruning through verl's own extension points.

DPPO here is Dynamic Pruning Policy Optimization: prompts are pruned before rollout, completions after
reward, and each kept completion is weighted 1 / (π_q p_qi) with a normaliser C = |B|·G fixed before the
draws, so that the loss and its gradient at the step's parameters are unbiased estimates of full-batch
GRPO's (not the optimizer's update). It is NOT Divergence PPO (arXiv 2602.04879), which verl ships as the
policy losses ``dppo_tv`` and ``dppo_kl`` and TRL as ``trl.experimental.dppo``: the names registered here
(:data:`POLICY_LOSS`, :data:`ADV_ESTIMATOR`) avoid the ``dppo`` prefix for that reason.

What this module adds to verl (importing it registers the first two; ``VERL_USE_EXTERNAL_MODULES`` makes
every verl process import a module that does, see examples/verl/):

1. the policy loss :data:`POLICY_LOSS` (``actor_rollout_ref.actor.policy_loss.loss_mode``): verl's clipped
   surrogate (``vanilla``: dual clip included), aggregated as a sum over sequences divided by the fixed C,

       seq-mean-token-mean:      L = (dp_size / C)       Σ_rows mean_t l_t      (our ``loss_type: grpo``)
       seq-mean-token-sum-norm:  L = (dp_size / (C·L))   Σ_rows Σ_t l_t         (``dr_grpo``, L fixed)

   with C = ``global_batch_info["global_batch_size"]``, which verl's v1 trainer sets to the configured
   ``actor.ppo_mini_batch_size × rollout.n`` (a constant, never the number of rows left) and ``dp_size``
   undoing the data-parallel gradient average. verl's default ``token-mean`` divides by the tokens present,
   a ratio estimator under pruning, and is refused; so is a missing C (verl's ``agg_loss`` would then fall
   back to the rows present). Each row's weight w enters through its advantage (A·w): verl's surrogate is
   positively homogeneous in A (its clipping, dual clip included, reads only A's sign), so this is exact;
2. the advantage estimator :data:`ADV_ESTIMATOR` (``algorithm.adv_estimator``): verl's own GRPO outcome
   advantage over whole groups, then the :func:`install`-ed estimator's ``weigh`` on them: kept rows get
   A·w, dropped rows A = 0 (masked: their loss and gradient are exactly 0, but verl still runs them through
   the update, so completion pruning saves no compute on verl). Under verl's stock ``sync`` trainer it prunes
   completions only;
3. prompt pruning before rollout: :func:`select_prompt_rows`, which
   :class:`dppo_core.integrations.verl_trainer.DPPOSyncTrainer` (``trainer.v1.trainer_mode`` =
   :data:`TRAINER_MODE`, registered in verl's trainer registry) calls on each step's candidates. It records
   each kept prompt's π_q under verl's uid, and :data:`ADV_ESTIMATOR` weighs those groups with it and updates
   the prompt history. :func:`select_prompts` and :func:`weigh_rollouts` are the same two steps on a
   ``DataProto``, for a driver loop of one's own;
4. :func:`check_config`: refuses a verl config under which the pruned loss would be biased, or whose
   ``rollout.n`` is not the G the estimator was installed with (every group would be dropped as failed) or,
   under the posterior prompt scheme, the estimator's own ``group_size``.

Only the loss and its gradient at the parameters of the draw are unbiased (DESIGN.md §4): not AdamW's
update, gradient clipping, nor a second PPO epoch (``ppo_epochs > 1``) or a second mini-batch, whose
parameters depend on the draw. Departures from verl's GRPO, and why:

1. One optimizer step per rollout batch (``ppo_mini_batch_size == data.train_batch_size``): verl's loss of
   a mini-batch divides by the mini-batch's configured size, which is |B|·G only when it is the whole batch.
2. ``actor.use_kl_loss`` is refused: verl adds the KL term outside the policy loss, unweighted over the rows
   present. ``algorithm.use_kl_in_reward`` (the KL penalty inside the rewards) is fine: it is in the rewards
   before any pruning.
3. ``algorithm.filter_groups`` (DAPO's dynamic sampling) is refused: it refills the batch, which changes B.
4. The entropy bonus (``entropy_coeff``) acts on the rows present, unweighted: outside the claim (a warning).
5. Under verl's stock trainer the :data:`ADV_ESTIMATOR` path counts its own steps (one per call), and the
   count restarts at 0 when verl resumes. Under :data:`TRAINER_MODE` the step is verl's global step and the
   prompt history is saved with verl's checkpoints, so a resumed run draws as an uninterrupted one would.

Written against verl==0.9.1 (``verl.protocol.DataProto``, ``verl.trainer.ppo.core_algos``); imports only
the torch-level part of dppo_core (estimator, pruning, history, grpo, config), so it runs beside verl's pins.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

try:
    from verl import DataProto  # type: ignore[import-not-found, unused-ignore]
    from verl.trainer.ppo import core_algos  # type: ignore[import-not-found, unused-ignore]
except ImportError as exc:  # verl is not a dependency of dppo_core
    raise ImportError("dppo_core.integrations.verl needs verl (tested with verl==0.9.1; "
                      "see examples/verl/)") from exc

from dppo_core.estimator import Estimator, PromptPruning, Selection, Weighting
from dppo_core.registry import ROLLOUT_PLANS

__all__ = ["ADV_ESTIMATOR", "POLICY_LOSS", "SUPPORTED_LOSS_AGG_MODES", "TRAINER_MODE", "check_config",
           "dropped_groups", "dynamic_pruning_advantage", "dynamic_pruning_policy_loss", "install",
           "installed_estimator", "select_prompt_rows",
           "select_prompts", "weigh_rollouts"]

POLICY_LOSS = "dynamic_pruning"
ADV_ESTIMATOR = "grpo_dynamic_pruning"
#: ``trainer.v1.trainer_mode`` of :class:`dppo_core.integrations.verl_trainer.DPPOSyncTrainer` (prompt
#: pruning)
TRAINER_MODE = "dppo_sync"
#: verl's ``loss_agg_mode`` values with a per-sequence loss, aggregated here over the fixed C
SUPPORTED_LOSS_AGG_MODES = ("seq-mean-token-mean", "seq-mean-token-sum-norm")
PROMPT_PROB = "dppo_prompt_prob"  # non-tensor column: π_q of the row's prompt (select_prompts)
WINDOW = "dppo_window"  # non-tensor column: |B|, the candidate prompts of the row's step


# --- the loss: verl's clipped surrogate over the fixed normaliser C -----------------------------------------
@core_algos.register_policy_loss(POLICY_LOSS)
def dynamic_pruning_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean",
                                config: Any = None, rollout_is_weights: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``vanilla`` clipped surrogate summed over rows and divided by the fixed C (module docstring).

    Same arguments as verl's policy losses; ``advantages`` (rows, T) carry each kept row's weight (A·w).
    """
    if loss_agg_mode not in SUPPORTED_LOSS_AGG_MODES:
        raise ValueError(f"policy loss {POLICY_LOSS!r}: loss_agg_mode={loss_agg_mode!r} divides by a count "
                         f"of what is left after pruning; use one of {SUPPORTED_LOSS_AGG_MODES} "
                         "('seq-mean-token-mean' is dppo_core's loss_type grpo)")
    if config is None:
        raise ValueError(f"policy loss {POLICY_LOSS!r} needs verl's actor config "
                         "(its global_batch_info holds C)")
    info = config.global_batch_info
    c = info.get("global_batch_size")
    if not c:
        raise ValueError(f"policy loss {POLICY_LOSS!r}: global_batch_info has no global_batch_size, the "
                         "fixed normaliser C (verl's v1 trainer sets it to actor.ppo_mini_batch_size × "
                         "rollout.n); without it verl would divide by the rows left after pruning")
    mask = response_mask.to(advantages.dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        per_row = 1.0 / (float(c) * mask.sum(-1).clamp(min=1.0))  # (rows,)
    else:
        horizon = info.get("loss_scale_factor")
        if not horizon:
            raise ValueError(f"policy loss {POLICY_LOSS!r} with seq-mean-token-sum-norm needs "
                             "actor.loss_scale_factor (e.g. the response length): verl's default, the padded "
                             "width, depends on what was kept")
        per_row = torch.full(mask.shape[:1], 1.0 / (float(c) * float(horizon)), dtype=advantages.dtype,
                             device=advantages.device)
    # the surrogate is positively homogeneous in A, so a row's factor moves into its advantage exactly, and
    # verl's "token-sum" (times dp_size) then gives (dp_size / C) Σ_rows w · (the row's token mean or sum / L)
    return core_algos.compute_policy_loss_vanilla(old_log_prob, log_prob, advantages * per_row[:, None],
                                                  response_mask, "token-sum", config, rollout_is_weights)


# --- the weights: estimator.weigh over groups of rows ------------------------------------------------------
def _groups(keys: Sequence[Any]) -> dict[Any, list[int]]:
    """Row positions of each group key, in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    return groups


def _row_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One advantage per row from verl's (rows, T) outcome advantages (the row's scalar times its mask)."""
    mask = response_mask.to(torch.float64)
    return (advantages.to(torch.float64) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@dataclass
class RowWeights:
    """What a step trains on, per row of verl's batch: keep mask, weights, C, and the estimator's
    Weighting."""

    keep: torch.Tensor  # (rows,) bool
    weights: torch.Tensor  # (rows,) float64: 1 / (π_q p_qi) where kept, 0 where dropped
    num_sequences: int  # C = |B|·G
    weighting: Weighting  # the (P, G) result, groups in order of first appearance


def weigh_rows(advantages: torch.Tensor, groups: dict[Any, list[int]], estimator: Estimator, step: int,
               selection: Selection, lengths: torch.Tensor | None = None) -> RowWeights:
    """``estimator.weigh`` on per-row ``advantages`` (rows,) whose groups (each G rows) are ``groups``'
    values, in the order of ``selection``; ``lengths`` (rows,) for the ``length`` completion scheme."""
    if estimator.needs_rewards:
        raise ValueError(f"the {estimator.name!r} estimator replaces the advantages, which verl computes "
                         "itself: run it with dppo_core's DPPOTrainer")
    rows = torch.tensor(list(groups.values()), dtype=torch.long)  # (P, G); a ragged list raises here
    extra: dict[str, torch.Tensor] = {}
    if estimator.needs_lengths and lengths is not None:
        extra["lengths"] = lengths[rows]
    weighting = estimator.weigh(advantages[rows], selection, step, **extra)
    n = advantages.shape[0]
    keep = torch.zeros(n, dtype=torch.bool)
    weights = torch.zeros(n, dtype=torch.float64)
    keep[rows.flatten()] = weighting.keep.flatten()
    weights[rows.flatten()] = torch.where(weighting.keep, weighting.weights, 0.0).flatten()
    return RowWeights(keep, weights, weighting.num_sequences, weighting)


def _check_group_sizes(groups: dict[Any, list[int]], group_size: int | None) -> None:
    sizes = {len(rows) for rows in groups.values()}
    if len(sizes) > 1 or (group_size is not None and sizes and sizes != {group_size}):
        raise ValueError(f"DPPO on verl: every prompt needs the same number of completions G"
                         f"{'' if group_size is None else f' (= {group_size})'}, got group sizes "
                         f"{sorted(sizes)}")


# --- the driver hooks, on verl's DataProto ------------------------------------------------------------------
def _column(batch: Any, key: str) -> list[str]:
    """The column ``key`` of a ``DataProto`` (its non-tensor columns) or a ``TensorDict``, as strings."""
    columns = batch.non_tensor_batch if isinstance(batch, DataProto) else batch
    if key not in columns.keys():
        raise ValueError(f"DPPO on verl: the batch has no column {key!r}; columns: {sorted(columns.keys())}")
    return [str(v) for v in columns[key]]


def prompt_ids(batch: Any, id_key: str = "index") -> list[str]:
    """The prompts' ids (the history's keys) from the column ``id_key`` of a ``DataProto`` (non-tensor) or a
    ``TensorDict`` (verl's RL dataset: ``index``, from each row's ``extra_info.index``, 0 when absent); raises
    if they repeat within the batch."""
    ids = _column(batch, id_key)
    if len(set(ids)) != len(ids):
        raise ValueError(f"DPPO on verl: prompt ids in column {id_key!r} repeat within one batch "
                         f"({ids[:8]}...); give every dataset row a distinct extra_info.index")
    return ids


def select_prompts(batch: DataProto, estimator: Estimator, step: int, *, id_key: str = "index",
                   size: int | None = None) -> tuple[DataProto, Selection]:
    """Before rollout: the sub-batch of ``batch`` (a ``DataProto`` of candidate prompts, one row each) to roll
    out, and the :class:`Selection`. Each kept row gets π_q and |B| as non-tensor columns, which verl's
    ``repeat`` and ``union`` carry to its completions for :func:`weigh_rollouts`."""
    ids = prompt_ids(batch, id_key)
    selection = estimator.select(ids, step, size=len(ids) if size is None else size)
    kept = batch.select_idxs(torch.tensor(selection.indices, dtype=torch.long))
    kept.meta_info = dict(kept.meta_info)  # select_idxs shares the dict with the full batch
    kept.non_tensor_batch[PROMPT_PROB] = selection.probs.numpy().astype(np.float64)
    kept.non_tensor_batch[WINDOW] = np.full(len(selection.indices), selection.window, dtype=np.int64)
    return kept, selection


def weigh_rollouts(batch: DataProto, estimator: Estimator, step: int, *, id_key: str = "index",
                   group_size: int | None = None) -> tuple[DataProto, RowWeights]:
    """After verl's ``compute_advantage``: ``batch`` (a ``DataProto``, G rows per rolled-out prompt, any
    order, with ``advantages``, ``response_mask``, ``token_level_rewards`` and the columns
    :func:`select_prompts` added) less the completions not kept, with each kept row's ``advantages`` times its
    weight w; the history is updated (``estimator.observe``). ``meta_info["dppo_num_sequences"]`` is C, which
    must equal verl's ``ppo_mini_batch_size × rollout.n`` (:func:`check_config`)."""
    ids = [str(v) for v in batch.non_tensor_batch[id_key]] if id_key in batch.non_tensor_batch else None
    if ids is None or PROMPT_PROB not in batch.non_tensor_batch:
        raise ValueError(f"weigh_rollouts needs the non-tensor columns {id_key!r} and {PROMPT_PROB!r}: "
                         "select the prompts with select_prompts and let verl carry its columns to the "
                         "completions")
    groups = _groups(ids)
    _check_group_sizes(groups, group_size)
    first = [rows[0] for rows in groups.values()]
    probs = torch.as_tensor(np.asarray(batch.non_tensor_batch[PROMPT_PROB], dtype=np.float64)[first])
    window = int(np.asarray(batch.non_tensor_batch[WINDOW])[first[0]]) if first else 0
    selection = Selection(list(range(len(first))), probs, window)
    mask = batch.batch["response_mask"]
    adv = _row_advantages(batch.batch["advantages"], mask)
    rewards = batch.batch["token_level_rewards"].sum(-1).to(torch.float64)
    out = weigh_rows(adv, groups, estimator, step, selection, mask.sum(-1))
    rows = torch.tensor(list(groups.values()), dtype=torch.long)
    estimator.observe(list(groups), rewards[rows], adv[rows], step)
    kept_rows = out.keep.nonzero().flatten()
    kept = batch.select_idxs(kept_rows)
    kept.meta_info = {**kept.meta_info, "dppo_num_sequences": out.num_sequences}
    scale = out.weights[kept_rows].to(kept.batch["advantages"].dtype)[:, None]
    kept.batch["advantages"] = kept.batch["advantages"] * scale
    return kept, out


# --- the advantage estimator, for verl's own trainer (completion pruning, masked) --------------------------
@dataclass
class _Installed:
    estimator: Estimator | None = None
    group_size: int | None = None
    step: int = 0  # the next draw's step (verl's own trainer: counted here, one per advantage call)
    #: the prompts :func:`select_prompt_rows` sent to rollout and whose advantages are not yet computed:
    #: verl's uid of the prompt -> (the prompt's id in the history, π_q)
    selected: dict[str, tuple[str, float]] = field(default_factory=dict)
    window: int = 0  # |B| of the step that selected them
    selected_step: int = 0  # that step (verl's global step)
    failed_groups: int = 0  # drawn groups that came back with fewer than G completions (dropped), so far
    lost_groups: int = 0  # drawn groups that never came back (no row at all), so far


_INSTALLED = _Installed()


def installed_estimator() -> Estimator | None:
    """The estimator :func:`install` put in place in this process (``None`` before any call)."""
    return _INSTALLED.estimator


def dropped_groups() -> tuple[int, int]:
    """How many drawn prompt groups the installed estimator dropped so far in this process: ``(failed,
    lost)``, the groups that came back with fewer than G completions and those that never came back (each
    warned about when it happens). A trainer reads them before and after a step for that step's counts."""
    return _INSTALLED.failed_groups, _INSTALLED.lost_groups


def _prunes_prompts(estimator: Estimator | None) -> bool:
    return isinstance(estimator, PromptPruning) and estimator.prunes_prompts()


def install(estimator: Estimator, group_size: int, step: int = 0) -> None:
    """Make :data:`ADV_ESTIMATOR` weigh with ``estimator`` (in the process that computes advantages: verl's
    driver); ``group_size`` is ``rollout.n``; ``step`` the count of draws so far (verl's own trainer; under
    :data:`TRAINER_MODE` the step is verl's global step). An estimator that prunes prompts needs
    :data:`TRAINER_MODE` (:func:`check_config` says so); dense prompts are refused: verl's dataloader hands
    the trainer a fixed number of candidates per step. No rollout plan but the plain one runs on verl (a pilot
    is a plan of dppo_core's trainer: ``dppo_core.registry.ROLLOUT_PLANS``)."""
    if isinstance(estimator, PromptPruning) and estimator.dense_prompts:
        raise ValueError("dense_prompts on verl: its dataloader yields a fixed data.train_batch_size "
                         "candidates per step, so the window cannot look ahead; set dense_prompts false")
    plan = ROLLOUT_PLANS.get(estimator.rollout_plan)
    if plan is not None and not plan.verl:  # verl generates each group of rollout.n in one call of its own
        raise ValueError(f"rollout_plan {plan.name} on verl: its rollouts are its own, with no {plan.name} "
                         "plan; build the estimator from a config with rollout_plan auto and pilot_size 0 "
                         "(the plan runs in dppo_core's DPPOTrainer)")
    _INSTALLED.estimator, _INSTALLED.group_size, _INSTALLED.step = estimator, group_size, step
    _INSTALLED.selected, _INSTALLED.window = {}, 0


def select_prompt_rows(batch: Any, step: int, *, id_key: str = "index", full: bool = False) -> Any:
    """Before rollout, on verl's v1 trainer (:data:`TRAINER_MODE`): the rows of ``batch`` (a ``TensorDict`` of
    candidate prompts with verl's ``uid`` and ``id_key`` columns, as ``PPOTrainer._next_train_batch`` returns
    it) to roll out, drawn by the :func:`install`-ed estimator at ``step`` (verl's global step). Each kept
    prompt's π_q is recorded under its uid for :data:`ADV_ESTIMATOR`, which weighs its group once rolled out.
    ``full``: keep every row with π = 1 and record them in the current step (verl's refill of failed
    groups)."""
    from verl.utils import tensordict_utils as tu  # type: ignore[import-not-found, unused-ignore]

    estimator = _INSTALLED.estimator
    if estimator is None:
        raise ValueError("select_prompt_rows: no estimator installed (dppo_core.integrations.verl.install)")
    uids, ids = _column(batch, "uid"), prompt_ids(batch, id_key)
    if full:
        for uid, pid in zip(uids, ids, strict=True):
            _INSTALLED.selected[uid] = (pid, 1.0)
        return batch
    # verl's sync trainer consumes every group of a step within it: these never came back
    if _INSTALLED.selected:
        _INSTALLED.lost_groups += len(_INSTALLED.selected)
        warnings.warn(f"DPPO on verl: {len(_INSTALLED.selected)} prompt groups drawn before step {step} "
                      "never came back from rollout; their terms are missing from that step's "
                      "estimate", stacklevel=2)
        _INSTALLED.selected = {}
    selection = estimator.select(ids, step, size=len(ids))
    if not selection.indices:
        probs = estimator.prompt_probs(ids, step) if isinstance(estimator, PromptPruning) else torch.ones(1)
        raise RuntimeError(f"DPPO on verl: step {step} drew none of its {len(ids)} candidate prompts (keep "
                           f"probabilities {float(probs.min()):.3g} to {float(probs.max()):.3g}). The draw "
                           "is a function of the seed, the step and the history, so a resume repeats it: "
                           "raise min_prompt_keep_prob or data.train_batch_size, or set fixed_size_sampling "
                           "(which keeps about the sum of the probabilities every step)")
    _INSTALLED.selected = {uids[j]: (ids[j], float(p))
                           for j, p in zip(selection.indices, selection.probs.tolist(), strict=True)}
    _INSTALLED.window, _INSTALLED.selected_step = selection.window, step
    if len(selection.indices) == len(ids):
        return batch
    return tu.index_select_tensor_dict(batch, torch.tensor(selection.indices, dtype=torch.long))


def _weigh_selected(advantages: torch.Tensor, rewards: torch.Tensor, response_mask: torch.Tensor,
                    groups: dict[Any, list[int]], estimator: Estimator) -> torch.Tensor:
    """The factor of each row (rows,) for groups that :func:`select_prompt_rows` sent to rollout: w where
    kept, 0 where dropped; 1 for other rows (verl's padding), whose advantages must be 0. A drawn group that
    came back with fewer than G completions (verl keeps a group some of whose sessions failed) is dropped
    whole, counted and warned about: its term is missing from the estimate, as an all-failed group's is.
    Updates the history."""
    adv = _row_advantages(advantages, response_mask)
    drawn = {k: rows for k, rows in groups.items() if str(k) in _INSTALLED.selected}
    others = [r for k, rows in groups.items() if k not in drawn for r in rows]
    if others and adv[others].abs().sum() > 0:
        raise ValueError(f"{ADV_ESTIMATOR!r}: {len(others)} rows with non-zero advantages belong to no "
                         "prompt that select_prompt_rows sent to rollout (is trainer.v1.trainer_mode "
                         f"{TRAINER_MODE!r}?)")
    entries = {k: _INSTALLED.selected.pop(str(k)) for k in drawn}
    chosen = {k: rows for k, rows in drawn.items() if len(rows) == _INSTALLED.group_size}
    if len(chosen) < len(drawn):
        _INSTALLED.failed_groups += len(drawn) - len(chosen)
        sizes = sorted({len(rows) for k, rows in drawn.items() if k not in chosen})
        warnings.warn(f"DPPO on verl: {len(drawn) - len(chosen)} drawn groups came back with {sizes} "
                      f"completions instead of {_INSTALLED.group_size} (failed rollouts); dropped from this "
                      "step's estimate", stacklevel=2)
    factor = torch.zeros(adv.shape[0], dtype=torch.float64)
    factor[others] = 1.0
    if chosen:
        step = _INSTALLED.selected_step
        selection = Selection(list(range(len(chosen))), torch.tensor([entries[k][1] for k in chosen],
                              dtype=torch.float64), _INSTALLED.window)
        out = weigh_rows(adv, chosen, estimator, step, selection, response_mask.sum(-1))
        rows = torch.tensor(list(chosen.values()), dtype=torch.long)
        estimator.observe([entries[k][0] for k in chosen], rewards.to(torch.float64)[rows], adv[rows], step)
        kept_rows = rows.flatten()
        factor[kept_rows] = out.weights[kept_rows]
    return factor


@core_algos.register_adv_est(ADV_ESTIMATOR)
def dynamic_pruning_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                              index: np.ndarray, epsilon: float = 1e-6,
                              norm_adv_by_std_in_grpo: bool | None = None, config: Any = None,
                              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantages (``compute_grpo_outcome_advantage``, over whole groups), then each row's
    times its weight w: A·w where kept, 0 where dropped (a group of another size than G is verl's padding, and
    must have A = 0). Without :func:`install`, verl's GRPO advantages unchanged."""
    if norm_adv_by_std_in_grpo is None:
        norm_adv_by_std_in_grpo = (True if config is None
                                   else bool(config.get("norm_adv_by_std_in_grpo", True)))
    advantages, _ = core_algos.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index,
                                                              epsilon, norm_adv_by_std_in_grpo, config)
    estimator, g = _INSTALLED.estimator, _INSTALLED.group_size
    if estimator is None:
        return advantages, advantages
    groups = _groups(list(index))
    if any(str(k) in _INSTALLED.selected for k in groups):  # verl's v1 trainer under TRAINER_MODE
        factor = _weigh_selected(advantages, token_level_rewards.sum(-1), response_mask, groups, estimator)
        scaled = advantages * factor.to(advantages.dtype)[:, None]
        return scaled, scaled
    if _prunes_prompts(estimator):
        raise ValueError(f"{ADV_ESTIMATOR!r}: the installed estimator prunes prompts, which needs "
                         f"trainer.v1.trainer_mode={TRAINER_MODE} (dppo_core.integrations.verl_trainer) to "
                         "draw them before rollout; none of this batch's groups was drawn there")
    adv = _row_advantages(advantages, response_mask)
    padding = {k: rows for k, rows in groups.items() if len(rows) != g}
    if any(adv[rows].abs().sum() > 0 for rows in padding.values()):
        raise ValueError(f"{ADV_ESTIMATOR!r}: groups of sizes {sorted({len(r) for r in padding.values()})} "
                         f"with non-zero advantages, but rollout.n = {g} "
                         "(install(estimator, group_size=rollout.n))")
    groups = {k: rows for k, rows in groups.items() if k not in padding}
    step = _INSTALLED.step
    _INSTALLED.step += 1
    out = weigh_rows(adv, groups, estimator, step, Selection(list(range(len(groups))), torch.ones(len(groups),
                     dtype=torch.float64), len(groups)), response_mask.sum(-1))
    factor = out.weights.to(advantages.dtype)
    for rows in padding.values():  # verl's padding rows keep their (zero) advantages
        factor[rows] = 1.0
    scaled = advantages * factor[:, None]
    return scaled, scaled


# --- the config rules -------------------------------------------------------------------------------------
def check_config(config: Any, estimator: Estimator | None = None) -> int:
    """Raise ValueError where a composed verl config (``ppo_trainer`` and overrides) would bias DPPO's loss
    with ``estimator`` (default: the :func:`install`-ed one) or leave it nothing to train on; return
    C = data.train_batch_size × rollout.n, the normaliser the policy loss will divide by.

    ``rollout.n`` must be the G of :func:`install` (when ``estimator`` is the installed one):
    :data:`ADV_ESTIMATOR` drops a group of another size as failed, so a mismatch would zero every advantage,
    warning at each step. It must also be the estimator's own ``group_size`` where its posterior prompt scheme
    reads it (the next group's predicted passes, hence π_q: not a bias, but keep probabilities that score
    groups of the wrong size)."""
    actor = config.actor_rollout_ref.actor
    installed = estimator is None or estimator is _INSTALLED.estimator
    estimator = _INSTALLED.estimator if estimator is None else estimator
    n = int(config.actor_rollout_ref.rollout.n)
    trainer = config.trainer
    mode = trainer.v1.trainer_mode if trainer.get("use_v1", True) else "legacy (trainer.use_v1=false)"
    problems = []
    if _prunes_prompts(estimator) and mode != TRAINER_MODE:
        problems.append(f"trainer.v1.trainer_mode={mode}: the estimator prunes prompts, which needs "
                        f"trainer.v1.trainer_mode={TRAINER_MODE} "
                        "(import dppo_core.integrations.verl_trainer)")
    if mode == TRAINER_MODE:
        if trainer.v1.get("sync", {}).get("parameter_sync_step", 1) != 1:
            problems.append("trainer.v1.sync.parameter_sync_step: DPPO draws once per step (its trainer runs "
                            "as verl's sync trainer and reads that setting); leave it 1")
        sampler = trainer.v1.get("sampler", {})
        if (sampler.get("custom_sampler") or {}).get("path"):
            problems.append("trainer.v1.sampler.custom_sampler: DPPO's trainer needs verl's own replay "
                            "buffer, which waits for the drawn prompts' groups only")
        skip = config.get("skip") or {}
        if (skip.get("rollout_tq") or {}).get("enable", False):
            problems.append("skip.rollout_tq.enable: cached rollouts bypass DPPO's draw")
    g = _INSTALLED.group_size if installed and estimator is not None else None
    if g is not None and g != n:
        problems.append(f"actor_rollout_ref.rollout.n={n}, but the estimator was installed with "
                        f"group_size={g}: every group of {n} completions would be dropped as failed (all "
                        f"advantages 0); set rollout.n={g} or install(estimator, group_size=rollout.n)")
    posterior_g = (estimator.group_size_read() if estimator is not None else None) or n
    if _prunes_prompts(estimator) and posterior_g != n:
        problems.append(f"actor_rollout_ref.rollout.n={n}, but the estimator's group_size={posterior_g}: its "
                        "posterior prompt scheme would score each prompt's next group as that many "
                        f"completions; set its group_size={n} (= rollout.n)")
    if actor.policy_loss.loss_mode != POLICY_LOSS:
        problems.append(f"actor.policy_loss.loss_mode={actor.policy_loss.loss_mode!r}: set {POLICY_LOSS!r}")
    if actor.loss_agg_mode not in SUPPORTED_LOSS_AGG_MODES:
        problems.append(f"actor.loss_agg_mode={actor.loss_agg_mode!r}: one of {SUPPORTED_LOSS_AGG_MODES}")
    elif actor.loss_agg_mode == "seq-mean-token-sum-norm" and not actor.get("loss_scale_factor"):
        problems.append("actor.loss_scale_factor: set it (e.g. to data.max_response_length) for "
                        "seq-mean-token-sum-norm")
    if actor.ppo_mini_batch_size != config.data.train_batch_size:
        problems.append(f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}: set it to "
                        f"data.train_batch_size={config.data.train_batch_size} (one optimizer step per "
                        "rollout batch, C = |B|·G)")
    if actor.use_kl_loss:
        problems.append("actor.use_kl_loss=true: verl adds the KL term unweighted; set it false (use "
                        "algorithm.use_kl_in_reward for a KL penalty)")
    if config.algorithm.adv_estimator != ADV_ESTIMATOR:
        problems.append(f"algorithm.adv_estimator={config.algorithm.adv_estimator!r}: set {ADV_ESTIMATOR!r}")
    filter_groups = config.algorithm.get("filter_groups")
    if filter_groups is not None and filter_groups.get("enable", False):
        problems.append("algorithm.filter_groups.enable=true: DAPO's refill changes the candidate batch B")
    if problems:
        raise ValueError("verl config does not fit DPPO's pruning:\n  " + "\n  ".join(problems))
    if mode == TRAINER_MODE and trainer.v1.get("sampler", {}).get("sync_refill_failed_groups", False):
        warnings.warn("trainer.v1.sampler.sync_refill_failed_groups: refilled prompts are rolled out whole "
                      "(π = 1) on top of the window, outside DPPO's unbiasedness claim", stacklevel=2)
    if actor.get("entropy_coeff", 0):
        warnings.warn("actor.entropy_coeff != 0: verl's entropy bonus acts on the kept rows unweighted, "
                      "outside DPPO's unbiasedness claim", stacklevel=2)
    return int(config.data.train_batch_size) * n
