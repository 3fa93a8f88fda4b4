"""The course install's line of ``dppo doctor`` (:func:`check_course_install`): whether ``pip install
"dppo-core[course]"`` (a wheel from ``make dist``, as a workshop laptop or Colab gets it) left everything the
chapters need: the package data they read (:data:`COURSE_ASSETS`), the ``course`` extra's modules as the
installed metadata lists them, the shipped warm start, and torch within the package's range.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from pathlib import Path

from dppo_core.tools.course import RESULTS_LIST
from dppo_core.tools.doctor import (
    Check,
    describe_error,
    dist_version,
    in_clone,
    in_range,
    pip_install,
    required_specifiers,
    spec_text,
    warm_model_dir,
)

# ------------------------------------------------------------------------------------- the course install
# `pip install "dppo-core[course]"` (a wheel from `make dist`, or an index) is all a chapter needs: the
# library, the `course` extra (JupyterLab, widgets), and package data the chapters read instead of the
# repository.

#: Where the course's package data is installed (``dppo_core/assets/course/``, listed in pyproject's
#: package-data).
COURSE_ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets" / "course"
#: The solutions files ``check()`` runs, one per chapter (tests/system/test_doctor.py keeps this list equal to
#: the names the chapters pass to ``check("ch03_grpo", ...)``).
COURSE_SOLUTIONS = ("ch00_tiny_model", "ch01_rewards", "ch02_rollouts", "ch03_grpo", "ch03b_estimation",
                    "ch04_lora_qlora", "ch05_prompt_pruning", "ch06_completion_pruning", "ch07_packing",
                    "ch08_dppo_end_to_end", "ch09_scaling_out")
#: The file, under :data:`COURSE_ASSETS_DIR`, listing the committed results the chapters read, one path a line
#: (``python -m dppo_core.tools.course --sync-results`` writes it with the copies; tests/system/test_doctor.py
#: keeps it equal to :func:`dppo_core.tools.course.chapter_results`).
COURSE_RESULTS_LIST = RESULTS_LIST


def _listed_results() -> tuple[str, ...]:
    listed = COURSE_ASSETS_DIR / COURSE_RESULTS_LIST
    if not listed.is_file():  # a broken install: missing_course_assets names the list itself
        return ()
    return tuple(line for line in listed.read_text(encoding="utf-8").splitlines() if line.strip())


#: The committed results the chapters read (``committed_result(...)``), as shipped under ``results/`` at their
#: paths in the repository: the list in :data:`COURSE_RESULTS_LIST`.
COURSE_RESULTS = _listed_results()
#: What :func:`check_course_install` requires under :data:`COURSE_ASSETS_DIR`, in one list: files, relative to
#: it.
COURSE_ASSETS = (tuple(f"solutions/{stem}.py" for stem in COURSE_SOLUTIONS) + (COURSE_RESULTS_LIST,)
                 + tuple(f"results/{path}" for path in COURSE_RESULTS))
COURSE_EXTRA = "course"
#: The extra's distributions when dppo-core's metadata cannot be read (pyproject's `course` list, as of
#: writing).
COURSE_FALLBACK = ("jupyterlab", "ipywidgets")
#: Distributions whose module is not their name with "-" as "_" (the others are looked up in the installed
#: metadata's top-level names, then guessed that way).
IMPORT_NAMES = {"pyyaml": "yaml", "ipython": "IPython", "pillow": "PIL", "scikit-learn": "sklearn",
                "beautifulsoup4": "bs4", "python-dateutil": "dateutil", "pyzmq": "zmq"}
#: How to rebuild a course install whose package data is missing or old.
COURSE_REINSTALL = ('rebuild the wheel from a complete checkout (`make dist`) and reinstall it: pip install '
                    '--force-reinstall --no-deps dist/dppo_core-*.whl   (Colab: %pip install '
                    '--force-reinstall --no-deps /content/<the wheel>, then restart the runtime)')


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
        return (dict.fromkeys(COURSE_FALLBACK, ""),
                "dppo-core is not installed (no metadata): checked the built-in list")
    reqs = []
    for text in requires:
        with contextlib.suppress(Exception):  # a malformed line must not break the doctor
            reqs.append(Requirement(text))

    def in_extra(req, name: str) -> bool:
        try:
            return (bool(req.marker) and req.marker.evaluate({"extra": name})
                    and not req.marker.evaluate({"extra": ""}))
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
                out.setdefault(canonicalize_name(req.name), spec_text(req.specifier))
    if not out:
        return (dict.fromkeys(COURSE_FALLBACK, ""), f"the installed dppo-core's metadata has no `{extra}` "
                "extra (installed before it existed?): checked the built-in list")
    return out, ""


def import_name(dist: str) -> str:
    """The module a distribution is imported as (``pyyaml`` -> ``yaml``)."""
    if dist in IMPORT_NAMES:
        return IMPORT_NAMES[dist]
    guess = dist.replace("-", "_").replace(".", "_")
    if _find_spec(guess) is not None:
        return guess
    # the installed distribution's own top-level names (a full scan: slower)
    with contextlib.suppress(Exception):
        provides = sorted(m for m, dists in importlib.metadata.packages_distributions().items()
                          if any(d.lower().replace("_", "-") == dist for d in dists)
                          and not m.startswith("_"))
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
        found.append(f"{len(COURSE_SOLUTIONS)} solutions files and {len(COURSE_RESULTS)} committed results "
                     "shipped")

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
        version = (dist_version(dist) or ("", ""))[1]
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
            warns.append("no shipped warm start (dppo_core/assets/warm-start/): chapters 03-08 train it "
                         "first, minutes per laptop")
            fixes.append(COURSE_REINSTALL + "; or run `dppo build` once before the workshop")
    except Exception as exc:  # noqa: BLE001
        fails.append(f"cannot look for the warm start ({describe_error(exc)})")
        fixes.append(COURSE_REINSTALL)

    torch_version = (dist_version("torch") or ("", ""))[1]
    if not torch_version:
        fails.append("torch is not installed")
        fixes.append(pip_install(f'"torch{required_specifiers().get("torch", "")}"'))
    else:
        ok, spec = in_range("torch", torch_version.split("+")[0])
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
