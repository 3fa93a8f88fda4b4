"""Running a TRL trainer class on a bench configuration, timed, logged and evaluated like our trainer.

The trainer class is a parameter (``trl.GRPOTrainer`` for ``trl_grpo``, ``DPPOGRPOTrainer`` for
``trl_dppo``): :func:`timed_trainer_class` puts :class:`TimedTrainerMixin` in front of it, which times
the rollout and reward phases and counts tokens per optimizer step; :class:`BenchCallback` times each
optimizer step, writes ``metrics.jsonl`` and evaluates at our cadence into ``eval.jsonl`` with
:func:`dppo_core.evaluate.evaluate_policy`, the trainer's own evaluation. Imported only when a TRL peer
runs (it imports transformers).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from dppo_core.config import DPPOConfig
from dppo_core.tools.bench.evals import bench_evaluation, eval_line
from dppo_core.tools.bench.peers import trl_grpo_args
from dppo_core.tools.bench.presets import BenchError, BenchPreset

STEP_STATS = ("time_rollout", "time_reward", "tokens_generated", "tokens_trained", "update_capacity",
              "reward_sum", "completions")


class TimedTrainerMixin:
    """In front of a GRPOTrainer (sub)class: times its rollout and reward phases and counts tokens, per
    optimizer step (:class:`BenchCallback` resets the counts when a step begins)."""

    step_stats: dict[str, float]

    def reset_step_stats(self) -> None:
        self.step_stats = dict.fromkeys(STEP_STATS, 0)

    def _generate(self, prompts):
        t0 = time.perf_counter()
        result = super()._generate(prompts)
        self.step_stats["time_rollout"] += time.perf_counter() - t0
        self.step_stats["tokens_generated"] += sum(len(ids) for ids in result[1])  # completion token ids
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        t0 = time.perf_counter()
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.step_stats["time_reward"] += time.perf_counter() - t0
        self.step_stats["reward_sum"] += float(rewards.nansum())
        self.step_stats["completions"] += rewards.shape[0]
        return rewards

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        rows = batch["completion_ids"].shape[0]
        self.step_stats["update_capacity"] += rows * (batch["prompt_ids"].shape[1]
                                                      + batch["completion_ids"].shape[1])
        self.step_stats["tokens_trained"] += int(batch["completion_mask"].sum())
        return batch


def timed_trainer_class(trainer_class: type) -> type:
    """``trainer_class`` with :class:`TimedTrainerMixin` in front (``GRPOTrainer`` ->
    ``TimedGRPOTrainer``)."""
    return type(f"Timed{trainer_class.__name__}", (TimedTrainerMixin, trainer_class), {})


class RunLog:
    """A TRL run's ``metrics.jsonl`` and ``eval.jsonl``, in our trainer's format, and its evaluations."""

    def __init__(self, config: DPPOConfig, preset: BenchPreset, tokenizer: Any, log: Callable[[str], None],
                 on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config, self.preset, self.tokenizer = config, preset, tokenizer
        self.out = Path(config.output_dir)
        self.log, self.on_record = log, on_record

    def emit(self, record: dict[str, Any], name: str) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.on_record is not None:
            self.on_record(record)

    def evaluate(self, model: Any, step: int) -> None:
        """Evaluate ``model`` (the trainer's policy) as ours are evaluated, timed into ``eval_s``."""
        from dppo_core.rollout import HFRollout

        t0 = time.perf_counter()
        record = bench_evaluation(self.config, HFRollout(model, self.tokenizer), step, self.preset)
        self.emit({"event": "eval", **record, "eval_s": time.perf_counter() - t0}, "eval.jsonl")
        self.log(eval_line(record))


class BenchCallback(TrainerCallback):
    """Step time (optimizer step begin to end), the step's phases and tokens, evaluations at our cadence."""

    def __init__(self, config: DPPOConfig, run_log: RunLog) -> None:
        self.config, self.run_log = config, run_log
        self.trainer: Any = None  # the timed trainer, set once it is constructed
        self.t0 = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.run_log.evaluate(self.trainer.model, 0)

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.reset_step_stats()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step_time = time.perf_counter() - self.t0
        s = self.trainer.step_stats
        self.run_log.emit({
            "step": state.global_step, "reward_mean": s["reward_sum"] / max(1, s["completions"]),
            "tokens_generated": int(s["tokens_generated"]), "tokens_trained": int(s["tokens_trained"]),
            "update_capacity": int(s["update_capacity"]),
            "update_density": s["tokens_trained"] / max(1, s["update_capacity"]),
            "time_prune": 0.0, "time_rollout": s["time_rollout"], "time_reward": s["time_reward"],
            "time_pack": 0.0, "time_update": step_time - s["time_rollout"] - s["time_reward"],
            "time_sync": 0.0, "step_time": step_time}, "metrics.jsonl")
        c = self.config
        if c.eval_steps and state.global_step % c.eval_steps == 0 and state.global_step < c.max_steps:
            self.run_log.evaluate(self.trainer.model, state.global_step)


def run_trl_trainer(config: DPPOConfig, preset: BenchPreset, log: Callable[[str], None],
                    on_record: Callable[[dict[str, Any]], None] | None = None, *, method: str = "trl_grpo",
                    trainer_class: type, grpo_config_class: type,
                    trainer_kwargs: Callable[[], Mapping[str, Any]] = dict) -> None:
    """One run of ``trainer_class`` (TRL's GRPOTrainer or a subclass) on ``config``'s model, prompts and
    rewards, logged like ours into ``config.output_dir``.

    ``trainer_kwargs()`` gives the constructor arguments the class takes on top of GRPOTrainer's (called
    right before it is constructed); ``method`` names the run in messages and picks the argument checks
    of :func:`~dppo_core.tools.bench.peers.trl_grpo_args`.
    """
    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from dppo_core.model_files import quiet_transformers
    from dppo_core.policy import resolve_model_path
    from dppo_core.rewards import accuracy_reward

    out, rows, args = _prepare_run(config, method)
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    model_path = resolve_model_path(config)
    tokenizer = _tokenizer(model_path)
    callback = BenchCallback(config, RunLog(config, preset, tokenizer, log, on_record))
    from datasets import Dataset

    with _quiet_transformers_logs(), quiet_transformers():
        trainer = timed_trainer_class(trainer_class)(
            model=model_path, reward_funcs=[accuracy_reward], args=grpo_config_class(**args),
            train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
            peft_config=_peft_config(config), callbacks=[callback], **trainer_kwargs())
        callback.trainer = trainer
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        trainer.train()
        callback.run_log.evaluate(trainer.model, trainer.state.global_step)
    shutil.rmtree(out / "trl", ignore_errors=True)


def _prepare_run(config: DPPOConfig, method: str) -> tuple[Path, list[dict[str, Any]], dict[str, Any]]:
    """A fresh output directory with ``config.json`` and ``trl_args.json``; the prompt rows and the
    GRPOConfig arguments. The pool must be sampled uniformly (TRL samples its dataset's rows so)."""
    from dppo_core.data import build_prompt_source

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "eval.jsonl"):
        (out / name).unlink(missing_ok=True)
    source = build_prompt_source(config)
    if source.weights is not None and len(set(source.weights)) > 1:
        raise BenchError(f"{method} samples its dataset's rows uniformly, but this task weights them; set "
                         "train_pool_size (as the bench presets do) so every method samples one pool "
                         "uniformly")
    args = trl_grpo_args(config, out / "trl", method)
    (out / "config.json").write_text(config.to_json())
    (out / "trl_args.json").write_text(json.dumps({k: v for k, v in args.items() if k != "output_dir"},
                                                  indent=2))
    return out, source.rows, args


def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    return tokenizer


def _peft_config(config: DPPOConfig) -> Any:
    """LoRA on ``config``'s target modules for ``update_mode: lora``; None for full fine-tuning."""
    if config.update_mode != "lora":
        return None
    from peft import LoraConfig

    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")


@contextlib.contextmanager
def _quiet_transformers_logs() -> Iterator[None]:
    """Only errors from transformers' logger inside the block (TRL's trainer logs setup notices as
    warnings)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
