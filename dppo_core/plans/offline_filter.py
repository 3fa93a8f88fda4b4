"""The offline filter as a rollout plan (``rollout_plan: offline_filter``; the bench's
``grpo_skip_filtered``): before the first step, every prompt of the pool is rolled out once by the initial
model (G completions, the training sampler) and the prompts whose group came out all right or all wrong are
dropped; the run then rolls out plainly from what is left.

The filter's time and tokens are the run's: its metrics line (``event: prefilter``) is logged before the first
step and counted by :func:`dppo_core.tools.bench.summary.summarize_run`. One group per prompt is the
practitioners' cheap filter (a prompt at p = 0.9 comes out 8/8 43% of the time and is dropped); a prompt the
model learns to solve stays in. The filtered pool is not checkpointed, so a run with this plan cannot resume.
One process only.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from dppo_core.data import PromptSource, prompt_key
from dppo_core.grouplog import informative
from dppo_core.plans import RolloutPlan, Trainer, single_process


class OfflineFilter(RolloutPlan):
    """Drop, before training, the pool's prompts whose one group from the initial model was all right or all
    wrong; then roll out as the plain plan does."""

    name: ClassVar[str] = "offline_filter"

    def __init__(self, config: Any):
        super().__init__(config)
        self.filtered = False

    def prepare(self, trainer: Trainer) -> None:
        """Before the first step this plan runs: the filter, logged as its own metrics line."""
        if self.filtered:
            return
        # the filtered pool is not in the checkpoint: a resumed run would train on all of it
        if trainer.step > 0:
            raise RuntimeError("rollout_plan offline_filter cannot resume a run (its filtered pool is not "
                               "checkpointed); start it again (a bench resumed with --resume starts "
                               "unfinished runs again)")
        trainer.log(self.prefilter(trainer))
        self.filtered = True

    def prefilter(self, trainer: Trainer) -> dict[str, Any]:
        """Roll out every pool prompt once (G completions, in batches of ``prompts_per_step``), keep the mixed
        ones, and sample the run's prompts from those; returns the metrics line it logs."""
        single_process(trainer, self.name)
        t0 = time.perf_counter()
        k, rows_all = self.config.prompts_per_step, list(trainer.prompts.rows)
        weights = trainer.prompts.weights
        weight = dict(zip(map(prompt_key, rows_all), weights, strict=True)) if weights else None
        pool = [r for r in rows_all if weight is None or weight[prompt_key(r)] > 0]  # weight 0: never drawn
        kept, tokens, dropped = [], 0, []
        for start in range(0, len(pool), k):
            rows = pool[start:start + k]
            batch = trainer.generate(-1 - start // k,
                                     rows)  # seeds below every step's: the filter's samples its own
            rewards = trainer.score(rows, batch)
            tokens += batch.num_generated_tokens
            for row, r in zip(rows, rewards.tolist(), strict=True):
                if informative(r):
                    kept.append(row)
                else:
                    dropped.append(r[0])
        if kept:  # a filter that leaves nothing (e.g. an untrained model) keeps the pool, and says so
            trainer.prompts = PromptSource(kept,
                                           None if weight is None else [weight[prompt_key(r)] for r in kept])
        return {"event": "prefilter", "step": 0, "time_prefilter": time.perf_counter() - t0,
                "tokens_generated": tokens,
                "pool": len(pool), "kept": len(kept) or len(pool), "filter_left_nothing": not kept,
                "dropped": len(dropped), "dropped_all_correct": sum(r == 1.0 for r in dropped),
                "dropped_all_wrong": sum(r == 0.0 for r in dropped)}
