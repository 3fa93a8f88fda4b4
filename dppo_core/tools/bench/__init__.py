"""``dppo bench``: GRPO, DPPO, the CPPO and GRESO baselines and TRL's GRPOTrainer (plain, and with DPPO's
pruning), side by side.

Every method of a bench preset trains the same model on the same fixed pool of prompts
(``train_pool_size``) with the same seed, step budget, group size, generation length, learning rate and
evaluation; only what :data:`METHOD_OVERRIDES` lists differs. Runs are interleaved: for each seed one run
of every method, the order rotated from seed to seed, so a slow stretch of a shared machine falls on all
methods alike rather than on one.

Measured per run, from its ``metrics.jsonl`` and ``eval.jsonl`` (kept in ``DIR/runs/METHOD/seed-S/``):

- training time: the sum of step times (evaluations excluded; they are logged as ``eval_s``), split into
  phases (rollout, reward, prune, pack, update, sync); tokens generated and trained; the token slots the
  update passes paid for, padding included (``row_capacity``; trained / row_capacity is the density);
- held-out accuracy at every evaluation: sampled (T=1) and greedy, mean over the trained levels and per level;
- time to target: the training time at which the sampled accuracy first reaches the target,
  ``TARGET_FRACTION`` (95%) of GRPO's final sampled accuracy (mean over seeds), interpolated linearly between
  the last evaluation below it and the first at or above it
  (:func:`~dppo_core.tools.bench.summary.time_to_target`, the one definition every table uses). A run whose
  first evaluation already reaches it has that evaluation's time (0 before training); a run that never reaches
  it has None, and a method whose seeds do not all reach it has no mean time (``time_to_target_reached`` says
  how many did).

Over seeds every number is a mean (``after_std`` is the standard deviation of the final accuracy over
seeds); per-seed numbers stay in ``bench.json`` under ``runs``. Against ``grpo``:

- speedup = grpo's value / the method's, for the median step time, the training wall time and the time
  to target;
- the token-cost bound: the speedup the token counts alone predict. On grpo's runs, rollout and reward
  cost ``c_gen`` seconds per generated token and the update ``c_train`` per trained token; the rest of
  grpo's time (prune, pack, sync, gaps) is a fixed cost F. A method that generates G and trains T tokens
  is predicted to take ``c_gen G + c_train T + F``, and the bound is grpo's time over that;
- fraction of bound = wall speedup / bound: 1 means every token saved was saved in time too. It can
  exceed 1 where a method also makes each token cheaper than grpo does (dense packing removes padding).

Departures of the TRL peers (``trl_grpo``, ``trl_dppo``; :func:`trl_grpo_args`) from our trainer, and why:

1. TRL generates once per optimizer step and trains on ``per_device_train_batch_size`` completions per
   micro-batch (gradient accumulation over the whole batch), padding prompts and completions to the
   longest of the step's batch; ours sorts by length and pads per micro-batch.
2. TRL computes the token entropy in every loss forward (it logs it); ours does not.
3. TRL samples prompts from its dataset without replacement (a shuffled pass over the pool per epoch);
   ours samples each step's prompts with replacement. Same pool, same expected mix.
4. Phases: TRL's transformers path generates with the training model itself, so there is no weight sync
   (as with our ``hf`` engine), and it has no prune or pack phase; the update phase is the step time
   minus rollout and reward, so it also holds TRL's reference forward and bookkeeping.
5. ``trl_dppo`` is the dppo configuration run by ``DPPOGRPOTrainer`` (``dppo_core.integrations.trl``) with
   DPPO's estimator (:func:`dppo_core.estimator.make_estimator`); like ``trl_grpo`` it pads instead of
   packing, so it has ``packing: false``, and TRL's sampler draws a fixed generation batch, so it has
   ``dense_prompts: false`` (the candidate window is the batch).

The package: :mod:`~dppo_core.tools.bench.presets` (methods, presets, configurations),
:mod:`~dppo_core.tools.bench.cpu_settings` (what the CPU presets share, the cpu-realistic pool, the
persistence map), :mod:`~dppo_core.tools.bench.run` (running the bench), :mod:`~dppo_core.tools.bench.peers`
and :mod:`~dppo_core.tools.bench.trl_runner` (the TRL peers), :mod:`~dppo_core.tools.bench.summary` (pure
functions of the logs), :mod:`~dppo_core.tools.bench.report` (``bench.json``),
:mod:`~dppo_core.tools.bench.tables` (the printed, Markdown and README tables) and
:mod:`~dppo_core.tools.bench.plots` (the plots). Every public name is importable from
``dppo_core.tools.bench``.
"""

