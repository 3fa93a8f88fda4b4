"""DPPOConfig: validation messages name the field and the fix; YAML and key=value overrides."""

import pytest

from dppo_core.config import ConfigError, DPPOConfig, field_docs, preset, preset_names


@pytest.mark.parametrize(
    "field, value, fix",
    [
        ("num_generations", 1, "at least 2"),
        ("learning_rate", -1e-4, "positive"),
        ("loss_type", "ppo", "grpo, dr_grpo, dapo"),
        ("temperature", 0.0, "temperature > 0"),
        ("update_mode", "qlora3", "qlora4"),
        ("epsilon", 1.5, "(0, 1)"),
        ("level_weights", (1.0,), "one per train level"),
        ("scale_rewards", "std", "group, batch, none"),
        ("prompt_scheme", "top-k", "paper, proportional, posterior"),
        ("completion_scheme", "posterior", "paper, proportional, length"),
        ("fixed_size_design", "stratified", "systematic, sorted, pivotal"),
        ("posterior_half_life", 0.0, "> 0 steps"),
        ("length_exponent", -0.5, ">= 0"),
        ("lr_schedule", "exponential", "constant, cosine, linear"),
        ("min_lr_ratio", 1.5, "[0, 1]"),
        ("warmup_steps", -1, ">= 0"),
        ("pruning", "random", "greso"),
    ],
)
def test_bad_values_name_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ConfigError) as err:
        DPPOConfig(**{field: value})
    assert field in str(err.value) and fix in str(err.value)


@pytest.mark.parametrize("overrides, field, fix", [
    (dict(pilot_size=8), "pilot_size", "up to 7"),                   # the pilot is part of each group of 8
    (dict(pilot_size=2, pruning="none"), "pilot_size", "pruning: dppo"),
    (dict(pilot_size=2, continue_probability=0.0), "continue_probability", "(0, 1]"),
    (dict(pilot_size=2, continue_scheme="history"), "continue_scheme", "constant, posterior"),
    (dict(pilot_size=2, loss_type="dapo"), "loss_type", "pilot_size: 0"),
    (dict(pilot_size=2, scale_rewards="batch"), "scale_rewards", "pilot_size: 0"),
    # the rollout plans (dppo_core.registry): a pilot is the pilot plan, dynamic sampling keeps no weights 1/π
    (dict(rollout_plan="refill"), "rollout_plan", "auto, plain, pilot, dynamic_sampling"),
    (dict(rollout_plan="pilot"), "rollout_plan", "set pilot_size"),
    (dict(pilot_size=2, rollout_plan="offline_filter"), "pilot_size", "rollout_plan: auto"),
    (dict(rollout_plan="dynamic_sampling", prompt_prune_rate=0.5), "rollout_plan", "1/π"),
])
def test_the_pilot_settings_that_would_bias_the_estimate_are_refused(overrides, field, fix):
    with pytest.raises(ConfigError) as err:
        DPPOConfig(**({"pruning": "dppo", "num_generations": 8} | overrides))
    assert str(err.value).startswith(f"{field}=") and fix in str(err.value)


