"""dppo_core.registry: every named choice said once, and what reads it (the config's checks, the trainer's engine
correction, the bench's TRL peers)."""

import pytest

from dppo_core import registry
from dppo_core.config import COMPLETION_SCHEMES, PROMPT_SCHEMES, ROLLOUT_ENGINES, DPPOConfig
from dppo_core.config_checks import POSTERIOR_PROMPT_SCHEMES
from dppo_core.tools.bench.peers import trl_grpo_args
from dppo_core.tools.bench.presets import BenchError


def test_the_configs_choices_are_the_registrys():
    assert PROMPT_SCHEMES == tuple(registry.PROMPT_SCHEMES)
    assert PROMPT_SCHEMES == ("paper", "proportional", "posterior", "fitted", "streak")
    assert POSTERIOR_PROMPT_SCHEMES == ("posterior", "fitted", "streak")  # the schemes that read pass counts
    assert COMPLETION_SCHEMES == tuple(registry.COMPLETION_SCHEMES)
    assert ROLLOUT_ENGINES == tuple(registry.ROLLOUT_ENGINES)
    # posterior's score is √P(informative), fitted's and streak's P itself; only streak is recalibrated
    assert {n: (c.prior, c.power, c.calibrated) for n, c in registry.PROMPT_SCHEMES.items() if c.prior} == {
        "posterior": ("uniform", 0.5, False), "fitted": ("fitted", 1.0, False), "streak": ("fitted", 1.0, True)}


def test_the_engine_that_samples_from_the_policy_and_the_plan_a_config_runs():
    assert registry.samples_from_policy("hf") and not registry.samples_from_policy("vllm")
    assert not registry.samples_from_policy("recording")  # an engine the table does not name: corrected
    assert registry.plan_name("auto", 0) == "plain" and registry.plan_name("auto", 2) == "pilot"
    assert registry.plan_name("dynamic_sampling", 0) == "dynamic_sampling"
    assert DPPOConfig(pruning="dppo", pilot_size=2).plan == "pilot" and DPPOConfig().plan == "plain"
    # TRL and verl generate each group in one call of their own: only the plain plan runs there
    assert [n for n, c in registry.ROLLOUT_PLANS.items() if c.trl or c.verl] == ["plain"]
    assert [n for n, c in registry.ROLLOUT_PLANS.items() if not c.exact] == [
        "dynamic_sampling", "dapo_oversampled", "offline_filter"]


@pytest.mark.parametrize("overrides", [{"pilot_size": 2, "pruning": "dppo"}, {"rollout_plan": "dynamic_sampling"}])
def test_the_trl_peer_refuses_a_plan_trl_cannot_run(tmp_path, overrides):
    config = DPPOConfig(**overrides)
    with pytest.raises(BenchError, match="rollout_plan: auto"):
        trl_grpo_args(config, tmp_path, "trl_dppo")


def test_the_bench_marks_the_methods_whose_plan_changes_the_objective():
    """The bench's speedup tables mark a method whose rollout plan is not exact (`†`), read from the registry
    through each method's config, so a new inexact plan is marked without naming it in the tables."""
    from dppo_core.tools.bench.tables import changed_objective, format_speedups_vs

    configs = {"grpo_skip": {"rollout_plan": "auto", "pilot_size": 0},
               "dppo_pilot": {"rollout_plan": "auto", "pilot_size": 2},
               "grpo_skip_filtered": {"rollout_plan": "offline_filter", "pilot_size": 0},
               "dapo_sampling": {"rollout_plan": "dynamic_sampling", "pilot_size": 0}}
    assert changed_objective(configs) == {"grpo_skip_filtered": "offline_filter", "dapo_sampling": "dynamic_sampling"}
    entry = {"time_to_target": 1.2, "ci95": [1.0, 1.4], "accuracy_at_equal_time": 0.6,
             "by_target": {"0.95": {"time_to_target": 1.2, "ci95": [1.0, 1.4], "n": 3, "missed": 0}}}
    text = "\n".join(format_speedups_vs({"configs": configs, "speedup_vs": {"grpo_skip": {
        m: entry for m in ("grpo_skip", "dppo_pilot", "grpo_skip_filtered")}}}))
    assert "| `grpo_skip_filtered` † |" in text and "| `dppo_pilot` |" in text
    assert "(`offline_filter`) is not exact" in text and "dynamic_sampling" not in text


def test_a_bench_from_before_the_marks_is_marked_by_its_methods():
    """A bench.json written before rollout plans and the batch-matched baseline were recorded (no
    ``rollout_plan`` in its configs, no ``batch_matched``): `†` from each method's plan today, `*` for a method
    that rolls out fewer prompts per step than the baseline, and the note says its batch-matched baseline did not
    run; no mark against its own batch-matched baseline."""
    from dppo_core.tools.bench.tables import format_speedups_vs, format_target_sweep

    configs = {m: {"pilot_size": 0} for m in ("grpo_skip", "dppo", "dppo_budget", "dapo_sampling")}
    entry = {"time_to_target": 1.2, "ci95": [1.0, 1.4], "accuracy_at_equal_time": 0.6,
             "by_target": {"0.95": {"time_to_target": 1.2, "ci95": [1.0, 1.4], "n": 3, "missed": 0}}}
    old = {"configs": configs, "methods": dict.fromkeys(configs),
           "speedup_vs": {"grpo_skip": dict.fromkeys(configs, entry)},
           "target_sweep": {"grpo_skip": dict.fromkeys(configs, entry)}}
    text = "\n".join(format_speedups_vs(old) + format_target_sweep(old))
    assert text.count("| `dppo_budget` * |") == 2 and text.count("| `dapo_sampling` † |") == 2, text
    assert "| `dppo` |" in text and "(`grpo_skip_matched`, not run in this bench)" in text
    new = {**old, "methods": dict.fromkeys([*configs, "grpo_skip_matched"]),
           "speedup_vs": {"grpo_skip_matched": {m: entry for m in ("grpo_skip_matched", "dppo_budget")}}}
    text = "\n".join(format_speedups_vs(new))
    assert "| `dppo_budget` |" in text and "*" not in text


def test_the_pilot_count_is_read_in_four_modules_one_way():
    """``pilot_size`` from ``dppo train``: the config (its field, and ``plan``, the plan it resolves to through
    the registry), the config's checks and the pilot plan read it; what a run builds from the config (the
    estimator, the plans' factory, the bench's TRL peers, the TRL and verl adapters' checks) reads the resolved
    ``plan``. Nothing hands the count back. (The bench's tables resolve saved configs' JSON with plan_name.)"""
    import ast
    from pathlib import Path

    package = Path(registry.__file__).parent
    readers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "pilot_size":
                readers.add(path.relative_to(package).as_posix())
    assert readers == {"config.py", "config_checks.py", "plans/pilot.py"}
    assert registry.plan_name.__code__.co_varnames[:2] == ("rollout_plan", "pilot_size")  # the fourth: a parameter
