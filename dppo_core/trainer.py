"""``DPPOTrainer``: the training step, and only the step (the loop is :meth:`dppo_core.run.Run.train`).

One step (:meth:`DPPOTrainer.train_step`), as data (docs/architecture.md, "One step"):

    candidates ──estimator.select──► kept prompts, π_q ──engine.generate (G each)──► completions
    completions ──reward functions──► rewards (P, G) ──group_advantages──► A (P, G) ──estimator.observe
    A ──estimator.weigh──► kept completions, weights 1/(π_q p_qi), normaliser C
    kept sequences ──layout (padded or packed) ──policy_loss × weights──► optimizer step ──engine.sync

Which prompts and completions are kept, and with what weight, is the estimator's business
(:mod:`dppo_core.estimator`, one class per ``pruning`` mode); how the kept prompts become rolled-out, rewarded
groups (one engine call, a pilot, a refill) is the rollout plan's (:mod:`dppo_core.plans`, ``self.plan``); the
trainer never asks which mode or plan it runs. What is not the step lives beside it: the run's life (output
directory, resume, checkpoints, logs, Ctrl-C, the evaluation schedule: :class:`dppo_core.run.Run`, which the
trainer is), prompts (:mod:`dppo_core.data`), the policy (:mod:`dppo_core.policy`), log-probs and micro-batch
layout (:mod:`dppo_core.logprobs`), data-parallel gathers (:mod:`dppo_core.distributed`) and evaluation
(:mod:`dppo_core.evaluate`).

Reproducibility: the prompts and the sampling seed of step ``s`` are functions of ``(seed, s)``, and a
checkpoint holds the weights, optimizer state, prompt history and step; so a run interrupted and resumed
from a checkpoint takes the same steps as one that was not (on CPU with ``deterministic=True``).

Departures from TRL's GRPOTrainer, and why:
1. One optimizer step per PPO epoch over the whole rollout batch (micro-batches accumulate
   gradients), instead of TRL's steps per micro-batch: the loss normaliser is then the full batch's
   (see :mod:`dppo_core.grpo`), which keeps the pruned estimator unbiased.
2. Old log-probs are computed only when ``num_iterations > 1``; with one epoch the ratio is 1.
3. The reference policy for the KL term is the LoRA base with its adapter disabled (no second model);
   only full fine-tuning keeps a frozen copy, and only when ``beta > 0``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from dppo_core.config import ConfigError, DPPOConfig, learning_rate_at
from dppo_core.data import PromptSource, build_prompt_source, check_prompt_lengths, prompt_key
from dppo_core.distributed import all_reduce_gradients, broadcast_parameters, from_main, job_layout_stats
from dppo_core.estimator import Selection, Weighting, make_estimator
from dppo_core.grouplog import group_record
from dppo_core.grpo import group_advantages, policy_loss
from dppo_core.history import PromptHistory
from dppo_core.logprobs import Sequences, engine_weights, layout_micro_batches
from dppo_core.metrics import STEP
from dppo_core.packing import attention_implementation
from dppo_core.plans import PromptSelection, RolledOut, make_plan
from dppo_core.policy import load_policy, load_reference, resolve_model_path
from dppo_core.pruning import effective_sample_size
from dppo_core.registry import samples_from_policy
from dppo_core.rollout import RolloutBatch, RolloutEngine, SamplingConfig
from dppo_core.run import Callback, PhaseTimer, Run
from dppo_core.shared_prefix import NAME as SEGMENTS

if TYPE_CHECKING:
    from peft import PeftModel

#: The phases of a step a :class:`~dppo_core.run.PhaseTimer` times (``time_<phase>`` in ``metrics.jsonl``).
PHASES = ("prune", "rollout", "reward", "update", "sync")
#: A step that trained nothing: its update statistics.
ZERO_STATS = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "update_rows": 0,
              "update_capacity": 0, "update_density": 0.0, "padding_avoided": 0, "time_pack": 0.0}


class Trained(NamedTuple):
    """A step's update, for its metrics line: the sequences, the kept completions' weights, the update's
    stats."""

    seqs: Sequences
    weights: torch.Tensor
    stats: dict[str, float]


def micro_batch_loss(config: DPPOConfig, seqs: Sequences, idx: Any, logprobs: torch.Tensor,
                     mask: torch.Tensor,
                     old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                     engine_weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss that :meth:`DPPOTrainer.update` backpropagates for the micro-batch ``idx`` of ``seqs``.

    Each sequence carries its weight, and the normalisers are the step's (``num_sequences`` = C for ``grpo``
    and ``dr_grpo``, every rolled-out completion token for ``dapo``), so the micro-batches' losses add up to
    the step's pruned loss L̂(θ) whatever the layout. ``engine_weights`` (N, T): the rollout correction's
    per-token factors (:func:`dppo_core.logprobs.engine_weights`), None when it is off.
    """
    c = config
    return policy_loss(logprobs, seqs.advantages[idx].to(logprobs.device), mask, old_logprobs=old_logprobs,
                       ref_logprobs=ref_logprobs, weights=seqs.weights[idx].to(logprobs.device), beta=c.beta,
                       epsilon=c.epsilon, epsilon_high=c.epsilon_high, loss_type=c.loss_type,
                       num_sequences=seqs.num_sequences, max_completion_length=c.max_completion_length,
                       num_tokens=seqs.global_rolled_out_tokens, token_weights=engine_weights)


