"""The bench's evaluation, the same for every method (ours and the TRL peers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dppo_core.config import DPPOConfig
from dppo_core.tools.bench.presets import BenchError, BenchPreset
from dppo_core.tools.bench.tables import fmt


def bench_evaluation(config: DPPOConfig, engine: Any, step: int, preset: BenchPreset) -> dict[str, Any]:
    """Held-out accuracy of the policy behind ``engine``: :func:`~dppo_core.evaluate.evaluate_policy` on the
    embedded task, else pass@1 on the preset's ``eval_benchmarks`` (which such a task needs)."""
    from dppo_core.evaluate import evaluate_policy

    if config.task != "arithmetic" and not preset.eval_benchmarks:
        raise BenchError(f"task={config.task!r} has no held-out levels; give the bench preset "
                         "eval_benchmarks")
    return evaluate_policy(config, engine, step, preset.eval_benchmarks, preset.eval_limit)


def eval_line(record: Mapping[str, Any]) -> str:
    """The log line of one evaluation record."""
    return (f"    step {record['step']}: sampled accuracy {fmt(record.get('sampled_accuracy'))}, "
            f"greedy {fmt(record.get('greedy_accuracy'))}")
