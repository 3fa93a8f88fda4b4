"""DPPO's estimator for a verl run, and a pre-flight check of the run's config.

Imported by every verl process (``VERL_USE_EXTERNAL_MODULES=dppo_plugin``, this folder on ``PYTHONPATH``): it
registers dppo_core's policy loss, advantage estimator and trainer (``trainer.v1.trainer_mode=dppo_sync``) in
verl's registries and installs the estimator below. verl's driver draws the prompts with it before each rollout
and weighs the completions after (see dppo_core/integrations/verl.py and verl_trainer.py).

Run as a script, it loads the config as verl's ``main_ppo`` would (this folder's dppo_grpo.yaml and the overrides
given), validates it with verl's ``validate_config`` and with dppo_core's ``check_config``:

    python examples/verl/dppo_plugin.py actor_rollout_ref.model.path=Qwen/Qwen3-4B trainer.n_gpus_per_node=8
"""

import os
import sys

import dppo_core.integrations.verl_trainer  # noqa: F401  (registers trainer.v1.trainer_mode=dppo_sync)
from dppo_core.estimator import DPPOEstimator
from dppo_core.integrations.verl import check_config, install

# G: must equal actor_rollout_ref.rollout.n (the launch command sets both from one variable; check_config, run
# when verl builds the trainer, refuses a mismatch)
GROUP_SIZE = int(os.environ.get("DPPO_GROUP_SIZE", "8"))

# Prompts: each kept with a probability from its history (a Beta-binomial posterior of whether its next group
# will have a loss, half-life 20 steps; floor 0.2; unseen prompts always kept), about half of them once the
# history knows the pool; a fixed number kept per step (sorted systematic sampling).
# Completions: about half of those with A != 0 kept (keep probability ∝ |A|, floor 0.1); those with A = 0
# (all-equal groups) are dropped, their loss is identically 0 without a KL loss term.
ESTIMATOR = DPPOEstimator(seed=0, prompt_scheme="posterior", prompt_prune_rate=0.5, min_prompt_keep_prob=0.2,
                          posterior_half_life=20.0, group_size=GROUP_SIZE, completion_prune_rate=0.5,
                          min_completion_keep_prob=0.1, fixed_size_sampling=True, fixed_size_design="sorted",
                          beta=0.0)
install(ESTIMATOR, group_size=GROUP_SIZE)


def main(overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with initialize_config_dir(config_dir=os.path.dirname(os.path.abspath(__file__)), version_base=None):
        config = compose("dppo_grpo", overrides=overrides)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    normaliser = check_config(config)  # also refuses a rollout.n other than GROUP_SIZE (DPPO_GROUP_SIZE)
    print(f"verl config ok for DPPO: C = train_batch_size x n = {normaliser}")


if __name__ == "__main__":
    main(sys.argv[1:])
