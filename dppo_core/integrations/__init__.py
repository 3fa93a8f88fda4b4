"""DPPO's estimator inside other RL frameworks.

- :mod:`dppo_core.integrations.trl`: :class:`~dppo_core.integrations.trl.DPPOGRPOTrainer`, TRL's
  ``GRPOTrainer`` with prompt and completion pruning (needs ``pip install 'dppo-core[bench]'``), also under
  ``accelerate launch`` with several processes.
- :mod:`dppo_core.integrations.verl`: DPPO through verl's registries (a fixed-normaliser policy loss, GRPO
  advantages with DPPO's weights) and on its ``DataProto`` (needs verl; see examples/verl/).

Importing this package imports no framework: ``from dppo_core.integrations import DPPOGRPOTrainer`` loads
TRL only then.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DPPOGRPOTrainer"]


def __getattr__(name: str) -> Any:
    if name == "DPPOGRPOTrainer":
        from dppo_core.integrations.trl import DPPOGRPOTrainer

        return DPPOGRPOTrainer
    raise AttributeError(f"module 'dppo_core.integrations' has no attribute {name!r}")
