"""Packaging: the console script, the public imports, and environment.yml mirroring pyproject."""

import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = set(project["dependencies"])
    for items in project["optional-dependencies"].values():
        reqs.update(r for r in items if not r.startswith("dppo-core"))
    return reqs


def test_environment_yml_pip_section_mirrors_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {r for r in pip_section if not r.startswith("-e")}
    assert listed == _pyproject_requirements(), (
        "environment.yml's pip section and pyproject.toml differ: "
        f"only in environment.yml {sorted(listed - _pyproject_requirements())}, "
        f"only in pyproject {sorted(_pyproject_requirements() - listed)}"
    )
    assert "-e ." in pip_section


def test_torch_is_pinned_to_the_cpu_build_in_the_constraints():
    text = (ROOT / "requirements" / "constraints-cpu.txt").read_text()
    assert "torch==2.13.0+cpu" in text.split()


def test_cli_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "dppo_core.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("demo", "build"):
        assert command in out


def test_package_imports_and_has_a_version():
    import dppo_core

    assert dppo_core.__version__


def test_public_surface_imports():
    from dppo_core import DPPOConfig, DPPOTrainer
    from dppo_core.rewards import extract_answer, math_reward
    from dppo_core.tasks import load_benchmark

    assert callable(DPPOTrainer) and DPPOConfig().num_generations >= 2
    assert extract_answer("so \\boxed{42}") == "42" and math_reward("\\boxed{42}", "42") == 1.0
    assert callable(load_benchmark)
