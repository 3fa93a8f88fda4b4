"""dppo_core: DPPO (Dynamic Pruning Policy Optimization) for LLM reasoning RL, from scratch.

The public surface others build on:

- :class:`DPPOConfig` and :class:`DPPOTrainer` (``from dppo_core import DPPOConfig, DPPOTrainer``)
- :mod:`dppo_core.rewards` (``math_reward``, ``extract_answer``), :mod:`dppo_core.tasks` (the embedded
  task), :mod:`dppo_core.benchmark_data` (``load_benchmark``), :mod:`dppo_core.grpo`,
  :mod:`dppo_core.estimator`, :mod:`dppo_core.rollout`

The whole list, and the layers behind it: docs/architecture.md ("Public surface").
"""

import logging as _logging

__version__ = "0.1.0"


class _DropBitsandbytesKernelNotice(_logging.Filter):
    """bitsandbytes' CPU backend, on an AVX512-BF16 CPU, tries to fetch an optional inference kernel from the
    Hugging Face Hub when it is imported (by PEFT, so by every ``dppo`` command) and warns "Failed to load CPU
    gemm_4bit_forward from kernels-community" when the ``kernels`` package is absent. The trainer turns that
    inference path off anyway (:func:`dppo_core.policy.disable_4bit_cpu_bf16_path`), so the notice only reads
    like a broken install; this filter drops that one message and lets every other warning through."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "gemm_4bit_forward from kernels-community" not in str(record.msg)


_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropBitsandbytesKernelNotice())

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
