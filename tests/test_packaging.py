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
    from dppo_core.benchmark_data import load_benchmark
    from dppo_core.rewards import extract_answer, math_reward

    assert callable(DPPOTrainer) and DPPOConfig().num_generations >= 2
    assert extract_answer("so \\boxed{42}") == "42" and math_reward("\\boxed{42}", "42") == 1.0
    assert callable(load_benchmark)


def test_the_architecture_page_names_every_module_and_its_public_surface_exists():
    """docs/architecture.md places every module of the package in a layer, and every name its "Public surface"
    table lists is there (a class's methods are looked up on the classes of the same row), without importing
    TRL or vLLM."""
    import importlib
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    pkg = ROOT / "dppo_core"
    modules = {p.stem for p in pkg.glob("*.py") if not p.stem.startswith("_")}
    modules |= {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    unplaced = sorted(m for m in modules if f"`{m}`" not in doc and f"`dppo_core.{m}`" not in doc)
    assert not unplaced, f"modules missing from docs/architecture.md: {unplaced}"
    rows = [line.split("|") for line in doc.split("## Public surface", 1)[1].splitlines()]
    checked = 0
    for cells in rows:
        if len(cells) < 4 or not cells[1].strip().startswith("`dppo_core"):
            continue
        owners: list = [importlib.import_module(m) for m in re.findall(r"`(dppo_core[\w.]*)`", cells[1])]
        for name in re.findall(r"`(\w+)", cells[2]):
            found = [o for o in owners if name in getattr(o, "__all__", ()) or hasattr(o, name)]
            assert found, f"docs/architecture.md lists {name} under {cells[1].strip()}, which has no such name"
            if isinstance(vars(found[0]).get(name), type):  # not a lazy name: that would import TRL or vLLM
                owners.append(vars(found[0])[name])
            checked += 1
    assert checked > 40


#: The layers of docs/architecture.md, lowest first; a module may import its own layer and the ones below.
LAYERS = [
    {"config", "grpo", "pruning", "packing", "varlen", "shared_prefix", "rewards", "tasks", "benchmark_data", "models"},
    {"estimator"},
    {"rollout", "lean_decode", "vllm_engine"},
    {"trainer", "data", "policy", "logprobs", "checkpoint", "distributed", "evaluate"},
    {"cli", "bench", "doctor", "gpu_check", "course", "integrations"},
]


def test_lower_layers_never_import_higher_ones():
    import ast

    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    pkg = ROOT / "dppo_core"
    wrong = []
    for path in sorted(pkg.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == pkg:
            continue  # the package's lazy re-exports
        module = path.relative_to(pkg).parts[0].removesuffix(".py")
        assert module in layer, f"dppo_core.{module} is in no layer of docs/architecture.md"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dppo_core"):
                parts = node.module.split(".")
                targets = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1] for a in node.names if a.name.startswith("dppo_core.")]
            wrong += [f"dppo_core.{module} imports dppo_core.{t}" for t in targets
                      if t in layer and layer[t] > layer[module]]
    assert not wrong, wrong


def test_bitsandbytes_kernel_notice_is_dropped_and_other_warnings_are_not():
    """`import dppo_core` filters bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community"
    (printed on AVX512-BF16 CPUs without the optional `kernels` package; students read it as a broken
    install), and only that message."""
    import subprocess
    import sys

    code = ("import logging, dppo_core; log = logging.getLogger('bitsandbytes.backends.cpu.ops'); "
            "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s', 'no kernels'); "
            "log.warning('another bitsandbytes warning')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "kernels-community" not in proc.stderr and "another bitsandbytes warning" in proc.stderr
    # and the real import path (PEFT imports bitsandbytes) prints nothing of it
    proc = subprocess.run([sys.executable, "-c", "import dppo_core.policy, peft, bitsandbytes"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "kernels-community" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
