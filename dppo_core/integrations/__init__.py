"""DPPO's estimator inside other RL frameworks, one module per framework (importing this package imports
none):

- :mod:`dppo_core.integrations.trl`: :class:`~dppo_core.integrations.trl.DPPOGRPOTrainer`, TRL's
  ``GRPOTrainer`` with prompt and completion pruning (needs ``pip install 'dppo-core[bench]'``), also under
  ``accelerate launch`` with several processes: ``from dppo_core.integrations.trl import DPPOGRPOTrainer``.
- :mod:`dppo_core.integrations.verl`: DPPO through verl's registries (a fixed-normaliser policy loss, GRPO
  advantages with DPPO's weights) and on its ``DataProto`` (needs verl; see examples/verl/).
"""
