"""DPPO on Hugging Face TRL: :class:`DPPOGRPOTrainer`, TRL's ``GRPOTrainer`` with pruning.

DPPO here is Dynamic Pruning Policy Optimization: prompts are pruned before rollout, completions after
reward, and each kept completion is weighted 1 / (π_q p_qi) so that the loss and its gradient at the step's
parameters are unbiased estimates of full-batch GRPO's (for the loss types below; not the optimizer's update).
It is NOT Divergence PPO (arXiv 2602.04879), which TRL (``trl.experimental.dppo``) and verl also call "DPPO".

    from trl import GRPOConfig
    from dppo_core.estimator import make_estimator
    from dppo_core.integrations.trl import DPPOGRPOTrainer

    trainer = DPPOGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., loss_type="grpo"),
                              train_dataset=..., processing_class=tokenizer, estimator=make_estimator(config))
    trainer.train()

Each generation batch (TRL's ``generation_batch_size`` rows, over all processes: P distinct prompts, G
consecutive rows each):

1. before generation, ``estimator.select(ids, step, size=P)`` picks the prompts to roll out (a prompt's id
   is its row's ``id`` column, else its prompt as JSON); only those reach TRL's generation, reward
   functions and group advantages;
2. after them, ``estimator.weigh(A, selection, step)`` on the (P_kept, G) advantages gives a keep mask,
   weights w and the normaliser C (|B|·G for ``dppo``); completions not kept are dropped from the batch;
3. ``estimator.observe(...)`` records every rolled-out prompt's rewards and advantages; the estimator's
   state (and ``estimator_step``) is saved in each TRL checkpoint as ``dppo_estimator.json`` and restored
   on ``train(resume_from_checkpoint=...)``;
4. the loss summed over the micro-batches of one generation batch is (1/C) Σ_kept w_qi ℓ_qi(θ) (times
   steps_per_generation / gradient_accumulation_steps when these differ, as in TRL).

Loss types. ℓ_qi is TRL's loss of one completion; the supported types (:data:`SUPPORTED_LOSS_TYPES`)
divide by a count of sequences, which becomes the constant C fixed before the draws, so at parameters
fixed before the draws the loss and its gradient are unbiased estimates of GRPOTrainer's on the whole
window (KL term included):

* ``grpo``, ``sapo``: ℓ = the token mean of the completion's per-token loss;
* ``dr_grpo``: ℓ = its token sum / ``max_completion_length``;
* ``luspo``: ℓ = its token sum.

* ``dapo`` (TRL's default ``loss_type``): ℓ = its token sum, and the normaliser is the token count of every
  completion rolled out in the generation batch (TRL's ``num_items_in_batch``), counted before completion
  pruning, so it is fixed before the completion draw: with completion pruning only, the loss and its gradient
  are unbiased estimates of GRPOTrainer's dapo loss on the same rollout. With prompt pruning it would need the
  token count of completions never generated (the pruned prompts'), so a ``dapo`` run whose estimator prunes
  prompts is refused (a ValueError that says to use ``dr_grpo`` or ``prompt_prune_rate=0``), as dppo_core's
  own trainer refuses it.

``bnpo``, ``cispo`` and ``vespo`` divide by a count of tokens of the micro-batch (``bnpo``: it depends on
which completions are kept) or have no per-completion loss that a weight can scale (``cispo``, ``vespo`` weigh
the log-probabilities, not the ratio), so they raise a ValueError; ``dr_grpo`` is the constant-normaliser
counterpart.

As in :mod:`dppo_core.estimator`, only the loss and gradient at the parameters of the draw are unbiased:
not AdamW's update, gradient clipping, nor later PPO iterations (``num_iterations > 1``) or later
optimizer steps on the same generation batch.

Departures from TRL's GRPOTrainer, and why:

1. Several processes (``accelerate launch``; tested on CPU with DDP and FSDP2, see docs/scaling.md): the
   generation batch is gathered from every process, and the main process's selection and weighting are
   broadcast, so every process follows one draw with one normaliser C over the whole window. The kept
   prompts' rows are cut into equal consecutive slices, one a process, because TRL gathers rewards and
   slices advantages assuming equal counts; when G times the kept prompts is not a multiple of the number
   of processes N, copies of the first kept group are rolled out to fill the cut and dropped after the
   rewards (fewer than N / gcd(G, N) groups, none when N divides G; TRL's logged rewards and token counts
   include them). After completion pruning, each micro-batch is padded with rows of weight 0 and no
   completion tokens to the most rows any process holds in it (TRL's metrics gather per-row tensors, and
   DDP, FSDP and ZeRO need every process's forward and backward), and the loss is multiplied by N, as they
   average the processes' gradients. A micro-batch that keeps nothing anywhere still gets one such row a
   process, and a generation batch with every prompt pruned rolls out N / gcd(G, N) copies of its first group,
   all dropped, to make them: with ``steps_per_generation`` below ``gradient_accumulation_steps``, a window
   whose last micro-batch ran no model would never reduce its gradients across processes. The update then
   equals one process's on the same global batch.
2. Text prompts only (a NotImplementedError on image inputs): dropping completions would have to cut
   ``pixel_values`` by image grid, which is not row-aligned.
3. The KL term (beta > 0) is computed here, weighted per completion, as TRL computes it (k3, times the
   importance ratio when ``use_bias_correction_kl``); TRL adds it inside its per-token loss, where no
   per-completion weight can reach it. The policy term stays TRL's: each row's advantage is multiplied by
   its weight w (times the normaliser change), exact because the policy term is linear in a positive
   scale of A (and TRL's off-policy mask reads only its sign).
4. Micro-batches of a generation batch hold the kept rows split as evenly as possible (TRL's
   ``split_tensor_dict`` needs a multiple of ``steps_per_generation`` and drops the remainder), so
   ``_prepare_inputs`` is re-implemented for training; evaluation is TRL's, unpruned.
5. ``dense_prompts`` is refused (a ValueError): it looks past the candidate window, but TRL's sampler draws a
   fixed generation batch, which is the window. No rollout plan but the plain one runs here (TRL generates a
   group in one call): a pilot or dynamic sampling is a plan of dppo_core's trainer (``dppo_core.registry``).
   With prompt pruning, ``scale_rewards="batch"`` and ``multi_objective_aggregation="normalize_then_sum"`` are
   refused: their advantages use statistics of the whole rolled-out batch, which pruning changes.
6. TRL's entropy bonus, auxiliary (router) loss and ``top_entropy_quantile`` mask act on the kept rows of
   each micro-batch, unweighted (the router loss on the padding rows of departure 1 too): they are outside
   the unbiasedness claim, and TRL's logged KL and entropy are means over micro-batches, whose rows differ
   with the number of processes.
7. The estimator's ``step`` (its random draws and history ages) counts generation batches
   (``estimator_step``); under TRL's defaults it equals ``state.global_step``.

Written against TRL 1.16 (:data:`SUPPORTED_TRL`; the ``bench`` extra pins it, and importing this module with
another TRL raises an ImportError that says so); it overrides these GRPOTrainer internals:
``_prepare_inputs``, ``_generate_and_score_completions``, ``_calculate_rewards``,
``_get_per_token_logps_and_entropies``, ``_compute_loss``, ``_save_checkpoint`` and
``_load_optimizer_and_scheduler``.
"""

