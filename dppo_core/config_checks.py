"""What a :class:`~dppo_core.config.DPPOConfig` may hold: the allowed values of its enumerated fields, the
checks of every field, and :class:`ConfigError`, whose message names the field and how to fix it.

The enumerations are defined here once (torch-free, so the config stays light); :mod:`dppo_core.grpo`,
:mod:`dppo_core.pruning` and :mod:`dppo_core.draws` check their arguments against the same tuples. All of
these are importable from :mod:`dppo_core.config` too. :func:`check_fields` is what ``DPPOConfig.validate``
runs; it takes the config as ``Any`` because this module sits below :mod:`dppo_core.config` (which imports
it) and may not import it back. :func:`coerce_value` converts a YAML or command-line value to a field's type,
for :meth:`~dppo_core.config.DPPOConfig.from_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dppo_core import registry

UPDATE_MODES = ("full", "lora", "qlora4", "qlora8")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "torch_varlen")
ROLLOUT_ENGINES = registry.names(registry.ROLLOUT_ENGINES)
#: rollout_correction: dppo_core.grpo's engine weights
ROLLOUT_CORRECTIONS = ("auto", "off", "token", "sequence")
#: dppo_core.estimator.ESTIMATORS has one entry per mode
PRUNING_MODES = ("none", "dppo", "cppo", "greso", "pods")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")  # loss normalisers of dppo_core.grpo.policy_loss
SCALE_REWARDS = ("group", "batch", "none")  # advantage scalings of dppo_core.grpo.group_advantages
#: keep-probability schemes of dppo_core.pruning shared by both stages
SCHEMES = tuple(n for n in registry.PROMPT_SCHEMES if n in registry.COMPLETION_SCHEMES)
#: prompt_scheme's rules that read a prompt's whole history through dppo_core.posterior (rewards as pass
#: rates)
POSTERIOR_PROMPT_SCHEMES = registry.names(registry.PROMPT_SCHEMES, reads="pass_counts")
PROMPT_SCHEMES = registry.names(registry.PROMPT_SCHEMES)
#: length: |A| / len^gamma under a token budget
COMPLETION_SCHEMES = registry.names(registry.COMPLETION_SCHEMES)
ROLLOUT_PLANS = ("auto", *registry.names(registry.ROLLOUT_PLANS))  # rollout_plan: dppo_core.plans
CONTINUE_SCHEMES = ("constant", "posterior")  # continue_scheme: dppo_core.posterior.continue_probs
FIXED_SIZE_DESIGNS = ("systematic", "sorted", "pivotal")  # fixed_size_design: dppo_core.draws.sample_keep
LR_SCHEDULES = ("constant", "cosine", "linear")  # lr_schedule: dppo_core.config.learning_rate_at


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and how to fix it."""


def check_fields(c: Any) -> None:
    """Raise :class:`ConfigError` naming the first field of config ``c`` that is invalid, and how to fix
    it."""
    _check_sampling_and_objective(c)
    _check_plan(c)
    _check_pruning(c)
    _check_layout_and_run(c)


