"""metrics.jsonl's schema (dppo_core.metrics): the check the system tests run on every line a step writes."""

from dppo_core.metrics import PLAN_KEYS, PREFILTER, STEP, step_keys, unknown_keys


def test_unknown_keys_names_each_key_the_schema_lacks_and_reads_events_by_their_own():
    assert unknown_keys([{"step": 1, "loss": 0.1, "reward_accuracy_reward": 1.0, "ds_rounds": 2}]) == []
    assert unknown_keys([{"step": 2, "lossy": 1.0}, {"step": 3, "loss": 0.0}]) == ["step 2: lossy"]
    assert unknown_keys([{"event": "prefilter", "step": 0, "kept": 3, "loss": 1.0}]) == ["prefilter 0: loss"]


def test_every_key_says_what_it_means():
    for schema in (STEP, PREFILTER, *PLAN_KEYS.values()):
        assert all(isinstance(doc, str) and doc for doc in schema.values())
    assert {"step", "step_time", "decode_steps", "ds_no_signal", "pilot_tokens"} <= step_keys()