from __future__ import annotations

from dppo_core.tools.bench.cpu_settings import CPU_BENCH_METHODS, CPU_BENCH_SETTING
from dppo_core.tools.bench.evals import bench_evaluation
from dppo_core.tools.bench.peers import TRL_INSTALL_HINT, TRL_PEERS, TRLPeer, require_trl, trl_grpo_args
from dppo_core.tools.bench.plots import plot_bench
from dppo_core.tools.bench.presets import (
    BATCH_MATCHED,
    BENCH_PRESETS,
    DEFAULT_METHODS,
    DERIVED_METHODS,
    DPPO_PRUNING,
    HALF_BATCH_METHODS,
    METHOD_OVERRIDES,
    METHODS,
    PHASES,
    REFERENCE_METHODS,
    TARGET_FRACTION,
    UNTRAINED_TINY,
    BenchError,
    BenchPreset,
    bench_preset,
    check_batch_matched,
    check_batch_matched_methods,
    check_methods,
    describe_presets,
    matched_prompts_per_step,
    method_config,
    method_lineage,
    method_settings,
    reference_method,
    run_dir,
    split_overrides,
)
from dppo_core.tools.bench.report import (
    NOTES,
    committed_result,
    describe_machine,
    machine_load,
    summarize_bench,
    write_bench,
)
from dppo_core.tools.bench.run import build_configs, interleaved, run_bench, run_method, run_ours
from dppo_core.tools.bench.summary import (
    accuracy_at_time,
    aggregate_runs,
    compare,
    paired_speedups,
    read_jsonl,
    speedups_vs,
    subset_scores,
    summarize_run,
    time_to_target,
    token_cost_bound,
    token_costs,
)
from dppo_core.tools.bench.tables import (
    README_MARKERS,
    format_levels,
    format_markdown,
    format_table,
    update_readme,
)

__all__ = [
    "BATCH_MATCHED", "BENCH_PRESETS", "BenchError", "BenchPreset", "CPU_BENCH_METHODS", "CPU_BENCH_SETTING",
    "DEFAULT_METHODS", "DERIVED_METHODS", "DPPO_PRUNING", "HALF_BATCH_METHODS", "METHODS", "METHOD_OVERRIDES",
    "NOTES", "PHASES", "README_MARKERS", "REFERENCE_METHODS", "TARGET_FRACTION", "TRLPeer",
    "TRL_INSTALL_HINT", "TRL_PEERS", "UNTRAINED_TINY", "accuracy_at_time", "aggregate_runs",
    "bench_evaluation", "bench_preset", "build_configs", "check_batch_matched", "check_batch_matched_methods",
    "check_methods", "committed_result", "compare", "describe_machine", "describe_presets", "format_levels",
    "format_markdown", "format_table", "interleaved", "machine_load", "matched_prompts_per_step",
    "method_config", "method_lineage", "method_settings", "paired_speedups", "plot_bench", "read_jsonl",
    "reference_method", "require_trl", "run_bench", "run_dir", "run_method", "run_ours", "speedups_vs",
    "split_overrides", "subset_scores", "summarize_bench", "summarize_run", "time_to_target",
    "token_cost_bound", "token_costs", "trl_grpo_args", "update_readme", "write_bench",
]