def test_unknown_yaml_key_suggests_the_right_one(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("learning_rte: 1.0e-4\n")
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        DPPOConfig.from_yaml(f)
    with pytest.raises(ConfigError, match="does not exist"):
        DPPOConfig.from_yaml(tmp_path / "missing.yaml")
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        DPPOConfig.from_yaml(f)


def test_overrides_parse_values_as_yaml():
    c = DPPOConfig().with_overrides(["learning_rate=3e-5", "train_levels=[4, 5]", "epsilon_high=null"])
    assert c.learning_rate == 3e-5 and c.train_levels == (4, 5) and c.epsilon_high is None
    with pytest.raises(ConfigError, match="key=value"):
        DPPOConfig().with_overrides(["learning_rate"])


def test_presets_load_and_every_field_is_documented():
    assert {"tiny-grpo", "qwen3-math-grpo"} <= set(preset_names())
    for name in preset_names():
        assert isinstance(preset(name), DPPOConfig)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("nope")
    docs = field_docs()
    missing = [f for f in DPPOConfig.__dataclass_fields__ if f not in docs]
    assert not missing, f"fields without documentation: {missing}"


def test_importing_the_config_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, dppo_core.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_each_enumeration_is_defined_once_in_the_config():
    from dppo_core import config, grpo, pruning
    from dppo_core.estimator import ESTIMATORS

    assert grpo.LOSS_TYPES is config.LOSS_TYPES and grpo.SCALE_REWARDS is config.SCALE_REWARDS
    assert pruning.SCHEMES is config.SCHEMES
    assert set(ESTIMATORS) == set(config.PRUNING_MODES)


def test_train_help_lists_every_field_with_its_default_and_doc(capsys):
    from dataclasses import fields

    from dppo_core.tools.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    listed = [line.strip().split("=", 1)[0] for line in out.splitlines() if line.startswith("  ") and "=" in line
              and not line.startswith("   ") and not line.strip().startswith(("-", "KEY"))]
    assert listed == [f.name for f in fields(DPPOConfig)]  # every field, in class order
    assert "\nmodel and data:\n  model=tiny\n" in out and "  learning_rate=0.0001\n" in out
    assert "  train_levels=[2, 3, 4, 5]\n" in out and "  epsilon_high=null\n" in out
    assert "Weight of the k3 KL penalty to the reference policy" in out


# --------------------------------------------------------------------------------------------------
# Preset inheritance: `base: PRESET` in a YAML file
# --------------------------------------------------------------------------------------------------

#: tiny-dppo.yaml written out in full: tiny-grpo's fields and its own (the file says `base: tiny-grpo` and only
#: what differs).
TINY_DPPO_WRITTEN_OUT = {
    "model": "tiny", "task": "arithmetic", "train_levels": [2, 3, 4, 5], "num_generations": 8, "prompts_per_step": 32,
    "max_completion_length": 64, "temperature": 1.0, "learning_rate": 1.0e-4, "beta": 0.04, "loss_type": "grpo",
    "update_mode": "full", "rollout_engine": "hf", "micro_batch_size": 64, "max_steps": 100, "save_steps": 25,
    "eval_problems_per_level": 200, "eval_samples": 2, "pruning": "dppo", "prompt_prune_rate": 0.5,
    "prompt_scheme": "posterior", "posterior_half_life": 20, "dense_prompts": True, "min_prompt_keep_prob": 0.2,
    "completion_prune_rate": 0.5, "completion_scheme": "length", "length_exponent": 1.0,
    "min_completion_keep_prob": 0.2, "drop_zero_advantage": True, "fixed_size_sampling": True,
    "fixed_size_design": "sorted", "output_dir": "runs/tiny-dppo",
}


def test_tiny_dppo_is_tiny_grpo_plus_its_own_fields_and_resolves_as_before():
    from dppo_core.config import preset_overrides
    from dppo_core.config_files import PRESETS_DIR

    assert preset("tiny-dppo") == DPPOConfig.from_dict(dict(TINY_DPPO_WRITTEN_OUT))
    assert (PRESETS_DIR / "tiny-dppo.yaml").read_text().count("\nbase: tiny-grpo\n") == 1
    own = preset_overrides("tiny-dppo")
    assert list(own) == ["pruning", "prompt_prune_rate", "prompt_scheme", "posterior_half_life", "dense_prompts",
                         "min_prompt_keep_prob", "completion_prune_rate", "completion_scheme", "length_exponent",
                         "min_completion_keep_prob", "drop_zero_advantage", "fixed_size_sampling",
                         "fixed_size_design", "output_dir"]  # in the file's order
    assert preset("tiny-grpo").with_overrides(own) == preset("tiny-dppo")
    # a preset without a base states every field it sets
    assert preset_overrides("tiny-grpo")["train_levels"] == (2, 3, 4, 5)


def test_a_yaml_file_can_start_from_a_preset_and_change_what_differs(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: tiny-dppo\nmax_steps: 7\nprompt_prune_rate: 0.25\n")
    config = DPPOConfig.from_yaml(f)
    assert config == preset("tiny-dppo").with_overrides({"max_steps": 7, "prompt_prune_rate": 0.25})
    assert config.beta == 0.04  # from tiny-grpo, two bases up
    assert "base" not in config.to_dict() and "base" not in DPPOConfig.__dataclass_fields__
    with pytest.raises(ConfigError, match="unknown key.*'base'"):
        DPPOConfig.from_dict({"base": "tiny-grpo"})  # only YAML files resolve a base


def test_unknown_base_and_cycles_of_bases_are_config_errors(tmp_path, monkeypatch):
    from dppo_core import config_files

    f = tmp_path / "mine.yaml"
    f.write_text("base: tiny-gpro\n")
    with pytest.raises(ConfigError, match=r"mine.yaml: unknown base preset 'tiny-gpro'; choose one of .*tiny-grpo"):
        DPPOConfig.from_yaml(f)
    f.write_text("base: [tiny-grpo]\n")
    with pytest.raises(ConfigError, match="unknown base preset"):
        DPPOConfig.from_yaml(f)
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "a.yaml").write_text("base: b\nmax_steps: 1\n")
    (presets / "b.yaml").write_text("base: a\n")
    (presets / "c.yaml").write_text("base: c\n")
    (presets / "d.yaml").write_text("base: a\n")
    monkeypatch.setattr(config_files, "PRESETS_DIR", presets)
    with pytest.raises(ConfigError, match=r"cycle \(a -> b -> a\)"):
        preset("a")
    with pytest.raises(ConfigError, match=r"cycle \(c -> c\)"):
        preset("c")
    with pytest.raises(ConfigError, match=r"d.yaml: the base presets form a cycle|cycle \(a -> b -> a\)"):
        preset("d")


def test_a_config_json_of_an_older_run_still_loads():
    """Runs made before the unread ``extra`` field was removed wrote ``"extra": {}``; that still loads."""
    old = {**DPPOConfig().to_dict(), "extra": {}}
    assert DPPOConfig.from_dict(old) == DPPOConfig()
    with pytest.raises(ConfigError, match="'extra' is no longer a config field"):
        DPPOConfig.from_dict({**old, "extra": {"mine": 1}})


def test_eval_steps_is_checked_and_choices_read_as_words():
    with pytest.raises(ConfigError, match=r"eval_steps.*must be >= 0"):
        DPPOConfig(eval_steps=-1)
    for key in ("pruning", "rollout_engine", "update_mode"):
        with pytest.raises(ConfigError, match=key) as info:
            DPPOConfig(**{key: "nonsense"})
        assert "(" not in str(info.value).split("choose one of", 1)[1], str(info.value)  # words, not a tuple
