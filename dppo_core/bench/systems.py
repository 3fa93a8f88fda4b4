"""The systems bench (``dppo bench --preset gpu-systems``): where a step's time goes, nothing about learning.

Each method runs padded, packed, and packed with each prompt once per group (:data:`LAYOUTS`), a few
steps each, on a Qwen3-shaped model with random weights
(:func:`dppo_core.gpu_check.build_shaped_model`) and a stand-in reward
(:func:`dppo_core.gpu_check.synthetic_reward`: random weights get every answer wrong, which would leave
every group degenerate and nothing to train). The first :data:`WARMUP_STEPS` steps of each run are not
timed (kernel autotuning, CUDA graphs, allocator growth). One rollout engine serves every run (it is synced
to each run's model first), so no run pays for starting vLLM.

What it writes to ``OUTPUT_DIR``: ``bench.json`` (per run: median step time and phases, tokens, density,
peak memory; speedups of each run's median step time over ``grpo`` padded and ``grpo_skip`` packed),
``bench.md`` (the same as a table) and ``runs/LABEL/metrics.jsonl`` (every step).

These are step times, not times to an accuracy: with a real model, what pruning costs in learning per
step is measured by the accuracy benches (``cpu-baselines``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dppo_core.bench.presets import BenchError, BenchPreset
from dppo_core.bench.report import _versions, describe_machine
from dppo_core.config import DPPOConfig

#: Steps of each run before timing starts.
WARMUP_STEPS = 2
PHASES = ("rollout", "reward", "prune", "update", "sync")


#: The update layouts each method is timed with: (label suffix, config fields).
LAYOUTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("padded", {"packing": False, "shared_prefix": False}),
    ("packed", {"packing": True, "shared_prefix": False}),
    ("shared", {"packing": True, "shared_prefix": True}),  # each prompt once per group (dppo_core.shared_prefix)
)


def run_label(method: str, layout: str) -> str:
    return f"{method}-{layout}"


def summarize_steps(records: list[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """Medians over the timed steps (those after ``warmup``; all of them when there are no more, and then
    ``warmup_steps`` is 0: the medians are of cold steps)."""
    timed = records[warmup:] or records

    def med(key: str) -> float:
        return float(statistics.median(float(r.get(key) or 0.0) for r in timed))

    out: dict[str, Any] = {
        "timed_steps": len(timed),
        "warmup_steps": len(records) - len(timed),
        "step_time_median": med("step_time"),
        "phase_median_s": {p: med(f"time_{p}") for p in PHASES},
        "tokens_generated_median": med("tokens_generated"),
        "tokens_trained_median": med("tokens_trained"),
        "sequences_trained_median": med("sequences_trained"),
        "update_density_median": med("update_density"),
    }
    peaks = [r["peak_allocated_gib"] for r in timed if r.get("peak_allocated_gib") is not None]
    out["peak_allocated_gib"] = max(peaks) if peaks else None
    return out


def systems_speedups(results: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Each run's median step time against ``grpo-padded`` (as the frameworks run it) and ``grpo_skip-packed``;
    none when a run has no step after its warm-up (a cold first step times autotuning and allocation, and the
    first run of all pays most of it)."""
    out: dict[str, dict[str, float]] = {}
    if any(r.get("warmup_steps", WARMUP_STEPS) == 0 for r in results.values()):
        return out
    for base in ("grpo-padded", "grpo_skip-packed"):
        if base in results and results[base]["step_time_median"] > 0:
            t = results[base]["step_time_median"]
            out[base] = {label: t / r["step_time_median"] for label, r in results.items() if r["step_time_median"] > 0}
    return out


def format_systems(result: Mapping[str, Any]) -> str:
    """bench.md: one row per run."""
    runs = result["runs"]
    sp = result["speedup_vs"]
    lines = [f"# {result['preset']}: step times (timing only: random weights, a stand-in reward)", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             f"Model: {result['model']}; rollouts: {result.get('rollout_engine') or '-'}; "
             f"{result['timed_steps']} timed steps per run after {result['warmup_steps']} untimed", "",
             *(["**Every step here is a run's first (max_steps is at most the warm-up): cold steps, which time "
                "autotuning and allocation, the first run's most. They show that each path runs; no speedup is "
                "computed from them.**", ""] if result["warmup_steps"] == 0 else []),
             "| run | step s | rollout s | update s | sync s | tokens generated | tokens trained | density | peak GiB "
             "| vs grpo-padded | vs grpo_skip-packed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        ph = r["phase_median_s"]
        peak = "-" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.1f}"
        a = sp.get("grpo-padded", {}).get(label)
        b = sp.get("grpo_skip-packed", {}).get(label)
        lines.append(f"| {label} | {r['step_time_median']:.2f} | {ph['rollout']:.2f} | {ph['update']:.2f} | "
                     f"{ph['sync']:.2f} | {r['tokens_generated_median']:.0f} | {r['tokens_trained_median']:.0f} | "
                     f"{r['update_density_median']:.2f} | {peak} | {'-' if a is None else f'{a:.2f}x'} | "
                     f"{'-' if b is None else f'{b:.2f}x'} |")
    return "\n".join(lines) + "\n"


def run_systems(preset: BenchPreset, configs: Mapping[tuple[str, int], DPPOConfig], output_dir: str | Path, *,
                log: Callable[[str], None] = print, command: str | None = None) -> dict[str, Any]:
    """Every method of ``configs`` in every layout (LAYOUTS) for its ``max_steps``; write and return ``bench.json``."""
    from dppo_core.gpu_check import format_step, train_steps

    output_dir = Path(output_dir)
    seeds = sorted({s for _, s in configs})
    if len(seeds) != 1:
        raise BenchError(f"a systems bench times one seed (its runs are step times, not learning curves); got seeds "
                         f"{seeds}: pass --seeds with one seed")
    results: dict[str, dict[str, Any]] = {}
    engine = None
    model = None
    rollout_engine = None
    timed, warmup = 0, WARMUP_STEPS
    for (method, seed), base in configs.items():
        for layout, fields in LAYOUTS:
            label = run_label(method, layout)
            config = base.with_overrides({**fields, "output_dir": str(output_dir / "runs" / label)})
            model = config.model
            rollout_engine = config.rollout_engine
            log(f"{label} (seed {seed}): {config.max_steps} steps ...")
            records, engine = train_steps(method, config, config.max_steps, engine,
                                          on_step=lambda r, label=label: log(f"    {label} {format_step(r)}"))
            run_dir = Path(config.output_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            results[label] = {"method": method, "layout": layout, **fields, "seed": seed, **summarize_steps(records)}
            timed, warmup = results[label]["timed_steps"], results[label]["warmup_steps"]
    if engine is not None and hasattr(engine, "close"):
        engine.close()
    result = {"preset": preset.name, "kind": "systems", "command": command or f"dppo bench --preset {preset.name}",
              "machine": describe_machine(), "model": preset.overrides.get("model", model), "timed_steps": timed,
              "warmup_steps": warmup,
              "rollout_engine": rollout_engine, "runs": results, "speedup_vs": systems_speedups(results),
              "versions": _versions(),
              "notes": {"timing_only": "random weights and gpu_check.synthetic_reward: step times, not learning",
                        "step_time_median": "median over the timed steps of the whole step (prune, rollout, "
                                            "reward, update, sync)"}}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (output_dir / "bench.md").write_text(format_systems(result))
    log(format_systems(result))
    return result