from __future__ import annotations

import json
import os
import warnings
from math import gcd
from typing import Any, cast

import torch

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # trl is an optional extra
    raise ImportError("dppo_core.integrations.trl needs Hugging Face TRL: "
                      "pip install 'dppo-core[bench]'") from exc
from accelerate.utils import broadcast_object_list, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.trainer.utils import shuffle_sequence_dict

from dppo_core.estimator import Estimator, PromptPruning, Weighting
from dppo_core.registry import ROLLOUT_PLANS

__all__ = ["DPPOGRPOTrainer", "ESTIMATOR_FILE", "SUPPORTED_LOSS_TYPES", "SUPPORTED_TRL", "check_trl_version",
           "prompt_id"]

#: The TRL releases (major, minor) this module is tested against: it overrides GRPOTrainer internals, which
#: change between minor releases. DPPO_TRL_UNTESTED=1 lets another release run, with a warning.
SUPPORTED_TRL = ((1, 16),)
SUPPORTED_TRL_PIN = "trl>=1.16,<1.17"


def check_trl_version(version: str) -> None:
    """Raise ImportError, in one line that says which releases work, unless ``version`` is a supported TRL."""
    parts = version.split(".")
    if tuple(int(p) if p.isdigit() else -1 for p in parts[:2]) in SUPPORTED_TRL:
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_TRL)
    message = (f"dppo_core.integrations.trl is tested with TRL {tested} and found trl {version}: "
               f"pip install '{SUPPORTED_TRL_PIN}' (or set DPPO_TRL_UNTESTED=1 to try this one)")
    if os.environ.get("DPPO_TRL_UNTESTED", "") not in ("", "0"):
        warnings.warn(message, stacklevel=3)
        return
    raise ImportError(message)


