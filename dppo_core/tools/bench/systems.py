"""The systems bench (``dppo bench --preset gpu-systems``): where a step's time goes, nothing about learning.

Each method runs padded, packed, and packed with each prompt once per group (:data:`LAYOUTS`), a few steps
each, on a Qwen3-shaped model with random weights (:func:`dppo_core.shapes.build_shaped_model`) and a stand-in
reward (:func:`synthetic_reward`: random weights get every answer wrong, which would leave every group
all-equal and nothing to train). The first :data:`WARMUP_STEPS` steps of each run are not timed (kernel
autotuning, CUDA graphs, allocator growth). One rollout engine serves every run (it is synced to each run's
model first), so no run pays for starting vLLM.

What it writes to ``OUTPUT_DIR``: ``bench.json`` (per run: median step time and phases, tokens, density,
peak memory; speedups of each run's median step time over ``grpo`` padded and ``grpo_skip`` packed),
``bench.md`` (the same as a table) and ``runs/LABEL/metrics.jsonl`` (every step).

These are step times, not times to an accuracy: with a real model, what pruning costs in learning per
step is measured by the accuracy benches (``cpu-baselines``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import resource
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dppo_core.config import DPPOConfig
from dppo_core.tools.bench.presets import BenchError, BenchPreset
from dppo_core.tools.bench.report import describe_machine, package_versions
from dppo_core.tools.doctor import quiet

GiB = 1024**3

#: Steps of each run before timing starts.
WARMUP_STEPS = 2
PHASES = ("rollout", "reward", "prune", "update", "sync")


#: The update layouts each method is timed with: (label suffix, config fields).
LAYOUTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("padded", {"packing": False, "shared_prefix": False}),
    ("packed", {"packing": True, "shared_prefix": False}),
    # each prompt once per group (dppo_core.shared_prefix)
    ("shared", {"packing": True, "shared_prefix": True}),
)


# --- the step runner (also the doctor's step checks) -----------------------------------------------


def _fraction(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def synthetic_reward(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """A stand-in reward for timing models with random weights (which get every answer wrong, so every
    group would be all-zero): each prompt has a success rate p, uniform in [0, 1) from a hash of its text,
    and each completion is right with probability p, from a hash of prompt and completion. About 2/9 of
    groups of 8 come out all right or all wrong, as in real training. Not a measure of anything learned."""
    out = []
    for p, c in zip(prompts, completions, strict=True):
        rate = _fraction(repr(p))
        out.append(float(_fraction(f"{p!r}\x00{c!r}") < rate))
    return out


# --------------------------------------------------------------------------------------------------
# Memory and time
# --------------------------------------------------------------------------------------------------


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> str:
    """The peak since :func:`reset_peak`: torch's allocator on CUDA, the process's resident set on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return (f"peak {torch.cuda.max_memory_allocated(device) / GiB:.2f} GiB allocated by torch, "
                f"{(total - free) / GiB:.1f} of {total / GiB:.0f} GiB in use on the device")
    return ("peak resident memory of the process "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.2f} GiB")


