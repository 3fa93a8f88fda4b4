"""The ``dppo`` command line: ``dppo demo``, ``build``, ``eval``, ``train``, ``bench``, ``doctor`` and ``advise``.

Each subcommand is a function ``cmd_<name>(args) -> int`` registered in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import errno
import json
import shlex
import sys
import time
from pathlib import Path

from dppo_core.config import PROMPT_SCHEMES


def _add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where built models are cached (default: $DPPO_CACHE_DIR or ~/.cache/dppo_core)")


def cmd_build(args: argparse.Namespace) -> int:
    """Build (or reuse) the tiny model and, unless --no-warm-start, its warm-started version (the copy shipped
    with the package, or with --from-scratch trained here)."""
    import json

    from dppo_core.models import build_tiny_model
    from dppo_core.warm_start import WarmStartConfig, warm_start

    t0 = time.perf_counter()
    base = build_tiny_model(cache_dir=args.cache_dir, force=args.from_scratch)
    print(f"tiny model: {base}")
    if not args.no_warm_start:
        warm = warm_start(WarmStartConfig(steps=args.warm_start_steps), cache_dir=args.cache_dir,
                          force=args.from_scratch)
        shipped = json.loads((warm / "warm_start_log.json").read_text()).get("source") == "shipped"
        print(f"warm-started model: {warm}" + (" (the copy shipped with the package; --from-scratch trains it "
                                               "here, a few minutes on 2 CPU cores)" if shipped else ""))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Warm-start the tiny model, then a short GRPO vs DPPO comparison on the embedded task (bench preset ``demo``)."""
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
    command = " ".join(["dppo", "demo", "--output-dir", shlex.quote(str(args.output_dir)), "--seed", str(args.seed),
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
    """Every method of a bench preset, same budget, interleaved; writes bench.json and plots, prints a table."""
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
                raise bench.BenchError(f"--summarize rewrites an accuracy bench's bench.json; {args.preset!r} writes "
                                       "its bench.json and bench.md as it runs: run it again instead")
            result = bench.write_bench(output_dir, args.preset, args.methods or preset.methods, seeds or preset.seeds,
                                       times_from=args.times_from)
        else:
            load = bench.machine_load()
            result = bench.run_bench(args.preset, output_dir, seeds=seeds, methods=args.methods,
                                     overrides=overrides, resume=args.resume, overwrite=args.overwrite,
                                     command=_bench_command(args, output_dir, seeds, overrides))
    except (bench.BenchError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    if result.get("kind") == "systems":  # step times only: the table is already printed, no plots, no README table
        print(f"results: {output_dir / 'bench.json'} and {output_dir / 'bench.md'}")
        return 0
    print(bench.format_table(result, load))
    print(f"\nresults: {output_dir / 'bench.json'}; plots: accuracy_vs_step.png, accuracy_vs_time.png, phases.png")
    if args.readme:
        try:
            changed = bench.update_readme(args.readme, result, result["command"])
        except bench.BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.readme}: results table {'rewritten' if changed else 'already up to date'}")
    return 0


def _bench_command(args: argparse.Namespace, output_dir: Path, seeds: list[int] | None, overrides: list[str]) -> str:
    """The ``dppo bench`` command line that makes these runs (stored in bench.json and under the README table)."""
    parts = ["dppo", "bench", "--preset", args.preset, "--output-dir", str(output_dir)]
    if seeds:
        parts += ["--seeds", *map(str, seeds)]
    if args.methods:
        parts += ["--methods", *args.methods]
    return " ".join(shlex.quote(p) for p in [*parts, *overrides])


class EvalInputError(ValueError):
    """A ``dppo eval`` input that cannot work (model, benchmark, data): printed as one line, exit code 2."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers (a TCP connection to its host within ``timeout`` seconds).

    False at once when ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set.
    """
    import os
    import socket
    import threading
    from urllib.parse import urlparse

    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    answered: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)),
                                     timeout=timeout).close()
            answered.append(True)
        except (OSError, UnicodeError):
            answered.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # name resolution ignores the socket's timeout
    thread.start()
    thread.join(timeout + 0.5)
    return bool(answered and answered[0])


