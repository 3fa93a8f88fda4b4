"""The vLLM engine's earlier import path: it lives in :mod:`dppo_core.engines.vllm` now.

Kept so that code written against the earlier layout (``from dppo_core.vllm_engine import VLLMRollout``) keeps
working; new code imports from :mod:`dppo_core.engines.vllm` or :mod:`dppo_core.rollout`.
"""

from dppo_core.engines.vllm import VLLMRollout, WeightSyncError, checkpoint_weights

__all__ = ["VLLMRollout", "WeightSyncError", "checkpoint_weights"]