def free_cuda() -> None:
    """Let go of what the last run held (Python's garbage, then CUDA's cached blocks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_steps(method: str, config, steps: int, engine: Any = None,
                on_step: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], Any]:
    """``steps`` training steps of ``method``'s ``config`` with :func:`synthetic_reward`; returns the step
    records (each with ``peak_memory``) and the rollout engine (pass it to the next call to reuse a vLLM
    engine: it is synced to that call's model first)."""
    from dppo_core.trainer import DPPOTrainer

    device = torch.device(config.device)
    with quiet():
        trainer = DPPOTrainer(config, reward_funcs=[synthetic_reward], progress=False)
        trainer.engine = engine if engine is not None else trainer.make_engine()
    trainer.engine.sync(trainer.model)
    records = []
    for _ in range(steps):
        reset_peak(device)
        record = trainer.train_step()
        record["peak_memory"] = peak_memory(device)
        if device.type == "cuda":
            record["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        records.append(record)
        if on_step is not None:
            on_step(record)
    engine = trainer.engine
    del trainer
    free_cuda()
    return records, engine


def format_step(record: dict[str, Any]) -> str:
    phases = ", ".join(f"{p} {record.get('time_' + p, 0.0):.2f}"
                       for p in ("rollout", "reward", "prune", "update", "sync"))
    return (f"step {record['step_time']:.2f} s ({phases}); trained {record.get('sequences_trained', 0)} of "
            f"{record.get('completions_rolled_out', 0)} completions; {record['peak_memory']}")


# --- the bench ----------------------------------------------------------------------------------------


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
    """Each run's median step time against ``grpo-padded`` (as the frameworks run it) and
    ``grpo_skip-packed``; none when a run has no step after its warm-up (a cold first step times autotuning
    and allocation, and the first run of all pays most of it)."""
    out: dict[str, dict[str, float]] = {}
    if any(r.get("warmup_steps", WARMUP_STEPS) == 0 for r in results.values()):
        return out
    for base in ("grpo-padded", "grpo_skip-packed"):
        if base in results and results[base]["step_time_median"] > 0:
            t = results[base]["step_time_median"]
            out[base] = {label: t / r["step_time_median"] for label, r in results.items()
                         if r["step_time_median"] > 0}
    return out


def format_systems(result: Mapping[str, Any]) -> str:
    """bench.md: one row per run."""
    runs = result["runs"]
    sp = result["speedup_vs"]
    lines = [f"# {result['preset']}: step times (timing only: random weights, a stand-in reward)", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}  ",
             f"Model: {result['model']}; rollouts: {result.get('rollout_engine') or '-'}; "
             f"{result['timed_steps']} timed steps per run after {result['warmup_steps']} untimed", "",
             *(["**Every step here is a run's first (max_steps is at most the warm-up): cold steps, which "
                "time autotuning and allocation, the first run's most. They show that each path runs; no "
                "speedup is computed from them.**", ""] if result["warmup_steps"] == 0 else []),
             "| run | step s | rollout s | update s | sync s | tokens generated | tokens trained | density | "
             "peak GiB | vs grpo-padded | vs grpo_skip-packed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        ph = r["phase_median_s"]
        peak = "-" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.1f}"
        a = sp.get("grpo-padded", {}).get(label)
        b = sp.get("grpo_skip-packed", {}).get(label)
        lines.append(f"| {label} | {r['step_time_median']:.2f} | {ph['rollout']:.2f} | {ph['update']:.2f} | "
                     f"{ph['sync']:.2f} | {r['tokens_generated_median']:.0f} | "
                     f"{r['tokens_trained_median']:.0f} | {r['update_density_median']:.2f} | {peak} | "
                     f"{'-' if a is None else f'{a:.2f}x'} | {'-' if b is None else f'{b:.2f}x'} |")
    return "\n".join(lines) + "\n"


def run_systems(preset: BenchPreset, configs: Mapping[tuple[str, int], DPPOConfig], output_dir: str | Path, *,
                log: Callable[[str], None] = print, command: str | None = None) -> dict[str, Any]:
    """Every method of ``configs`` in every layout (LAYOUTS) for its ``max_steps``; write and return
    ``bench.json``."""

    output_dir = Path(output_dir)
    seeds = sorted({s for _, s in configs})
    if len(seeds) != 1:
        raise BenchError(f"a systems bench times one seed (its runs are step times, not learning curves); "
                         f"got seeds {seeds}: pass --seeds with one seed")
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
            results[label] = {"method": method, "layout": layout, **fields, "seed": seed,
                              **summarize_steps(records)}
            timed, warmup = results[label]["timed_steps"], results[label]["warmup_steps"]
    if engine is not None and hasattr(engine, "close"):
        engine.close()
    result = {"preset": preset.name, "kind": "systems",
              "command": command or f"dppo bench --preset {preset.name}",
              "machine": describe_machine(), "model": preset.overrides.get("model", model),
              "timed_steps": timed, "warmup_steps": warmup,
              "rollout_engine": rollout_engine, "runs": results, "speedup_vs": systems_speedups(results),
              "versions": package_versions(),
              "notes": {"timing_only": "random weights and bench.systems.synthetic_reward: step times, "
                                       "not learning",
                        "step_time_median": "median over the timed steps of the whole step (prune, rollout, "
                                            "reward, update, sync)"}}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (output_dir / "bench.md").write_text(format_systems(result))
    log(format_systems(result))
    return result
