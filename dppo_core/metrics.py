"""The schema of ``metrics.jsonl``: every key a step's line may hold, and what it means.

One line per step (:meth:`dppo_core.trainer.DPPOTrainer.train_step`; written by
:meth:`dppo_core.run.Run.train`), plus the lines of events (``"event": "prefilter"``, the offline filter's
pass over the pool before the first step). A line holds the keys of :data:`STEP` that apply to its step: a
step that trains nothing (``skipped``) has no update statistics beyond zeros, the rollout correction's keys
appear only when it is on, the keys of :data:`PLAN_KEYS` only under the plan that writes them.
``reward_<name>`` is one key per reward function. Torch-free: tools that read the logs (``dppo advise``, the
bench's summaries) can import it without the trainer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: Every key of a step's line and its meaning.
STEP: dict[str, str] = {
    "step": "the steps done, this one included (1 for the first)",
    "skipped": "1 when the step trained nothing because every candidate was pruned, or every group stopped "
               "after its pilot (the estimate is exactly 0, a valid draw); absent otherwise",
    "prompts_candidates": "|B|: the candidate prompts the step's objective is over, kept or not",
    "prompts_rolled_out": "the prompts whose groups were rolled out (a refill's rounds all counted)",
    "completions_rolled_out": "the completions generated (a stopped pilot's k included)",
    "reward_mean": "the mean summed reward over the groups trained on (dynamic sampling: every rolled-out "
                   "group); null on a skipped step",
    "reward_std": "their standard deviation",
    "reward_<name>": "the mean of reward function <name> over the groups trained on",
    "zero_std_groups": "the share of the groups whose rewards are all equal (all-equal groups)",
    "completion_length": "the mean completion length in tokens, of the groups trained on",
    "completion_length_max": "the longest completion of them",
    "loss": "the step's pruned loss L̂(θ), averaged over PPO epochs",
    "clip_fraction": "the share of tokens whose ratio was clipped",
    "kl": "the mean k3 KL to the reference policy, per token",
    "grad_norm": "the gradient norm before clipping, averaged over PPO epochs",
    "update_rows": "the rows the update laid its sequences out in",
    "update_capacity": "the token slots of those rows",
    "update_density": "the share of those slots holding a real token",
    "padding_avoided": "the token slots packing saved against sorted padded micro-batches",
    "prompt_tokens_shared": "prompt tokens laid out once for several completions (shared-prefix attention)",
    "time_pack": "seconds laying the update out (part of the update)",
    "engine_weight_mean": "the rollout correction's mean per-token weight (only with the correction on)",
    "engine_weight_truncated": "the share of tokens whose correction weight was truncated",
    "engine_logprob_diff_max": "the largest |log π_engine - log π_policy| of a token",
    "lr": "the learning rate of the step",
    "tokens_generated": "completion tokens generated (every round, every stopped pilot)",
    "tokens_trained": "completion tokens of the sequences trained on",
    "sequences_trained": "the completions trained on",
    "tokens_saved_rollout_est": "an estimate of the completion tokens the pruned prompts would have "
                                "generated",
    "tokens_saved_update": "rolled-out completion tokens the update did not train on",
    "weight_ess": "the effective sample size of the kept completions' weights",
    "weight_max": "the largest weight 1/(π_q p_qi)",
    "time_prune": "seconds choosing prompts and completions (the draws, the weights)",
    "time_rollout": "seconds generating",
    "time_reward": "seconds scoring",
    "time_update": "seconds in the update, less time_pack",
    "time_sync": "seconds syncing the engine to the new weights",
    "step_time": "the step's wall-clock seconds",
}

#: The keys a rollout plan adds to the step's line (dppo_core.plans), by plan.
PLAN_KEYS: dict[str, dict[str, str]] = {
    "pilot": {
        "pilot_groups_stopped": "the groups stopped after their pilot",
        "pilot_tokens": "the tokens of every pilot, stopped or continued",
        "decode_steps": "the sequential decode steps of the step's engine calls: each call's longest "
                        "completion",
    },
    "dynamic_sampling": {
        "ds_rounds": "the rollout rounds of the step",
        "ds_dropped_groups": "the rolled-out groups not trained on (all-equal, or beyond prompts_per_step)",
        "ds_short": "1 when the step ended with fewer informative groups than prompts_per_step",
        "ds_no_signal": "1 when no group was informative (the step paid for its rounds and trained nothing)",
        "decode_steps": "the sequential decode steps of every round's engine call",
    },
}

#: The offline filter's line (``"event": "prefilter"``), before the first step.
PREFILTER: dict[str, str] = {
    "event": "prefilter",
    "step": "0",
    "time_prefilter": "seconds rolling out and scoring the pool once",
    "tokens_generated": "completion tokens the filter generated",
    "pool": "the pool's prompts (those with a weight above 0)",
    "kept": "the prompts left (the whole pool when the filter would leave none)",
    "filter_left_nothing": "whether every prompt's group came out all equal",
    "dropped": "the prompts dropped",
    "dropped_all_correct": "of them, those whose group was all right",
    "dropped_all_wrong": "of them, those whose group was all wrong",
}


def step_keys() -> set[str]:
    """Every key a step's line may hold (``reward_<name>`` as that pattern)."""
    return set(STEP) | {k for keys in PLAN_KEYS.values() for k in keys}


def unknown_keys(lines: Iterable[Mapping[str, Any]]) -> list[str]:
    """The keys of ``lines`` (a ``metrics.jsonl``'s) that the schema does not hold, as ``"step N: key"``;
    events are checked against their own schema."""
    known, out = step_keys(), []
    for line in lines:
        schema = PREFILTER if line.get("event") == "prefilter" else known
        for key in line:
            if key not in schema and not (schema is known and key.startswith("reward_")):
                out.append(f"{line.get('event') or 'step'} {line.get('step')}: {key}")
    return out