def _hub_cached(repo_id: str, kind: str) -> bool:
    """Whether a Hub model or dataset (``kind``) has a copy in the local Hugging Face caches."""
    import os

    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    names = [Path(constants.HF_HUB_CACHE) / f"{kind}s--{repo_id.replace('/', '--')}"]
    if kind == "dataset":
        cache = os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
        names.append(Path(cache) / repo_id.replace("/", "___"))
    return any(n.is_dir() for n in names)


def check_eval_model(model: str) -> None:
    """Refuse a ``--model`` that cannot be loaded, before any data is read (an :class:`EvalInputError`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EvalInputError(f"--model {model} is a directory without config.json; pass the directory that "
                                 "save_pretrained wrote (e.g. runs/tiny-grpo/final) or a Hub id")
        return
    if path.exists():
        raise EvalInputError(f"--model {model} is a file; pass a model directory (config.json and weights) "
                             "or a Hub id")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise EvalInputError(f"--model {model} does not exist; pass a model directory (e.g. runs/tiny-grpo/final) "
                             "or a Hub id (org/name)")
    if not _hub_cached(model, "model") and not hub_reachable():
        raise EvalInputError(f"--model {model} is no local directory, and the Hugging Face Hub is unreachable "
                             "(offline) with no cached copy; pass a local model directory, or go online")


def _go_offline() -> None:
    """Offline mode for huggingface_hub and datasets, also when they are imported already (they read the
    environment variables at import, so the constants they copied them into are set too)."""
    import os
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
        datasets.config.HF_DATASETS_OFFLINE = True


def load_eval_benchmarks(names: list[str], data_dir: Path | None, limit: int | None) -> dict:
    """The records of each benchmark, or an :class:`EvalInputError` naming the input and the fix.

    A benchmark with no local copy (no ``--data-dir``, ``$DPPO_DATA_DIR`` unset) is fetched from the Hub; when
    the Hub is unreachable and has not cached it, this fails at once instead of retrying the network.
    """
    import os

    from dppo_core.benchmark_data import BENCHMARKS, load_benchmark

    local = data_dir if data_dir is not None else os.environ.get("DPPO_DATA_DIR") or None
    by_name = [n for n in names if Path(n).expanduser().suffix != ".jsonl" and not Path(n).expanduser().exists()]
    for name in by_name:  # every name first, so a typo is reported before any data is looked for
        if name.lower().replace("-", "_") not in BENCHMARKS:
            raise EvalInputError(f"unknown benchmark {name!r}; known names: {', '.join(BENCHMARKS)} "
                                 "(or the path of a .jsonl file)")
    for name in names:  # a file that is not there: named as the user typed it, once
        path = Path(name).expanduser()
        if path.suffix == ".jsonl" and not path.is_file():
            raise EvalInputError(f"--benchmarks {name}: no such file; pass an existing .jsonl file (one "
                                 f"problem/answer object per line) or a benchmark name ({', '.join(BENCHMARKS)})")
    online: bool | None = None
    out = {}
    for name in names:
        if name in by_name and local is None:  # from the Hub
            spec = BENCHMARKS[name.lower().replace("-", "_")]
            online = hub_reachable() if online is None else online
            if not online:
                if not _hub_cached(spec.hub_id, "dataset"):
                    raise EvalInputError(
                        f"benchmark {name!r} has no local copy and the Hugging Face Hub is unreachable (offline); "
                        f"pass --data-dir DIR (a directory with {spec.file}), set DPPO_DATA_DIR=DIR, or go online")
                _go_offline()  # read the cached copy without retrying the network
        try:
            out[name] = load_benchmark(name, data_dir=data_dir, limit=limit)
        except (ValueError, OSError, ImportError) as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise EvalInputError(message if repr(name) in message else f"benchmark {name!r}: {message}") from exc
    return out


_EXTRACTION_HELP = {
    "lenient": "the boxed answer, else the final answer stated in the last sentence or display",
    "strict": "the boxed answer only (or '#### N' / 'the answer is'), as the RL reward",
}


def cmd_eval(args: argparse.Namespace) -> int:
    """pass@1 / pass@k of a model on benchmarks; prints a table and writes results plus completions as JSON."""
    names = [n for item in args.benchmarks for n in item.split(",") if n]
    try:
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
    """The run's config: a preset or a YAML file, then --output-dir / --max-steps, then key=value overrides."""
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
    """Would DPPO help a run? Its persistence, the predictor's separation, each stage's expected saving, the ceiling."""
    from dppo_core.tools.advise import AdviseError, advise, format_advice

    try:
        report = advise(args.run_dir, prompt_prune_rate=args.prompt_prune_rate,
                        completion_prune_rate=args.completion_prune_rate, prompt_scheme=args.prompt_scheme)
    except AdviseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1, ensure_ascii=False) if args.json else format_advice(report))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check this machine for the workshop: one [OK]/[WARN]/[FAIL] line per check; exit 1 on any FAIL."""
    from dppo_core.tools.doctor import STATUSES, exit_code, format_check, run_checks, where_from

    if args.gpu:
        from dppo_core.tools.gpu_check import STEP_METHODS, run_gpu_checks

        print(f"dppo doctor --gpu{' --shape ' + args.shape if args.shape else ''}: the GPU paths (on CPU: tiny "
              "shapes, CUDA-only checks skipped)", flush=True)
        checks = run_gpu_checks(shape=args.shape, cache_dir=args.cache_dir, methods=args.methods or STEP_METHODS,
                                on_result=lambda c: print(format_check(c), flush=True))
    else:
        print(f"dppo doctor{' --quick (no model build)' if args.quick else ''}: {where_from()}", flush=True)
        checks = run_checks(quick=args.quick, cache_dir=args.cache_dir,
                            on_result=lambda c: print(format_check(c), flush=True))
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return exit_code(checks)


class _KeepLaidOutText(argparse.HelpFormatter):
    """argparse's formatter, except that a description or epilog with line breaks is printed as laid out."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _as_override(value: object) -> str:
    """A default as it would be typed in ``KEY=VALUE`` (YAML)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_as_override(v) for v in value) + "]"
    return str(value) if value != "" else '""'


def config_fields_help(width: int | None = None) -> str:
    """Every ``DPPOConfig`` field with its default and its documentation, grouped as in the class (``train --help``)."""
    import dataclasses
    import re
    import shutil
    import textwrap

    from dppo_core.config import DPPOConfig, field_docs, field_groups

    width = width or max(60, min(110, shutil.get_terminal_size().columns - 2))
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(DPPOConfig)}
    docs = field_docs()

    def plain(doc: str) -> str:  # reStructuredText markup to plain text
        doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
        return doc.replace("``", "")

    out = textwrap.wrap("config fields: KEY=VALUE (values parsed as YAML), or KEY: VALUE in a --config file. The "
                        "defaults below are DPPOConfig's; a preset may set others.", width)
    for group, names in field_groups().items():
        out += ["", f"{group}:"]
        for name in names:
            out.append(f"  {name}={_as_override(defaults[name])}")
            out += textwrap.wrap(plain(docs.get(name, "")), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)


def _add_run_dir_flags(p: argparse.ArgumentParser, resume_help: str) -> None:
    """--resume and --overwrite: an output directory that holds a run is refused without one of them."""
    either = p.add_mutually_exclusive_group()
    either.add_argument("--resume", action="store_true", help=resume_help)
    either.add_argument("--overwrite", action="store_true",
                        help="if the output dir holds a run, move it to OUTPUT_DIR.previous-N first (nothing deleted)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dppo",
        description="DPPO (Dynamic Pruning Policy Optimization) from scratch: GRPO that prunes what carries "
                    "no signal, keeps its loss and gradient unbiased, and packs what is left.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("demo", help="warm-start the embedded tiny model, then a short GRPO vs DPPO comparison")
    _add_cache_dir(p)
    p.add_argument("--output-dir", type=Path, default=Path("runs/demo"),
                   help="where the runs, bench.json and the plots go (default runs/demo)")
    p.add_argument("--n-per-level", type=int, default=None,
                   help="held-out problems per level in each evaluation (default: the demo preset's, 50)")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per problem at temperature 1 (default: the demo preset's, 2)")
    p.add_argument("--warm-start-steps", type=int, default=None, help="override the warm start's length")
    p.add_argument("--seed", type=int, default=0)
    _add_run_dir_flags(p, "keep the runs that finished before (after an interruption) and run the rest")
    p.set_defaults(func=cmd_demo)

    from dppo_core.tools.bench import BENCH_PRESETS, METHODS

    p = sub.add_parser(
        "bench", help="GRPO, DPPO, CPPO, GRESO and TRL's GRPOTrainer (plain and with DPPO's pruning) side by side: "
                      "bench.json, plots, a table",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every method of a bench preset with the same model, prompts, seed and budget, "
                    "interleaved (round-robin over methods per seed), and write DIR/bench.json, "
                    "DIR/*.png and DIR/runs/METHOD/seed-S/{metrics,eval}.jsonl.\n\npresets:\n  "
                    + "\n  ".join(f"{p_.name}: {p_.description} ({p_.runtime})" for p_ in BENCH_PRESETS.values())
                    + "\n\nKEY=VALUE sets a DPPOConfig field for every method (before the method's own "
                    "settings); METHOD.KEY=VALUE for one method, e.g. dppo.completion_prune_rate=0.3.")
    p.add_argument("--preset", choices=list(BENCH_PRESETS), default="cpu-smoke",
                   help="the bench preset (default cpu-smoke)")
    p.add_argument("--output-dir", type=Path, default=None, help="default runs/bench-PRESET")
    p.add_argument("--seeds", nargs="+", default=None, metavar="SEED", help="seeds to run (default: the preset's)")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help=f"methods to run, grpo included (default: the preset's; from {', '.join(METHODS)})")
    _add_run_dir_flags(p, "keep the runs that finished before (after an interruption) and run the rest")
    p.add_argument("--summarize", action="store_true",
                   help="only rewrite bench.json and the plots from the finished runs in the output dir")
    p.add_argument("--times-from", type=Path, default=None, metavar="DIR",
                   help="with --summarize: take every time from DIR's runs of the same methods and seeds, which must "
                        "have trained identically (each step's loss and token counts equal; checked), e.g. to read a "
                        "larger evaluation of the same training on the timing of one side-by-side run")
    p.add_argument("--list", action="store_true", help="list the bench presets and exit")
    p.add_argument("--readme", type=Path, default=None, metavar="FILE",
                   help="also rewrite the results table between FILE's <!-- bench:PRESET:start/end --> markers")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="DPPOConfig fields to override")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("build", help="build (and warm-start) the embedded tiny model into the cache")
    _add_cache_dir(p)
    p.add_argument("--no-warm-start", action="store_true", help="only build the untrained model")
    p.add_argument("--warm-start-steps", type=int, default=None, help="override the warm start's length")
    p.add_argument("--from-scratch", action="store_true",
                   help="rebuild the tokenizer and model and train the warm start here, replacing what the cache "
                        "holds (by default the warm start shipped with the package is used)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("eval", help="pass@1 / pass@k of a model on math benchmarks (gsm8k, math500, ...)")
    p.add_argument("--model", required=True, help="model directory (or Hub id when online)")
    p.add_argument("--benchmarks", nargs="+", default=["gsm8k"],
                   help="benchmark names or .jsonl paths, space- or comma-separated (default gsm8k)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="directory with the benchmark .jsonl files (default: $DPPO_DATA_DIR, else the Hub)")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark only")
    p.add_argument("--samples", type=int, default=1, help="samples per problem, n (default 1)")
    p.add_argument("--k", type=int, nargs="+", default=[1], help="report pass@k for these k <= n (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); use >0 with --samples >1")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=1024, help="new tokens per completion at most")
    p.add_argument("--batch-size", type=int, default=32, help="problems per generate call")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path("eval.json"), help="results JSON (default eval.json)")
    p.add_argument("--extraction", choices=["lenient", "strict"], default="lenient",
                   help="how a completion's answer is found: lenient (default) takes the boxed answer, else the "
                        "final answer stated in the last sentence or display; strict only the boxed one (or "
                        "'#### N' / 'the answer is'), as the RL reward does")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("train", help="train with GRPO / DPPO from a preset or a YAML config",
                       description="Train with GRPO / DPPO. Any DPPOConfig field can be overridden as key=value "
                                   "(values parsed as YAML), e.g. `dppo train --preset tiny-grpo learning_rate=3e-5`.",
                       epilog=config_fields_help(), formatter_class=_KeepLaidOutText)
    p.add_argument("--preset", default=None, help="a preset shipped with the package (default tiny-grpo); "
                                                  "see dppo_core/presets/")
    p.add_argument("--config", type=Path, default=None, help="a YAML file of DPPOConfig fields")
    p.add_argument("--output-dir", type=Path, default=None, help="where metrics and checkpoints go")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps to run")
    _add_run_dir_flags(p, "continue from the last checkpoint in the output dir")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="DPPOConfig fields to override")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("doctor", help="check this machine (Python, packages, vLLM, memory, disk, the tiny model)")
    _add_cache_dir(p)
    p.add_argument("--quick", action="store_true", help="skip building and running the tiny model")
    p.add_argument("--gpu", action="store_true",
                   help="check the GPU paths instead: packed bf16 varlen log-probs, QLoRA, colocated vLLM, one step "
                        "of every method (on a CPU: the same checks at tiny shapes, CUDA-only ones skipped)")
    p.add_argument("--shape", choices=("qwen3-1.7b", "qwen3-0.6b", "tiny"), default=None,
                   help="with --gpu: the model shape (random weights); default qwen3-1.7b on CUDA, tiny on CPU")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help="with --gpu: the methods whose training step is checked (default: every method of ours)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("advise", help="would DPPO help this run? read off its groups.jsonl (any method's): "
                                      "persistence, the predictor's separation, each stage's saving, the ceiling")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="a run's output directory holding groups.jsonl (metrics.jsonl and config.json are read "
                        "where present), or the groups.jsonl itself")
    p.add_argument("--prompt-prune-rate", type=float, default=0.5,
                   help="the prompt stage's rate replayed, the expected share of prompts not rolled out (default 0.5)")
    p.add_argument("--completion-prune-rate", type=float, default=None,
                   help="the completion stage's rate replayed (default: the tiny-dppo preset's, 0.5)")
    p.add_argument("--prompt-scheme", choices=PROMPT_SCHEMES, default=None,
                   help="the prompt keep rule replayed (default: the tiny-dppo preset's, posterior; fitted is sharper "
                        "where many prompts are solved always or never)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON instead of words")
    p.set_defaults(func=cmd_advise)
    return parser


#: errno values of an OSError that a user fixes on their machine, and what to say
_OS_FIXES = {errno.ENOSPC: "free some space or choose another --output-dir",
             errno.EDQUOT: "free some space or choose another --output-dir",
             errno.EACCES: "choose a path you can write, or change its permissions",
             errno.EPERM: "choose a path you can write, or change its permissions",
             errno.EROFS: "choose a path on a writable file system"}


def user_error(exc: BaseException) -> str | None:
    """The one line to print for an error the user caused (bad settings, data, files, directories, a full disk),
    or None for anything else (a bug: its traceback is shown). Each case is a row of docs/bad_inputs.md."""
    from dppo_core.config import ConfigError
    from dppo_core.tools.bench import BenchError

    if isinstance(exc, (ConfigError, BenchError, EvalInputError)):
        return str(exc)
    if not isinstance(exc, OSError) or _inside_the_package(exc.filename):  # a file of ours missing: a bug
        return None
    if isinstance(exc, FileNotFoundError):
        return str(exc) if exc.filename is None else f"{exc.filename} does not exist ({exc.strerror})"
    if exc.errno in _OS_FIXES:
        where = f" at {exc.filename}" if exc.filename else ""
        note = ("; a run's last checkpoint is complete (--resume continues from it)"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "")
        return f"{exc.strerror or exc}{where}: {_OS_FIXES[exc.errno]}{note}"
    return None


def _inside_the_package(filename: object) -> bool:
    package = Path(__file__).resolve().parents[1]  # dppo_core/ (this is dppo_core/tools/cli.py)
    return isinstance(filename, (str, Path)) and Path(filename).resolve().is_relative_to(package)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "warm_start_steps", None) is None and hasattr(args, "warm_start_steps"):
        from dppo_core.warm_start import WarmStartConfig

        args.warm_start_steps = WarmStartConfig.steps
    try:
        return args.func(args)
    except KeyboardInterrupt:
        from dppo_core.run import StopRequest

        if not StopRequest.stopping:  # a training loop's stop has already said what it wrote and what to run next
            print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # an error the user can fix is one line; a bug keeps its traceback
        line = user_error(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    finally:
        if "dppo_core.distributed" in sys.modules:  # a data-parallel run leaves its process group
            sys.modules["dppo_core.distributed"].shutdown()


if __name__ == "__main__":
    sys.exit(main())
