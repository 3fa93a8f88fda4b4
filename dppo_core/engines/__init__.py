"""Rollout engines, on one floor of shared types.

- :mod:`dppo_core.engines.types`: prompts, :class:`~dppo_core.engines.types.SamplingConfig`, completions,
  groups, batches and the :class:`~dppo_core.engines.types.RolloutEngine` protocol (``generate``, ``sync``);
- :mod:`dppo_core.engines.hf`: :class:`~dppo_core.engines.hf.HFRollout`, the training model itself with
  transformers, and the log-probs of given tokens (the reference side of every comparison);
- :mod:`dppo_core.engines.lean_decode`: the compact loop's one-token decode step;
- :mod:`dppo_core.engines.vllm`: :class:`~dppo_core.engines.vllm.VLLMRollout`, vLLM colocated in the process.

Engines import the types and never each other's callers; :mod:`dppo_core.rollout` (the documented entry)
gathers them and picks one (:func:`~dppo_core.rollout.make_rollout_engine`).
"""
