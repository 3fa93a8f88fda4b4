"""Running the bench: every configuration built and checked first, then the runs, interleaved over seeds.

Our methods (grpo, dppo, cppo, greso) run in :class:`~dppo_core.trainer.DPPOTrainer`; the TRL peers
(trl_grpo, trl_dppo) in a TRL trainer class (:mod:`dppo_core.tools.bench.peers`). Both are evaluated by
:func:`dppo_core.evaluate.evaluate_policy`, timed into ``eval_s`` and kept out of the training time.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dppo_core.config import DPPOConfig
from dppo_core.tools.bench.evals import bench_evaluation, eval_line
from dppo_core.tools.bench.peers import TRL_PEERS, peer_trainer_class, peer_trainer_kwargs, trl_grpo_args
from dppo_core.tools.bench.presets import (
    BENCH_PRESETS,
    BenchError,
    BenchPreset,
    bench_preset,
    check_batch_matched_methods,
    check_methods,
    method_config,
    resolve_model_keyword,
    run_dir,
)
from dppo_core.tools.bench.report import describe_machine, write_bench
from dppo_core.tools.bench.summary import read_jsonl, summarize_run
from dppo_core.tools.bench.tables import fmt, format_duration

# --------------------------------------------------------------------------------------------------
# Running one method
# --------------------------------------------------------------------------------------------------


def run_ours(config: DPPOConfig, preset: BenchPreset, log: Callable[[str], None],
             on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
    """One run of our trainer (grpo, dppo, cppo, greso, and the baselines that are rollout plans: dynamic
    sampling, the offline filter); evaluations are the bench's, timed into ``eval_s``."""
    from dppo_core.rollout import HFRollout
    from dppo_core.trainer import DPPOTrainer

    class BenchTrainer(DPPOTrainer):
        def evaluate(self) -> dict[str, Any]:
            t0 = time.perf_counter()
            engine = self.engine if self.engine is not None else HFRollout(self.model, self.tokenizer)
            record = bench_evaluation(self.config, engine, self.step, preset)
            return {**record, "eval_s": time.perf_counter() - t0}

    def log_record(record: dict[str, Any]) -> None:
        if record.get("event") == "eval":
            log(eval_line(record))
        if on_record is not None:
            on_record(record)

    trainer = BenchTrainer(config, progress=False, callbacks=[log_record])
    trainer.stop_hint = ("run the same command again with --resume: the finished runs are kept, this one "
                         "starts again")
    # (a resumed bench runs it from its start, so a checkpoint would go unused)
    trainer.checkpoint_on_stop = False
    trainer.train()