class DPPOTrainer(Run):
    """Runs the training loop for a :class:`DPPOConfig`: a :class:`~dppo_core.run.Run` (output directory,
    resume, checkpoints, logs, Ctrl-C, the evaluation schedule, :meth:`~dppo_core.run.Run.train`) whose step
    is DPPO's.

    Args:
        config: the run's settings.
        reward_funcs: TRL-style reward functions ``fn(prompts, completions, **columns) -> list[float]``,
            summed; default: :func:`dppo_core.rewards.accuracy_reward` (1 if the boxed answer is right).
        callbacks: called with each step's metrics dict (and with ``{"event": "eval", ...}`` after each
            evaluation), e.g. to draw live curves in a notebook.
        prompt_source: override the prompts (default: from ``config.task``).

    The estimator (``self.estimator``, holding the prompt history) and the rollout plan (``self.plan``) are
    built once from ``config``; to prune differently mid-run, assign new ones (``trainer.estimator =
    make_estimator(new_config)``, ``trainer.plan = make_plan(new_config)``) and carry the history over
    (``trainer.history``). ``last_selection`` is the last step's selection as its plan drew it (dynamic
    sampling: the candidate stream its rounds chose from).
    """

    def __init__(self, config: DPPOConfig, *, reward_funcs: Sequence[Callable] | None = None,
                 callbacks: Sequence[Callback] = (), prompt_source: PromptSource | None = None,
                 progress: bool = True):
        from dppo_core.rewards import accuracy_reward

        super().__init__(config, callbacks=callbacks, progress=progress)
        self.reward_funcs = list(reward_funcs) if reward_funcs else [accuracy_reward]
        self.last_selection: PromptSelection | None = None  # the last step's prompt selection (rank 0's draw)
        self.model_path = resolve_model_path(config)
        self.model, self.tokenizer = load_policy(config, self.model_path, self.device)
        self.prompts = prompt_source or build_prompt_source(config)
        base_config = (cast("PeftModel", self.model).get_base_model() if hasattr(self.model, "get_base_model")
                       else self.model).config
        self.context_length = getattr(base_config, "max_position_embeddings", None)
        if self.context_length and config.max_completion_length >= self.context_length:
            raise ConfigError(f"max_completion_length={config.max_completion_length}: the model's context is "
                              f"{self.context_length} tokens, which must hold the prompt too; lower it")
        self.ref_model = load_reference(config, self.model_path, self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        broadcast_parameters(params, self.dist)  # every rank starts from rank 0's trainable weights
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(0.9, 0.99),
                                           weight_decay=config.weight_decay)
        self.estimator = make_estimator(config)  # which prompts and completions to keep, and their weights
        # how the kept prompts become rolled-out, rewarded groups (dppo_core.plans)
        self.plan = make_plan(config)
        self.engine: RolloutEngine | None = None
        self._prompt_lengths: dict[str, int] = {}

    @property
    def history(self) -> PromptHistory:
        """What each prompt's last rollouts showed (the estimator's; prompt pruning reads it)."""
        return self.estimator.history

    @history.setter
    def history(self, value: PromptHistory) -> None:
        self.estimator.history = value

    def run_state(self) -> dict[str, Any]:
        """What a checkpoint holds beside the weights: the estimator's state (its prompt history)."""
        return self.estimator.state_dict()

    def load_run_state(self, state: dict[str, Any]) -> None:
        self.estimator.load_state_dict(state)

    config: DPPOConfig  # the run's settings (the Run reads them as a RunConfig)
    run_state_file = "prompt_history.json"  # a checkpoint's file of run_state()

    def check_run_state(self, state: dict[str, Any]) -> None:
        PromptHistory.from_state_dict(state)  # raises ValueError on a damaged history

    # --- helpers ----------------------------------------------------------------------------------
    def _lr(self, step: int) -> float:
        return learning_rate_at(step, self.config)

    def make_engine(self):
        """The rollout engine of ``config.rollout_engine`` for this trainer's model."""
        from dppo_core.rollout import make_rollout_engine

        kind = self.config.rollout_engine
        # "vllm" demands vLLM (an error if it cannot start); "auto" falls back to transformers with a warning
        return make_rollout_engine(kind, model=self.model, tokenizer=self.tokenizer,
                                   model_path=self.model_path,
                                   require=kind == "vllm", seed=self.config.seed)

    def start(self) -> None:
        """Before the first step: the rollout engine (unless one was set), sampling from the current
        policy."""
        if self.engine is None:
            self.engine = self.make_engine()
        self.engine.sync(self.model)

    def rollout_correction_level(self) -> str | None:
        """The engine correction this trainer applies: ``"token"``, ``"sequence"`` or None
        (``rollout_correction``; ``auto`` is ``token`` for any engine but the transformers one, which samples
        from the policy itself)."""
        mode = self.config.rollout_correction
        if mode == "auto":
            return "token" if self.engine is not None and not samples_from_policy(self.engine.name) else None
        return None if mode == "off" else mode

    # --- the parts of one step --------------------------------------------------------------------
    def select_prompts(self, step: int, candidates: list[dict[str, Any]] | None = None) -> PromptSelection:
        """The step's candidate window and which of its prompts to roll out (the estimator's ``select``);
        ``candidates`` replaces the dataset's draw for this step (the window is then exactly these)."""
        k = self.config.prompts_per_step
        if candidates is None:
            stream = self.prompts.sample(self.config.seed, step, self.estimator.num_candidates(k))
            sel = self.estimator.select([prompt_key(r) for r in stream], step, size=k)
        else:
            stream = list(candidates)
            sel = self.estimator.select([prompt_key(r) for r in stream], step)
        return PromptSelection(sel.indices, sel.probs, sel.window, [stream[i] for i in sel.indices])

    def generate(self, step: int, rows: list[dict[str, Any]], n: int | None = None, call: int = 0
                 ) -> RolloutBatch:
        """Sample ``n`` (default ``num_generations``) completions for each prompt of ``rows``, in one engine
        call (what every rollout plan calls: :mod:`dppo_core.plans`). ``call``: the step's engine call (1: the
        rest after a pilot; dynamic sampling's refill rounds), each with its own random stream of (seed, step,
        rank, call)."""
        c = self.config
        if self.context_length:
            check_prompt_lengths(rows, self.tokenizer, self.context_length, c.max_completion_length,
                                 self._prompt_lengths)
        seed = (c.seed * 1_000_003 + step) % (2**31)
        if self.dist.rank or call:  # each rank samples its own prompts from its own stream, as does each call
            entropy = [seed, self.dist.rank] + ([call] if call else [])
            seed = int(np.random.SeedSequence(entropy).generate_state(1)[0]) >> 1
        sampling = SamplingConfig(max_tokens=c.max_completion_length, temperature=c.temperature,
                                  top_p=c.top_p,
                                  seed=seed)
        assert self.engine is not None, "train() starts the rollout engine in start() (or set trainer.engine)"
        return self.engine.generate([r["prompt"] for r in rows], n or c.num_generations, sampling)

    def score(self, rows: list[dict[str, Any]], batch: RolloutBatch, means: dict[str, float] | None = None,
              parts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Rewards of shape (P, n), n the batch's completions per prompt: the sum of the reward functions.
        ``means``, when given, receives each function's mean (what the step logs as ``reward_<name>``);
        ``parts``, its (P, n)."""
        g = len(batch.groups[0].completions) if batch.groups else self.config.num_generations
        prompts = [r["prompt"] for r in rows for _ in range(g)]
        completions = [c.text for grp in batch.groups for c in grp.completions]
        columns = {k: [r[k] for r in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
        total, parts = torch.zeros(len(completions)), {} if parts is None else parts
        for fn in self.reward_funcs:
            name = getattr(fn, "__name__", fn)
            try:
                scores = fn(prompts=prompts, completions=completions, **columns)
            except Exception as exc:
                raise ValueError(f"reward function {name!r} raised {type(exc).__name__}: {exc}; it is called "
                                 f"as fn(prompts, completions, **columns) with columns {sorted(columns)}, "
                                 "and must return one float per completion") from exc
            if len(scores) != len(completions):
                raise ValueError(f"reward function {name!r} returned {len(scores)} scores for "
                                 f"{len(completions)} completions")
            values = torch.tensor([math.nan if s is None else float(s) for s in scores])
            if not torch.isfinite(values).all():
                raise ValueError(f"reward function {name!r} returned a NaN or infinite score; return a "
                                 "finite float for every completion")
            total += values
            parts[f"reward_{getattr(fn, '__name__', 'fn')}"] = values.view(len(rows), g)
        if means is not None:
            means.update((key, values.mean().item()) for key, values in parts.items())
        return total.view(len(rows), g)

    def weigh(self, selection: Selection | None, rewards: torch.Tensor | None, lengths: torch.Tensor | None,
              step: int, *, advantages: torch.Tensor | None = None, observe: bool = True
              ) -> tuple[torch.Tensor, Weighting]:
        """After reward, in :meth:`train_step`'s order: the advantages over whole groups (``advantages``, when
        given, are used as they are), the history's record of them (``observe``: it decides the next steps' π;
        False leaves the history as it is), then the keep draws and weights (the estimator's ``weigh``), whose
        π_q are those ``selection`` was drawn with, not the updated history's. ``rewards`` and ``lengths`` (P,
        G) are handed to an estimator that reads them. Data parallel: every rank's groups, so the draws are
        those of one process. Returns (advantages, weighting)."""
        if advantages is None:
            assert rewards is not None, "weigh needs the rewards, or the advantages"
            advantages = group_advantages(rewards, self.config.scale_rewards)
        adv = advantages
        if observe:
            assert selection is not None and rewards is not None, "observe records the selection's rewards"
            self.estimator.observe([prompt_key(r) for r in cast(PromptSelection, selection).rows], rewards,
                                   adv, step)
        extra: dict[str, torch.Tensor | None] = {}
        if self.estimator.needs_rewards:
            extra["rewards"] = rewards
        if self.estimator.needs_lengths:
            extra["lengths"] = lengths
        return adv, from_main(self.estimator.weigh(adv, selection, step, **extra), self.dist)  # rank 0's draw

    @staticmethod
    def sequences(batch: RolloutBatch, advantages: torch.Tensor, weighting: Weighting,
                  group_offset: int = 0) -> Sequences:
        """This rank's kept completions as :class:`Sequences` (completions without tokens have no loss:
        skipped)."""
        if weighting.advantages is not None:  # the estimator recomputed them (pods)
            advantages = weighting.advantages
        prompt_ids, completion_ids, adv, w, origin, engine_lp = [], [], [], [], [], []
        pruned_tokens = 0
        for gi, grp in enumerate(batch.groups, start=group_offset):
            for ci, comp in enumerate(grp.completions):
                if not weighting.keep[gi, ci] or not comp.token_ids:
                    pruned_tokens += len(comp.token_ids)
                    continue
                prompt_ids.append(grp.prompt_ids)
                completion_ids.append(comp.token_ids)
                adv.append(advantages[gi, ci].item())
                w.append(float(weighting.weights[gi, ci]))
                origin.append((gi, ci))
                engine_lp.append(comp.logprobs)
        return Sequences(prompt_ids, completion_ids, torch.tensor(adv), torch.tensor(w, dtype=torch.float64),
                         num_sequences=weighting.num_sequences, pruned_tokens=pruned_tokens, origin=origin,
                         engine_logprobs=engine_lp)

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """Yields the reference policy: the frozen copy, or the base with the adapter off."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with cast("PeftModel", self.model).disable_adapter():  # no frozen copy: LoRA
                yield self.model

    def update(self, seqs: Sequences) -> dict[str, float]:
        """One optimizer step per PPO epoch over ``seqs`` (micro-batches accumulate gradients).

        Data parallel: each rank backpropagates its share (possibly none) with the step's global
        normalisers, the gradients are summed over ranks before clipping, and the stats are the job's.
        """
        c, model = self.config, self.model
        t_pack = time.perf_counter()
        mbs, forward, layout = layout_micro_batches(seqs, c, self.tokenizer.pad_token_id,
                                                    segments=attention_implementation(model) == SEGMENTS)
        layout["time_pack"] = time.perf_counter() - t_pack
        old, ref, engine_w = {}, {}, {}
        with torch.no_grad():
            if c.num_iterations > 1:  # the PPO ratio's denominator (with one epoch the ratio is 1)
                model.eval()
                old = {k: forward(model, k)[0] for k in range(len(mbs))}
            if c.beta > 0:
                with self._reference() as ref_model:
                    ref_model.eval()
                    ref = {k: forward(ref_model, k)[0] for k in range(len(mbs))}
        model.train()
        stats = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0}
        level = self.rollout_correction_level()
        if level:
            stats.update(engine_weight_mean=0.0, engine_weight_truncated=0.0, engine_logprob_diff_max=0.0)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr(self.step)
        for _epoch in range(c.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            tokens = max(1, seqs.global_num_tokens)
            for k, idx in enumerate(mbs):
                logp, mask = forward(model, k)
                if level and k not in engine_w:  # π_old (the engine's parameters) is fixed: weigh each once
                    engine_w[k], ew = engine_weights(c, level, seqs, idx, old.get(k, logp), mask)
                    stats["engine_weight_mean"] += ew["engine_weight_sum"] / tokens
                    stats["engine_weight_truncated"] += ew["engine_truncated"] / tokens
                    stats["engine_logprob_diff_max"] = max(stats["engine_logprob_diff_max"],
                                                           ew["engine_logprob_diff_max"])
                loss, st = micro_batch_loss(c, seqs, idx, logp, mask, old.get(k), ref.get(k), engine_w.get(k))
                loss.backward()
                share = mask.sum().item() / max(1, seqs.global_num_tokens) / c.num_iterations
                stats["loss"] += loss.item() / c.num_iterations
                stats["clip_fraction"] += st["clip_fraction"].item() * share
                stats["kl"] += st["kl"].item() * share
            params = [p for p in model.parameters() if p.requires_grad]
            all_reduce_gradients(params, self.dist)
            norm = torch.nn.utils.clip_grad_norm_(params,
                                                  c.max_grad_norm if c.max_grad_norm > 0 else float("inf"))
            stats["grad_norm"] += norm.item() / c.num_iterations
            self.optimizer.step()
        return {**stats, **job_layout_stats(stats, layout, self.dist)}

    # --- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One step: select (prune prompts), roll out and reward (the plan), advantages, weigh (prune
        completions), update, sync."""
        c, plan = self.config, self.plan
        plan.prepare(self)  # before the step's clock (the offline filter's pass over the pool)
        timer = PhaseTimer(PHASES)
        # 1. select: which candidate prompts to roll out (prompt pruning, before any generation); rank 0's
        #    draw
        selection = self.last_selection = from_main(plan.select(self, self.step), self.dist)
        timer.lap("prune")
        # every candidate pruned: the estimate is exactly 0 (a valid draw); the step is counted
        if not selection.rows:
            self.step += 1
            return self.step_record(selection, timer)
        # 2-3. roll out and reward every completion (the plan: this rank's share of the kept prompts, G each;
        # a pilot's k, then the rest of the continued groups; a refill's rounds); every rank gets every
        # group's rewards
        out = plan.roll_out(self, selection, timer)
        selection, batch, rewards, lengths = out.selection, out.batch, out.rewards, out.lengths
        lens = torch.tensor(lengths, dtype=torch.long).view(rewards.shape)  # (P, G): every rank's groups
        if c.log_groups:  # groups.jsonl's line (train() writes it)
            self.last_groups = out.group_line or group_record(
                self.step + 1, selection.window, [prompt_key(r) for r in selection.rows], selection.probs,
                                                              rewards,
                lens, stopped=out.stopped)
        # e.g. every group stopped after its pilot: the estimate is exactly 0 (a valid draw)
        if not selection.rows:
            self.step += 1
            return self.step_record(selection, timer, out)
        # 4. advantages, the history, then weigh: which completions to train on, weights 1/(π_q p_qi),
        #    normaliser
        adv, weighting = self.weigh(selection, rewards, lens, self.step)
        seqs = self.sequences(batch, adv, weighting, group_offset=out.offset)
        kept = weighting.keep & (lens > 0)  # completions without tokens have no loss
        seqs.total_tokens, seqs.total_rolled_out_tokens = int(lens[kept].sum()), sum(lengths)
        weights = weighting.weights[kept].float()  # every rank's kept weights, in global order
        timer.lap("prune")
        # 5. update (dense packing inside), then 6. the engine samples from the new policy next step
        stats = self.update(seqs) if len(weights) else ZERO_STATS  # every rank joins if any rank trains
        timer.lap("update")
        assert self.engine is not None  # the plan's generate() above used it
        self.engine.sync(self.model)
        timer.lap("sync")
        self.step += 1
        return self.step_record(selection, timer, out, Trained(seqs, weights, stats))

    def step_record(self, selection: PromptSelection, timer: PhaseTimer, out: RolledOut | None = None,
                    trained: Trained | None = None) -> dict[str, Any]:
        """The step's line of ``metrics.jsonl`` (schema: :data:`dppo_core.metrics.STEP`), filled here only.

        ``out``: what the plan rolled out (None: every candidate was pruned); ``trained``: the update (None:
        the step trained nothing, and is logged ``skipped`` unless the plan says otherwise). Counts of what
        was rolled out come from the plan's :class:`~dppo_core.plans.RolloutCounts` where it rolled out more
        than it trains; the plan's own keys (:data:`dppo_core.metrics.PLAN_KEYS`) are added and may not
        replace a step key.
        """
        counts = out.counts if out is not None else None
        lengths = out.lengths if out is not None else []
        record: dict[str, Any] = {
            "prompts_candidates": selection.window if counts is None or counts.prompts_candidates is None
            else counts.prompts_candidates,
            "prompts_rolled_out": counts.prompts_rolled_out if counts else len(selection.rows) if out else 0,
            "step": self.step, "lr": self._lr(self.step - 1),
            "tokens_generated": counts.tokens if counts else sum(lengths)}
        if out is not None:
            record["completions_rolled_out"] = counts.completions if counts else len(lengths)
        logged = counts.rewards if counts is not None and counts.rewards is not None else (
            out.rewards if out is not None else None)
        if logged is not None and logged.numel():
            record.update(reward_mean=logged.mean().item(), reward_std=logged.std().item(),
                          zero_std_groups=(logged.std(dim=1) == 0).float().mean().item())
        else:
            record["reward_mean"] = None
        if out is not None and trained is not None:
            record.update(out.means)
        if lengths:
            record.update(completion_length=sum(lengths) / len(lengths), completion_length_max=max(lengths))
        # the rollout tokens saved: the plan's count, or an estimate (the pruned prompts were never generated)
        # at this step's mean length
        if counts is not None and counts.tokens_saved_est is not None:
            record["tokens_saved_rollout_est"] = counts.tokens_saved_est
        elif trained is not None:
            g, mean_len = self.config.num_generations, sum(lengths) / len(lengths)
            record["tokens_saved_rollout_est"] = round(selection.num_pruned * g * mean_len)
        if trained is None:
            record.update(ZERO_STATS, tokens_trained=0, sequences_trained=0)
            if out is None or out.mark_skipped:
                record["skipped"] = 1
            record.update({**(timer.record() if out is not None else {}), "time_prune": timer.phases["prune"],
                           "step_time": time.perf_counter() - timer.start})
        else:
            seqs, weights, stats = trained
            record.update(stats, tokens_trained=seqs.global_num_tokens, sequences_trained=len(weights),
                          tokens_saved_update=seqs.global_rolled_out_tokens - seqs.global_num_tokens,
                          weight_ess=effective_sample_size(weights) if len(weights) else 0.0,
                          weight_max=float(weights.max()) if len(weights) else 0.0)
            record.update(timer.record(less={"update": stats["time_pack"]}))
        if out is not None:
            if clash := set(out.plan_stats) & set(STEP):
                raise RuntimeError(f"rollout plan {self.plan.name} logs {sorted(clash)}, keys of the step's "
                                   "own line: count what it rolled out in RolledOut.counts instead")
            record.update(out.plan_stats)
        return record

    # --- evaluation -------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Held-out accuracy of the current policy (:func:`dppo_core.evaluate.evaluate_policy`)."""
        from dppo_core.evaluate import evaluate_policy
        from dppo_core.rollout import HFRollout

        engine = self.engine if self.engine is not None else HFRollout(self.model, self.tokenizer)
        c = self.config
        return evaluate_policy(c, engine, self.step, benchmarks=c.eval_benchmarks,
                               benchmark_limit=c.eval_benchmark_limit, progress=self.progress)