check_trl_version(trl.__version__)

SUPPORTED_LOSS_TYPES = ("grpo", "dr_grpo", "sapo", "luspo", "dapo")
ESTIMATOR_FILE = "dppo_estimator.json"  # in each checkpoint folder


def prompt_id(row: dict[str, Any]) -> str:
    """A dataset row's prompt id: its ``id`` column if present, else its prompt (text or messages) as JSON."""
    if row.get("id") is not None:
        return str(row["id"])
    return json.dumps(row["prompt"], sort_keys=True, default=str)


def _per_row(value: Any) -> bool:
    return isinstance(value, list) or (isinstance(value, torch.Tensor) and value.ndim > 0)


def _take_rows(batch: dict[str, Any], rows: list[int], n: int) -> dict[str, Any]:
    """The rows ``rows`` of every per-row value (first dimension ``n``) of ``batch``; others as they are."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == n:
            value = value[torch.tensor(rows, dtype=torch.long, device=value.device)]
        elif isinstance(value, list) and len(value) == n:
            value = [value[i] for i in rows]
        out[key] = value
    return out


def _part_sizes(n: int, chunks: int) -> list[int]:
    """The sizes of ``n`` rows cut into ``chunks`` consecutive parts differing by at most one row."""
    return [n * (i + 1) // chunks - n * i // chunks for i in range(chunks)]


def _split_rows(batch: dict[str, Any], chunks: int) -> list[dict[str, Any]]:
    """``batch`` in ``chunks`` consecutive parts of :func:`_part_sizes` (TRL's: all equal)."""
    bounds = [0]
    for size in _part_sizes(len(batch["completion_ids"]), chunks):
        bounds.append(bounds[-1] + size)
    parts = zip(bounds[:-1], bounds[1:], strict=True)
    return [{k: v[a:b] if _per_row(v) else v for k, v in batch.items()} for a, b in parts]


def _pad_rows(part: dict[str, Any], filler: dict[str, Any], count: int) -> dict[str, Any]:
    """``part`` with ``count`` copies of the one-row ``filler`` appended to each of its per-row values."""
    if count == 0:
        return part
    out = {}
    for key, value in part.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            value = torch.cat([value, filler[key].expand(count, *value.shape[1:])])
        elif isinstance(value, list):
            value = value + filler[key] * count
        out[key] = value
    return out


def _filler_row(batch: dict[str, Any], n: int, device: torch.device) -> dict[str, Any]:
    """The first of ``batch``'s ``n`` rows made a row that adds nothing to the loss (no completion tokens,
    advantage 0, weight 0): what :func:`_pad_rows` appends."""
    filler = _take_rows(batch, [0], n)
    filler["completion_mask"] = torch.zeros_like(filler["completion_mask"])
    filler["advantages"] = torch.zeros_like(filler["advantages"])
    filler["dppo_weights"] = torch.zeros(1, dtype=torch.float64, device=device)
    return filler


def padding_groups(num_groups: int, group_size: int, processes: int) -> int:
    """How many whole groups to add to ``num_groups`` kept ones so their rows split evenly over
    ``processes``."""
    pad = 0
    while (num_groups + pad) * group_size % processes:
        pad += 1
    return pad


class DPPOGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` training on the pruned, importance-weighted batch of ``estimator``.

    Takes GRPOTrainer's arguments plus ``estimator`` (a :class:`dppo_core.estimator.Estimator`; default
    ``Estimator()``: no pruning, TRL's loss). See the module docstring for what is supported.
    """

    # Attributes GRPOTrainer sets, as they are here (annotations only): TRL's Trainer types ``args`` as
    # TrainingArguments (GRPOTrainer's is a GRPOConfig) and ``model`` as optional (GRPOTrainer always has
    # one); GRPOConfig types num_generations as optional (GRPOTrainer needs it) and starts _buffered_inputs at
    # None.
    args: GRPOConfig
    model: torch.nn.Module
    num_generations: int
    # TRL's `= None` infers type None
    _buffered_inputs: list[dict[str, Any]] | None  # type: ignore[assignment]

    def __init__(self, *args: Any, estimator: Estimator | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.estimator = Estimator() if estimator is None else estimator
        self.estimator_step = 0  # generation batches drawn so far: the estimator's step
        self._rewards: torch.Tensor | None = None  # the last generation batch's rewards, for observe
        self._logps: torch.Tensor | None = None  # the last log-probs computed with grad, for the KL term
        # the kept rows each process trains on, of the last generation batch
        self._process_rows: list[int] = []
        self._filler: dict[str, Any] = {}  # a row that adds nothing to the loss (see _prepare_inputs)
        self._check_supported()

    def _check_supported(self) -> None:
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"DPPOGRPOTrainer: loss_type={self.loss_type!r} divides by a token count, which pruning "
                f"changes, so the pruned loss would not estimate the full batch's without bias. Use "
                f"loss_type='dr_grpo' (the same token-sum loss over a constant normaliser) or 'grpo'; "
                f"supported: {SUPPORTED_LOSS_TYPES}")
        if (self.loss_type == "dapo" and isinstance(self.estimator, PromptPruning)
                and self.estimator.prunes_prompts()):
            raise ValueError("DPPOGRPOTrainer: loss_type='dapo' (TRL's default) divides by the token count "
                             "of every completion of the generation batch, which with prompt pruning "
                             "includes completions never generated, so the pruned loss would be biased. Set "
                             "loss_type='dr_grpo' (a constant normaliser) or 'grpo' in GRPOConfig, or build "
                             "the estimator with prompt_prune_rate=0 "
                             "(completion pruning is exact under dapo)")
        if self.estimator.name == "pods":
            raise ValueError("DPPOGRPOTrainer: the pods estimator recomputes advantages over the kept "
                             "completions, which TRL's loss does not take from it; run pods with dppo_core's "
                             "DPPOTrainer")
        if isinstance(self.estimator, PromptPruning) and self.estimator.prunes_prompts() and (
                self.scale_rewards == "batch" or self.multi_objective_aggregation == "normalize_then_sum"):
            raise ValueError("DPPOGRPOTrainer: with prompt pruning, scale_rewards='batch' and "
                             "multi_objective_aggregation='normalize_then_sum' compute advantages from the "
                             "rolled-out prompts only; use scale_rewards='group' or 'none' and "
                             "'sum_then_normalize'")
        if self.estimator.drops_zero_advantage() and self.beta > 0:
            raise ValueError(f"DPPOGRPOTrainer: the estimator has beta=0 and drops completions with A = 0, "
                             f"but TRL's beta={self.beta} gives them a KL term, so dropping them would bias "
                             f"the loss; build the estimator with beta={self.beta} (make_estimator(config) "
                             "with the same beta) or drop_zero_advantage=False")
        plan = ROLLOUT_PLANS.get(self.estimator.rollout_plan)
        if plan is not None and not plan.trl:  # TRL generates each group in one call of its own
            raise ValueError(f"DPPOGRPOTrainer runs TRL's own rollouts, which have no {plan.name} plan (the "
                             "rollout_plan / pilot_size of the config the estimator was built from); build "
                             "it from a config with rollout_plan auto and pilot_size 0, or run the plan with "
                             "dppo_core's DPPOTrainer")
        size = cast(int, self.args.generation_batch_size) // self.num_generations  # GRPOConfig resolves it
        if self.estimator.num_candidates(size) != size:
            raise ValueError("DPPOGRPOTrainer does not support dense_prompts: it looks ahead past the "
                             "generation batch, but TRL's sampler draws a fixed generation_batch_size of "
                             "prompts; set dense_prompts=False (or run dense prompts with dppo_core's "
                             "DPPOTrainer)")

    # --- generation: prune prompts before it, completions after the rewards -------------------------------
    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        steps_per_generation = cast(int, self.args.steps_per_generation)  # GRPOConfig resolves it
        if self._step % (steps_per_generation * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = shuffle_sequence_dict(self._generate_and_score_completions(generation_batch))
            parts = _split_rows(batch, steps_per_generation)
            if self.accelerator.num_processes > 1:
                # every process trains on as many rows as the fullest one, in every micro-batch: TRL's metrics
                # gather per-row tensors, and DDP, FSDP and ZeRO need every process's forward and backward;
                # the padding rows have weight 0 and no completion tokens. A micro-batch empty everywhere (a
                # whole generation batch too) still gets one row: the backward of the last micro-batch of an
                # accumulation window is where DDP reduces the gradients across processes, and without it each
                # process steps on its own.
                sizes = [_part_sizes(n, steps_per_generation) for n in self._process_rows]
                most = [max(1, *column) for column in zip(*sizes, strict=True)]
                parts = [_pad_rows(part, self._filler, m - len(part["completion_ids"]))
                         for part, m in zip(parts, most, strict=True)]
            self._buffered_inputs = parts
        return self._buffered_inputs[self._step % steps_per_generation]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        g, step = self.num_generations, self.estimator_step
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        window = gather_object(inputs)  # the whole generation batch: every process's rows, in process order
        groups = [window[i:i + g] for i in range(0, len(window), g)]
        ids = [prompt_id(group[0]) for group in groups]
        selection = self._from_main(self.estimator.select(ids, step, size=len(ids)))
        self.estimator_step += 1
        kept = [row for i in selection.indices for row in groups[i]]
        self._metrics["train"]["dppo/prompts_kept"].append(len(selection.indices) / max(1, selection.window))
        if not kept and processes == 1:  # every prompt pruned: the estimate is 0
            self._process_rows = [0]
            return self._empty_batch(selection.window * g)
        real = len(kept)  # the kept prompts' rows; copies of a kept group follow, if needed to split evenly
        # (every prompt pruned on several processes: copies of the window's first group, all dropped, so that
        # each process has a row whose forward and backward run the model: see _prepare_inputs)
        copies = (padding_groups(len(selection.indices), g, processes) if kept
                  else processes // gcd(g, processes))
        kept += groups[selection.indices[0] if kept else 0] * copies
        share = len(kept) // processes
        batch = super()._generate_and_score_completions(kept[rank * share:(rank + 1) * share])
        if "pixel_values" in batch:
            raise NotImplementedError("DPPOGRPOTrainer supports text prompts only (see its departures)")
        # TRL computed the advantages over the gathered batch and kept this process's slice: gather them back
        advantages = (self.accelerator.gather(batch["advantages"].detach())[:real]
                      .to("cpu", torch.float64).view(-1, g))
        extra = {}
        if self.estimator.needs_lengths:  # completion_scheme="length": the tokens per completion
            lengths = self.accelerator.gather(batch["completion_mask"].sum(1).detach())
            extra["lengths"] = lengths[:real].to("cpu").view(-1, g)
        if real:
            weighting = self._from_main(self.estimator.weigh(advantages, selection, step, **extra))
            # set by _calculate_rewards, in the generation above (gathered by TRL)
            assert self._rewards is not None
            self.estimator.observe([ids[i] for i in selection.indices], self._rewards[:real].view(-1, g),
                                   advantages, step)
        else:  # as _empty_batch: nothing kept, the estimate is 0, C as for any draw of this window
            none = torch.zeros(0, g)
            weighting = Weighting(none.bool(), none.double(), selection.window * g)
        keep = torch.zeros(len(kept), dtype=torch.bool)  # (rows of every process,): the copies are never kept
        keep[:real] = weighting.keep.flatten()
        weights = torch.zeros(len(kept), dtype=torch.float64)
        weights[:real] = weighting.weights.flatten()
        self._process_rows = keep.view(processes, share).sum(1).tolist()
        mine = slice(rank * share, (rank + 1) * share)
        rows = keep[mine].nonzero().flatten().tolist()
        device = self.accelerator.device
        self._filler = _filler_row(batch, share, device)
        # the rolled-out prompts' completion tokens (the copies not counted): fixed before the completion
        # draw, and with no prompt pruned (refused otherwise) the whole batch's
        if self.loss_type == "dapo":
            mask = (batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch
                    else batch["completion_mask"])
            tokens = self.accelerator.gather(mask.sum(1).detach())[:real]
            batch["num_items_in_batch"] = tokens.sum().to(torch.float32)
        batch = _take_rows(batch, rows, share)
        batch["dppo_weights"] = weights[mine][rows].to(device)
        batch["dppo_normalizer"] = torch.tensor(float(weighting.num_sequences), dtype=torch.float64,
                                                device=device)
        if real:  # (as with one process, where a batch with no prompt kept is never rolled out)
            self._metrics["train"]["dppo/completions_kept"].append(int(keep.sum()) / real)
        return batch

    def _from_main(self, decision: Any) -> Any:
        """The main process's ``decision`` on every process: each computed it from the same gathered batch and
        history, and this makes them agree to the bit whatever their arithmetic."""
        return broadcast_object_list([decision], from_process=0)[0]

    def _empty_batch(self, num_sequences: int) -> dict[str, Any]:
        device = self.accelerator.device
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        return {"prompt_ids": empty, "prompt_mask": empty, "completion_ids": empty, "completion_mask": empty,
                "advantages": torch.zeros(0, device=device),
                "num_items_in_batch": torch.zeros((), device=device),
                "dppo_weights": torch.zeros(0, dtype=torch.float64, device=device),
                "dppo_normalizer": torch.tensor(float(num_sequences), dtype=torch.float64, device=device)}

    def _calculate_rewards(self, inputs: list[dict[str, Any]], prompts: list[Any], completions: list[Any],
                           completion_ids_list: list[list[int]]) -> torch.Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        weights = self.reward_weights.to(rewards_per_func.device)
        self._rewards = (rewards_per_func * weights).nansum(dim=1).detach().to("cpu", torch.float64)
        return rewards_per_func

    # --- the loss: (S / GA) · (1/C) Σ_kept w ℓ over the micro-batches of a generation batch ----------------
    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if torch.is_grad_enabled():  # the loss's forward (generation-time ones run without grad)
            self._logps = out[0]
        return out

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        weights = inputs.get("dppo_weights")
        if weights is None:  # evaluation: TRL's loss, nothing pruned
            return super()._compute_loss(model, inputs)
        n = weights.shape[0]
        if n == 0:  # every completion of this micro-batch was pruned, on every process: it adds 0
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        # TRL divides the micro-batch's sum over rows by n and by GA, and DDP, FSDP and ZeRO average the
        # processes' gradients; the step's loss is (S/GA)·(1/C)·Σ w ℓ over the kept rows of every process
        rows = n * cast(int, self.args.steps_per_generation) * self.accelerator.num_processes
        # dapo: TRL's own normaliser (the rolled-out tokens, set in _generate_and_score_completions) stays, so
        # each row's token sum is weighted by w alone; the others divide by C instead of the kept rows' count
        factor = weights if self.loss_type == "dapo" else weights * (rows / inputs["dppo_normalizer"])
        advantages = inputs["advantages"]
        scale = factor.to(advantages.dtype).view(-1, *[1] * (advantages.dim() - 1))
        beta, self.beta = self.beta, 0.0  # TRL's KL term, inside its per-token loss, is added below, weighted
        try:
            loss = super()._compute_loss(model, {**inputs, "advantages": advantages * scale})
        finally:
            self.beta = beta
        logps, self._logps = self._logps, None
        if beta != 0.0:
            assert logps is not None  # set by _get_per_token_logps_and_entropies, in the loss's forward above
            kl = self._kl_per_row(inputs, logps)
            if self.loss_type == "dapo":  # as TRL's dapo divides the step's token sum
                per_window = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
                steps = cast(int, self.args.steps_per_generation)
                divisor = per_window * self.current_gradient_accumulation_steps / steps
            else:
                divisor = n * self.current_gradient_accumulation_steps
            loss = loss + beta * (factor.to(kl.dtype) * kl).sum() / divisor
        return loss

    def _kl_per_row(self, inputs: dict[str, Any], logps: torch.Tensor) -> torch.Tensor:
        """Each row's KL term as TRL's ``loss_type`` aggregates it (k3, importance-corrected as TRL's)."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        d = inputs["ref_per_token_logps"] - logps
        kl = torch.exp(d) - d - 1
        if self.args.use_bias_correction_kl:
            old = inputs.get("old_per_token_logps")
            log_ratio = logps - (logps.detach() if old is None else old)
            if self.importance_sampling_level == "sequence":
                log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            kl = kl * torch.exp(log_ratio)
        totals = self.accelerator.reduce(torch.stack([(kl * mask).sum(), mask.sum().to(kl.dtype)]).detach(),
                                         "sum")
        self._metrics["train"]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        rows = (kl * mask).sum(-1)
        if self.loss_type in ("grpo", "sapo"):
            return rows / mask.sum(-1).clamp(min=1.0)
        if self.loss_type == "dr_grpo":
            return rows / self.max_completion_length
        return rows  # luspo, dapo: the token sum

    # --- checkpoints: the estimator's history travels with TRL's ------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            with open(os.path.join(self._get_output_dir(trial=trial), folder, ESTIMATOR_FILE), "w") as f:
                json.dump({"estimator_step": self.estimator_step,
                           "estimator": self.estimator.state_dict()}, f)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, ESTIMATOR_FILE)
        if path is not None and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.estimator.load_state_dict(state["estimator"])
            self.estimator_step = state["estimator_step"]
