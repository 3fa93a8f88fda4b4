"""dppo_core: DPPO (Dynamic Pruning Policy Optimization) for LLM reasoning RL, from scratch."""

__version__ = "0.1.0"
