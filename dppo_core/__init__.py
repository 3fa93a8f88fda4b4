"""dppo_core: DPPO (Dynamic Pruning Policy Optimization) for LLM reasoning RL, from scratch.

The public surface others build on:

- :class:`DPPOConfig` and :class:`DPPOTrainer` (``from dppo_core import DPPOConfig, DPPOTrainer``)
- :mod:`dppo_core.rewards` (``math_reward``, ``extract_answer``), :mod:`dppo_core.tasks` (the embedded
  task), :mod:`dppo_core.benchmark_data` (``load_benchmark``), :mod:`dppo_core.grpo`,
  :mod:`dppo_core.estimator`, :mod:`dppo_core.rollout`

The whole list, and the layers behind it: docs/architecture.md ("Public surface").
"""

__version__ = "0.1.0"

__all__ = ["DPPOConfig", "DPPOTrainer", "__version__"]


def __getattr__(name: str):
    # Imported lazily: `import dppo_core` stays fast and does not pull in torch or transformers.
    if name == "DPPOConfig":
        from dppo_core.config import DPPOConfig

        return DPPOConfig
    if name == "DPPOTrainer":
        from dppo_core.trainer import DPPOTrainer

        return DPPOTrainer
    raise AttributeError(f"module 'dppo_core' has no attribute {name!r}")
