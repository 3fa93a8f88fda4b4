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
    ],
)
def test_bad_values_name_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ConfigError) as err:
        DPPOConfig(**{field: value})
    assert field in str(err.value) and fix in str(err.value)


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