def run_peer(method: str, config: DPPOConfig, preset: BenchPreset, log: Callable[[str], None],
             on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
    """One run of TRL peer ``method`` on ``config``, into ``config.output_dir``, logged like ours."""
    grpo_config, trainer_class = peer_trainer_class(method)
    from dppo_core.tools.bench.trl_runner import run_trl_trainer

    run_trl_trainer(config, preset, log, on_record, method=method, trainer_class=trainer_class,
                    grpo_config_class=grpo_config,
                    trainer_kwargs=lambda: peer_trainer_kwargs(method, config))


def run_method(method: str, config: DPPOConfig, preset: BenchPreset, log: Callable[[str], None] = print,
               on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train one method on ``config`` into ``config.output_dir``; return
    ``{"method", "seed", "elapsed_s", ...}``.

    ``on_record`` is called with every step's metrics and every evaluation (``{"event": "eval", ...}``), as
    they are logged (a notebook draws live curves with it).

    Only the logs stay (``metrics.jsonl``, ``eval.jsonl``, ``groups.jsonl``, ``config.json``); checkpoints and
    the final model are removed. ``run.json`` is written last: it marks the run as finished.
    """
    out = Path(config.output_dir)
    _clear_unfinished_run(out)  # a finished one is kept, or moved aside with the bench, by run_bench
    t0 = time.perf_counter()
    if method in TRL_PEERS:
        run_peer(method, config, preset, log, on_record)
    else:
        run_ours(config, preset, log, on_record)
    gc.collect()  # the run's models, optimizer and engine go before the next run starts
    info = {"method": method, "seed": config.seed, "elapsed_s": time.perf_counter() - t0,
            "machine": describe_machine()}
    for path in out.iterdir():
        if path.is_dir() and (path.name == "final" or path.name.startswith("checkpoint-")):
            shutil.rmtree(path)
    (out / "run.json").write_text(json.dumps(info, indent=2))
    return info


# --------------------------------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------------------------------


def interleaved(methods: Sequence[str], seeds: Sequence[int]) -> list[tuple[str, int]]:
    """The order runs are made in: per seed every method, the order rotated by one from seed to seed."""
    order = []
    for k, seed in enumerate(seeds):
        shift = k % len(methods)
        order.extend((m, seed) for m in (*methods[shift:], *methods[:shift]))
    return order


def build_configs(preset: BenchPreset, methods: Sequence[str], seeds: Sequence[int], output_dir: Path,
                  overrides: Sequence[str] = ()) -> dict[tuple[str, int], DPPOConfig]:
    """Every run's configuration, checked before the first run starts (a bad override fails at once);
    ``model: tiny-untrained`` resolved to the built model's directory."""
    import torch

    if preset.requires_gpu and not torch.cuda.is_available():
        raise BenchError(f"bench preset {preset.name!r} needs a CUDA GPU (torch sees none here); on a CPU "
                         f"run {', '.join(n for n, p in BENCH_PRESETS.items() if not p.requires_gpu)}")
    for m in methods:
        if m in TRL_PEERS:
            peer_trainer_class(m)  # TRL and the peer's trainer class can be imported
    configs = {(m, s): method_config(preset, m, s, output_dir, overrides) for s in seeds for m in methods}
    for (m, _s), c in configs.items():
        if m in TRL_PEERS:
            trl_grpo_args(c, run_dir(output_dir, m, c.seed) / "trl", m)
    return {k: c.with_overrides({"model": resolve_model_keyword(c.model)}) for k, c in configs.items()}


def holds_bench(output_dir: Path, *, resume: bool, overwrite: bool) -> Path | None:
    """Refuse an ``output_dir`` that holds a bench (``bench.json`` or ``runs/``) unless ``resume`` or
    ``overwrite``; with ``overwrite``, move it aside and return where it went."""
    from dppo_core.run.disk import check_output_dir, move_aside, must_move_aside

    found = [name for name in ("bench.json", "bench.md", "runs") if (output_dir / name).exists()]
    check_output_dir(output_dir)
    if must_move_aside(output_dir, found, resume=resume, overwrite=overwrite, what="a bench",
                       resume_hint="keep its finished runs and run the rest with --resume"):
        return move_aside(output_dir)
    return None


#: What a bench's run directory holds besides what our trainer writes (:func:`dppo_core.run.disk.writes`): the
#: TRL peers' arguments and output directory (``run_method`` starts an unfinished run again, and nothing else)
BENCH_RUN_FILES = ("trl", "trl_args.json")


def bench_run_writes(name: str) -> bool:
    """Whether a bench run (ours or a TRL peer) writes a file or directory of this ``name`` into its
    directory."""
    from dppo_core.run.disk import writes

    return name in BENCH_RUN_FILES or writes(name)


def _clear_unfinished_run(out: Path) -> None:
    """Remove an unfinished run of a bench (no ``run.json``) before it runs again; refuse anything else."""
    from dppo_core.run import RunExistsError

    if not out.exists():
        return
    if (out / "run.json").exists():
        raise RunExistsError(f"{out} holds a finished bench run (run.json); run_bench(..., resume=True) "
                             "keeps it")
    unknown = [p.name for p in out.iterdir() if not bench_run_writes(p.name)]
    if unknown:
        raise RunExistsError(f"{out} holds files a bench run does not write "
                             f"({', '.join(sorted(unknown)[:4])}); choose another output directory")
    shutil.rmtree(out)


def run_bench(name: str | BenchPreset, output_dir: str | Path, *, seeds: Sequence[int] | None = None,
              methods: Sequence[str] | None = None, overrides: Sequence[str] = (), resume: bool = False,
              overwrite: bool = False, log: Callable[[str], None] = print,
              on_record: Callable[[str, int, dict[str, Any]], None] | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run bench preset ``name`` into ``output_dir`` and return (and write) ``bench.json``'s content.

    ``name`` is a preset's name (:data:`BENCH_PRESETS`) or a :class:`BenchPreset` of your own. Every
    configuration is built and validated before the first run starts, so a bad override fails at once. An
    ``output_dir`` that holds a bench is refused (:class:`~dppo_core.run.RunExistsError`, nothing changed)
    unless ``resume``, which keeps the runs that finished before (their ``run.json`` exists) and starts the
    others again, or ``overwrite``, which moves the earlier bench to ``<output_dir>.previous-<n>`` first.
    ``on_record(method, seed, record)`` sees every step's metrics and every evaluation as they are logged.
    ``command``, the command line that made the runs, is recorded in ``bench.json``.
    """
    preset = name if isinstance(name, BenchPreset) else bench_preset(name)
    methods = check_methods(methods or preset.methods)
    check_batch_matched_methods(methods)
    seeds = tuple(dict.fromkeys(seeds)) if seeds else preset.seeds
    output_dir = Path(output_dir)
    configs = build_configs(preset, methods, seeds, output_dir, overrides)
    moved = holds_bench(output_dir, resume=resume, overwrite=overwrite)
    if moved is not None:
        log(f"--overwrite: the earlier bench in {output_dir} was moved to {moved}")
    if preset.kind == "systems":  # step times only, every method in every layout: bench/systems.py
        from dppo_core.tools.bench.systems import run_systems

        return run_systems(preset, configs, output_dir, log=log, command=command)
    order = interleaved(methods, seeds)
    log(f"dppo bench {preset.name}: {len(methods)} methods x {len(seeds)} seed(s) = {len(order)} runs into "
        f"{output_dir} ({preset.runtime})")
    for i, (m, s) in enumerate(order, 1):
        config = configs[(m, s)]
        if resume and (Path(config.output_dir) / "run.json").is_file():
            log(f"[{i}/{len(order)}] {m} seed {s}: finished before, kept")
            continue
        log(f"[{i}/{len(order)}] {m} seed {s}: {config.max_steps} steps ...")
        info = run_method(m, config, preset, log,
                          None if on_record is None else (lambda r, m=m, s=s: on_record(m, s, r)))
        run = summarize_run(read_jsonl(Path(config.output_dir) / "metrics.jsonl"),
                            read_jsonl(Path(config.output_dir) / "eval.jsonl"))
        acc = run["accuracy"]
        log(f"[{i}/{len(order)}] {m} seed {s}: {format_duration(run['wall_s'])} of training "
            f"({format_duration(info['elapsed_s'])} in all), sampled accuracy {fmt(acc['before'])} -> "
            f"{fmt(acc['after'])}")
    return write_bench(output_dir, preset, methods, seeds, command=command)