def _needs(c: Any) -> Callable[[bool, str, str], None]:
    """``need(cond, name, msg)``: raise a :class:`ConfigError` for field ``name`` of ``c`` unless ``cond``."""

    def need(cond: bool, name: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{name}={getattr(c, name)!r}: {msg}")

    return need


def _check_sampling_and_objective(c: Any) -> None:
    need = _needs(c)
    need(c.num_generations >= 2, "num_generations",
         "group advantages need at least 2 completions per prompt; use 4-16")
    need(c.prompts_per_step >= 1, "prompts_per_step", "must be at least 1")
    need(c.max_completion_length >= 1, "max_completion_length", "must be at least 1 token")
    need(c.temperature > 0, "temperature", "RL needs sampling: use a temperature > 0, e.g. 1.0")
    need(0 < c.top_p <= 1, "top_p", "must be in (0, 1]")
    need(c.rollout_engine in ROLLOUT_ENGINES, "rollout_engine", f"choose one of {', '.join(ROLLOUT_ENGINES)}")
    need(c.rollout_correction in ROLLOUT_CORRECTIONS, "rollout_correction",
         f"choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
    need(c.rollout_correction_cap >= 1, "rollout_correction_cap",
         "the truncation must be >= 1 (below 1 it would shrink on-policy tokens), e.g. 2")
    need(c.learning_rate > 0, "learning_rate", "must be positive, e.g. 1e-4 (full) or 3e-4 (LoRA)")
    need(c.beta >= 0, "beta", "the KL weight must be >= 0 (0 disables the KL term)")
    need(0 < c.epsilon < 1, "epsilon", "the clipping range must be in (0, 1), e.g. 0.2")
    need(c.epsilon_high is None or c.epsilon_high > 0, "epsilon_high", "must be > 0 or None")
    need(c.loss_type in LOSS_TYPES, "loss_type", f"choose one of {', '.join(LOSS_TYPES)}")
    need(c.scale_rewards in SCALE_REWARDS, "scale_rewards", f"choose one of {', '.join(SCALE_REWARDS)}")
    need(c.num_iterations >= 1, "num_iterations", "must be at least 1 PPO epoch")
    need(c.micro_batch_size >= 1, "micro_batch_size", "must be at least 1 completion")

def _check_plan(c: Any) -> None:
    """The rollout plan (dppo_core.registry.ROLLOUT_PLANS) and what it needs of the other fields."""
    need = _needs(c)
    need(c.rollout_plan in ROLLOUT_PLANS, "rollout_plan", f"choose one of {', '.join(ROLLOUT_PLANS)}")
    plan = c.plan
    need(c.pilot_size == 0 or plan == "pilot", "pilot_size",
         f"a pilot is the pilot rollout plan, not rollout_plan {c.rollout_plan!r}; set rollout_plan: auto "
         "(or pilot), or pilot_size: 0")
    need(plan != "pilot" or c.pilot_size > 0, "rollout_plan",
         "the pilot plan rolls out pilot_size completions first; set pilot_size (e.g. 2), or "
         "rollout_plan: auto")
    need(plan not in ("dynamic_sampling", "dapo_oversampled") or c.pruning in ("none", "greso")
         or c.prompt_prune_rate == 0, "rollout_plan",
         f"dynamic sampling with pruning {c.pruning!r} and prompt_prune_rate > 0 would drop its prompt "
         "weights 1/π; use pruning: greso (unweighted skips) or prompt_prune_rate: 0")


def _check_pruning(c: Any) -> None:
    need = _needs(c)
    need(c.pruning in PRUNING_MODES, "pruning", f"choose one of {', '.join(PRUNING_MODES)}")
    for name in ("prompt_prune_rate", "completion_prune_rate"):
        need(0 <= getattr(c, name) < 1, name, "a prune rate must be in [0, 1), e.g. 0.5")
    need(c.prompt_scheme in PROMPT_SCHEMES, "prompt_scheme", f"choose one of {', '.join(PROMPT_SCHEMES)}")
    need(c.completion_scheme in COMPLETION_SCHEMES, "completion_scheme",
         f"choose one of {', '.join(COMPLETION_SCHEMES)}")
    need(c.fixed_size_design in FIXED_SIZE_DESIGNS, "fixed_size_design",
         f"choose one of {', '.join(FIXED_SIZE_DESIGNS)}")
    need(c.posterior_half_life is None or c.posterior_half_life > 0, "posterior_half_life",
         "must be > 0 steps (e.g. 20) or null (never discounted)")
    need(c.length_exponent >= 0, "length_exponent", "must be >= 0 (0.5: p ∝ |A| / sqrt(len))")
    need(c.completion_target_ess is None or c.completion_target_ess > 0, "completion_target_ess",
         "must be > 0 (an effective number of completions per step, e.g. 64) or null (the fixed rate)")
    for name in ("min_prompt_keep_prob", "min_completion_keep_prob"):
        need(0 < getattr(c, name) <= 1, name,
             "a keep-probability floor must be in (0, 1]; 0 would make the estimator biased")
    need(c.max_tokens_per_row >= 2, "max_tokens_per_row",
         "a row must hold at least a prompt token and a completion token")
    need(c.packing_window >= 1, "packing_window", "must be at least 1 (1: next fit in order)")
    need(c.packing_rows_per_micro_batch >= 1, "packing_rows_per_micro_batch", "must be at least 1 row")
    need(c.prompt_window_factor >= 1, "prompt_window_factor", "must be at least 1")
    need(c.history_max_age is None or c.history_max_age >= 1, "history_max_age", "must be >= 1 or null")
    need(c.pruning != "none" or (c.prompt_prune_rate == 0 and c.completion_prune_rate == 0),
         "pruning", "prune rates are set but pruning is 'none'; set pruning: dppo (or cppo/greso)")
    dppo_prunes_prompts = c.pruning == "dppo" and c.prompt_prune_rate > 0
    need(not (dppo_prunes_prompts and c.loss_type == "dapo"), "loss_type",
         "dapo divides by the tokens of the rolled-out completions, which prompt pruning changes (the pruned "
         "loss would be about 1 / mean(keep probability) times the full batch's); use loss_type: dr_grpo (a "
         "token sum over a constant normaliser) or grpo, or prompt_prune_rate: 0")
    need(not (dppo_prunes_prompts and c.scale_rewards == "batch"), "scale_rewards",
         "a batch-wide reward std over the kept prompts depends on which were kept, so the advantages would "
         "be biased; use scale_rewards: group (or none), or prompt_prune_rate: 0")
    need(0 <= c.pilot_size < c.num_generations, "pilot_size",
         f"the pilot is part of each group of num_generations={c.num_generations}: use 0 (off) up to "
         f"{c.num_generations - 1}, e.g. 2")
    need(c.pilot_size == 0 or c.pruning == "dppo", "pilot_size",
         f"a pilot weighs continued all-equal groups 1 / c, which only pruning: dppo does (not "
         f"{c.pruning!r}); set pruning: dppo (rates 0 prune nothing else) or pilot_size: 0")
    need(0 < c.continue_probability <= 1, "continue_probability",
         "must be in (0, 1] (0 would stop every all-equal pilot and bias the estimate), e.g. 0.25")
    need(c.continue_scheme in CONTINUE_SCHEMES, "continue_scheme",
         f"choose one of {', '.join(CONTINUE_SCHEMES)}")
    need(not (c.pilot_size and c.loss_type == "dapo"), "loss_type",
         "dapo divides by the rolled-out completions' tokens, which the pilot's stops change; use dr_grpo or "
         "grpo, or pilot_size: 0")
    need(not (c.pilot_size and c.scale_rewards == "batch"), "scale_rewards",
         "a batch-wide reward std over the continued groups depends on which were continued; use "
         "scale_rewards: group (or none), or pilot_size: 0")
    need(c.pruning != "cppo" or c.prompt_prune_rate == 0, "prompt_prune_rate",
         "CPPO prunes completions only; set prompt_prune_rate: 0 or use pruning: dppo")
    need(c.pruning != "pods" or c.prompt_prune_rate == 0, "prompt_prune_rate",
         "PODS down-samples completions only; set prompt_prune_rate: 0 or use pruning: dppo")
    need(c.pruning != "greso" or c.completion_prune_rate == 0, "completion_prune_rate",
         "GRESO skips prompts only; set completion_prune_rate: 0 or use pruning: dppo")
    target = c.greso_target_zero_variance
    need(target is None or (c.pruning == "greso" and 0 < target < 1 and c.prompt_prune_rate == 0),
         "greso_target_zero_variance", "GRESO's adaptive rule needs pruning: greso, a target in (0, 1) (its "
         "authors use 0.25) and prompt_prune_rate: 0 (the constant skip rate it replaces); or leave it null")

def _check_layout_and_run(c: Any) -> None:
    need = _needs(c)
    need(c.update_mode in UPDATE_MODES, "update_mode", f"choose one of {', '.join(UPDATE_MODES)}")
    need(c.attn_implementation in ATTN_IMPLEMENTATIONS, "attn_implementation",
         f"choose one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    varlen = c.attn_implementation in ("flash_attention_2", "torch_varlen")
    need(not (varlen and c.device == "cpu"), "attn_implementation",
         f"{c.attn_implementation} runs on CUDA only; use auto or sdpa on CPU")
    need(not (varlen and c.shared_prefix), "attn_implementation",
         f"the shared-prefix layout needs an attention mask, which {c.attn_implementation} does not take; "
         "use auto (segment attention), sdpa, or set shared_prefix: false")
    need(c.lora_r >= 1, "lora_r", "the LoRA rank must be at least 1")
    need(c.max_steps >= 1, "max_steps", "must be at least 1")
    need(c.lr_schedule in LR_SCHEDULES, "lr_schedule", f"choose one of {', '.join(LR_SCHEDULES)}")
    need(0.0 <= c.min_lr_ratio <= 1.0, "min_lr_ratio",
         "must be in [0, 1] (a fraction of learning_rate, e.g. 0.1)")
    need(c.warmup_steps >= 0, "warmup_steps", "must be >= 0 (0: no warm-up)")
    need(c.save_steps >= 0, "save_steps", "must be >= 0 (0: only at the end)")
    need(c.eval_steps >= 0, "eval_steps", "must be >= 0 (0: only before the first step and after the last)")
    need(c.device in ("auto", "cpu", "cuda"), "device", "choose auto, cpu or cuda")
    need(len(c.train_levels) > 0, "train_levels", "give at least one level, e.g. [2, 3, 4, 5]")
    need(c.few_shot >= 0, "few_shot", "give 0 (no examples) or the number of worked examples, e.g. 1")
    need(c.few_shot == 0 or c.task == "arithmetic", "few_shot",
         "worked examples come from the embedded task; for another task write them into each row's prompt as "
         "user/assistant messages (chat rows), and set few_shot: 0")
    need(c.system_prompt is None or c.system_prompt.strip() != "", "system_prompt",
         "give the system message's text, or null for none (the model's chat template may add its own)")
    need(c.cpu_threads is None or c.cpu_threads >= 1, "cpu_threads",
         "give at least 1, or null for one per core")
    need(c.train_pool_size is None or c.train_pool_size >= 1, "train_pool_size",
         "a training pool needs at least 1 prompt, e.g. 256; or null for the whole training set")
    need(c.eval_benchmark_limit is None or c.eval_benchmark_limit >= 1, "eval_benchmark_limit",
         "evaluate on at least 1 problem per benchmark, or null for all")
    need(c.eval_levels is None or len(c.eval_levels) > 0, "eval_levels",
         "give at least one level, or null for the training levels")
    if c.level_weights is not None:
        need(len(c.level_weights) == len(c.train_levels) and min(c.level_weights) >= 0
             and sum(c.level_weights) > 0, "level_weights",
             f"give {len(c.train_levels)} non-negative weights (one per train level) or null")


def coerce_value(name: str, value: Any, type_text: str, source: str) -> Any:
    """Convert a YAML/CLI value to the field's type (YAML reads ``1e-4`` as a string, for example)."""
    optional = "None" in type_text
    if value is None:
        if optional or type_text == "Any":
            return None
        raise ConfigError(f"{source}: {name} may not be null")
    base = type_text.replace("| None", "").strip()

    def fail() -> ConfigError:
        return ConfigError(f"{source}: {name}={value!r} is not a valid {base}")

    try:
        if base == "float":
            if isinstance(value, bool):
                raise fail()
            return float(value)
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise fail()
            return int(value)
        if base == "bool":
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise fail()
            return value
        if base.startswith("tuple["):
            items = value if isinstance(value, (list, tuple)) else [value]
            inner = base[len("tuple["):].split(",")[0].strip()
            conv: Callable[[Any], Any] = {"int": int, "float": float, "str": str}.get(inner, lambda x: x)
            return tuple(conv(x) for x in items)
        if base == "str":
            return str(value)
    except (TypeError, ValueError) as exc:
        raise fail() from exc
    return value
