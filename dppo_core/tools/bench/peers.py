"""The TRL peers: bench methods trained by a TRL trainer class instead of ours, logged and evaluated like
ours.

- ``trl_grpo``: TRL's ``GRPOTrainer`` on the grpo configuration (plain GRPO).
- ``trl_dppo``: ``dppo_core.integrations.trl.DPPOGRPOTrainer`` (a ``GRPOTrainer`` subclass) on the dppo
  configuration, constructed with ``estimator=make_estimator(config)``: TRL's loop with DPPO's pruning.

Both run through the same code (:mod:`dppo_core.tools.bench.trl_runner`, imported only when a peer runs, so
importing the bench stays light); only the trainer class and its extra constructor arguments differ
(:class:`TRLPeer`). This module maps a :class:`~dppo_core.config.DPPOConfig` to ``trl.GRPOConfig``
arguments (:func:`trl_grpo_args`) and checks that TRL and the peer's trainer can be imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dppo_core.tools.bench.presets import BenchError

if TYPE_CHECKING:
    from dppo_core.config import DPPOConfig

TRL_INSTALL_HINT = "pip install 'dppo-core[bench]'"


@dataclass(frozen=True)
class TRLPeer:
    """A bench method run by a TRL trainer class.

    Args:
        method: the bench method's name.
        trainer: ``"module:Class"``, the trainer class (``trl.GRPOTrainer`` or a subclass), imported when
            the peer runs.
        estimator: construct the trainer with ``estimator=make_estimator(config)`` (DPPO's pruning).
        description: what the peer is, for error messages.
    """

    method: str
    trainer: str
    estimator: bool = False
    description: str = ""


TRL_PEERS: dict[str, TRLPeer] = {p.method: p for p in (
    TRLPeer("trl_grpo", "trl:GRPOTrainer", description="TRL's GRPOTrainer"),
    TRLPeer("trl_dppo", "dppo_core.integrations.trl:DPPOGRPOTrainer", estimator=True,
            description="TRL's GRPOTrainer with DPPO's estimator (dppo_core.integrations.trl)"),
)}


def require_trl(method: str = "trl_grpo") -> tuple[type, type]:
    """TRL's ``(GRPOConfig, GRPOTrainer)``, or an error that gives the command installing TRL."""
    import warnings

    try:
        with warnings.catch_warnings():  # TRL warns on import about vLLM versions it was not tested with
            warnings.simplefilter("ignore")
            from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise BenchError(f"method {method!r} needs Hugging Face TRL, which is not installed ({exc}): "
                         f"{TRL_INSTALL_HINT}, or leave {method} out "
                         "(--methods grpo dppo cppo greso)") from exc
    return GRPOConfig, GRPOTrainer


def peer_trainer_class(method: str) -> tuple[type, type]:
    """``(GRPOConfig, trainer class)`` of TRL peer ``method``; a BenchError says what is missing."""
    import warnings

    peer = TRL_PEERS[method]
    grpo_config, _ = require_trl(method)
    module, _, name = peer.trainer.partition(":")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer_class = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise BenchError(f"method {method!r} needs {module}.{name}, {peer.description}, which cannot be "
                         f"imported ({exc}); leave {method} out (--methods ...)") from exc
    return grpo_config, trainer_class


def peer_trainer_kwargs(method: str, config: DPPOConfig) -> dict[str, Any]:
    """The constructor arguments TRL peer ``method`` adds to GRPOTrainer's (DPPO's estimator for trl_dppo)."""
    if not TRL_PEERS[method].estimator:
        return {}
    from dppo_core.estimator import make_estimator

    return {"estimator": make_estimator(config)}


def trl_lr_schedule(config: DPPOConfig) -> dict[str, Any]:
    """``config``'s learning-rate schedule in ``transformers.TrainingArguments`` terms (the same warm-up, then
    the same decay over ``max_steps``; transformers' warm-up starts one step lower, at 0)."""
    if config.lr_schedule == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if config.warmup_steps else "constant"}
    if config.min_lr_ratio == 0.0:
        return {"lr_scheduler_type": config.lr_schedule}
    if config.lr_schedule == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr",
                "lr_scheduler_kwargs": {"min_lr_rate": config.min_lr_ratio}}
    raise BenchError(f"lr_schedule=linear with min_lr_ratio={config.min_lr_ratio} has no transformers "
                     "scheduler for the TRL peer; use lr_schedule=cosine, or min_lr_ratio=0")


def trl_grpo_args(config: DPPOConfig, output_dir: str | Path, method: str = "trl_grpo") -> dict[str, Any]:
    """``trl.GRPOConfig`` keyword arguments for the GRPO run that ``config`` describes (no TRL import).

    Same group size, prompts per step, generation length and sampling, learning rate (constant, same
    warm-up), AdamW betas (0.9, 0.99), weight decay, gradient clipping, KL weight, clipping range, loss
    type, reward scaling, PPO epochs and seed. One optimizer step per batch of rollouts: micro-batches of
    at most ``micro_batch_size`` completions accumulate gradients over the whole batch, as ours do.

    ``method`` is the TRL peer the arguments are for: ``trl_grpo`` runs plain GRPO (no pruning);
    ``trl_dppo`` takes ``config``'s pruning through its estimator. Neither packs.
    """
    import torch

    from dppo_core import registry

    plan = registry.ROLLOUT_PLANS[config.plan]
    if not plan.trl:  # TRL generates each group in one call of its own: no plan but the plain one runs there
        raise BenchError(f"{method} runs TRL's own rollouts, which have no {plan.name} plan: set "
                         "rollout_plan: auto and pilot_size: 0 for it")
    if TRL_PEERS[method].estimator:
        if config.packing:
            raise BenchError(f"{method} trains TRL's padded batches: set packing: false for it")
    elif config.pruning != "none" or config.packing:
        raise BenchError(f"{method} runs plain GRPO: set pruning: none and packing: false for it")
    if config.update_mode not in ("full", "lora"):
        raise BenchError(f"{method} supports update_mode full or lora, not {config.update_mode!r}")
    total = config.prompts_per_step * config.num_generations
    per_device = max(d for d in range(1, min(config.micro_batch_size, total) + 1) if total % d == 0)
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return {
        "output_dir": str(output_dir), "seed": config.seed, "max_steps": config.max_steps,
        "per_device_train_batch_size": per_device, "gradient_accumulation_steps": total // per_device,
        "num_generations": config.num_generations, "max_completion_length": config.max_completion_length,
        "temperature": config.temperature, "top_p": config.top_p, "top_k": 0,
        "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps,
        **trl_lr_schedule(config),
        "adam_beta1": 0.9, "adam_beta2": 0.99, "weight_decay": config.weight_decay,
        "max_grad_norm": max(config.max_grad_norm, 0.0),
        "beta": config.beta, "epsilon": config.epsilon, "epsilon_high": config.epsilon_high,
        "loss_type": config.loss_type, "scale_rewards": config.scale_rewards,
        "num_iterations": config.num_iterations,
        "model_init_kwargs": {"dtype": "bfloat16" if cuda else "float32"},
        "bf16": cuda, "use_cpu": not cuda, "gradient_checkpointing": False,
        "use_vllm": config.rollout_engine == "vllm", "vllm_mode": "colocate",
        # our trainer applies no train/inference importance correction; neither does the peer
        "vllm_importance_sampling_correction": False,
        "report_to": "none", "save_strategy": "no", "logging_steps": config.max_steps, "disable_tqdm": True,
        "dataloader_pin_memory": False,
    }
