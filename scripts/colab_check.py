"""The Colab-like test: the course install on a fresh machine with its own torch, then every chapter top to bottom.

    python3.11 scripts/colab_check.py                          # torch 2.12.0 (not make setup's), every chapter
    python3.11 scripts/colab_check.py --torch 2.14.1 00 07     # another torch, some chapters
    make test-colab                                            # the first line, its summary under benchmarks/results

1. The wheel: built here with ``pip wheel --no-deps`` (or ``--wheel PATH``, e.g. from ``make dist``).
2. A virtual environment (``--venv DIR``; default under the system's temp directory, named by the torch version)
   with ``torch==<--torch>`` installed first, as Colab has its own torch; kept between runs, and anything but that
   torch and its requirements is uninstalled before each run. Then ``pip install "<wheel>[course]"`` alone (no
   vLLM, TRL or bench extras), timed, and what it adds to the environment measured (the files of every
   distribution it installed); then nbclient and ipykernel to run the chapters (Colab has its own).
3. ``dppo doctor --quick`` in that environment: it must give no fix that only works in a clone (``make setup``,
   ``.venv/bin/pip``, ``pip install -e``); its fix lines go into the summary.
4. Every chapter copied into an empty directory outside the clone and executed top to bottom in a fresh kernel,
   with the network closed (proxies on a closed port, ``HF_HUB_OFFLINE=1``, ``PIP_NO_INDEX=1``) and an empty model
   cache: once the package is installed, no chapter may need the repository or the network. Outputs are not
   compared (another machine's numbers); a chapter passes when every cell runs without an error. The cells the
   test suite skips (``# NBVAL_SKIP``: chapter 04 section 6 downloads SmolLM2 and trains it for minutes) are
   skipped here too, and counted in the summary.

Prints one line per chapter and writes a JSON summary (``--output``): the torch, the install's time and size,
each chapter's seconds. The exit status is 1 if the install or any chapter failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_LIST = "course-check-base.txt"  # the torch environment's distributions, kept between runs

RUNNER = r'''
import json, sys, time
from pathlib import Path
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

out = {}
for path in map(Path, sys.argv[2:]):
    nb = nbformat.read(path, as_version=4)
    # the cells the test suite skips (nbval's NBVAL_SKIP: chapter 04 section 6 downloads and trains a real
    # model for minutes) are skipped here too
    kept = [c for c in nb.cells if not (c.cell_type == "code" and c.source.lstrip().startswith("# NBVAL_SKIP"))]
    skipped, nb.cells = len(nb.cells) - len(kept), kept
    start = time.perf_counter()
    try:
        NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
                       ).execute()
        out[path.stem] = {"ok": True, "seconds": round(time.perf_counter() - start, 1), "skipped_cells": skipped}
    except CellExecutionError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        out[path.stem] = {"ok": False, "seconds": round(time.perf_counter() - start, 1), "error": lines[-1][:500],
                          "traceback": "\n".join(lines[-40:])}
    print(f"{path.stem}: {'ok' if out[path.stem]['ok'] else 'FAILED: ' + out[path.stem]['error']} "
          f"({out[path.stem]['seconds']} s)", flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
'''

#: `dppo doctor --quick` as the course install runs it: its fix lines, and those that only work in a clone.
DOCTOR = r'''
import json, subprocess, sys
from dppo_core.tools.doctor import CLONE_ONLY
run = subprocess.run([sys.executable, "-m", "dppo_core.tools.cli", "doctor", "--quick"], capture_output=True, text=True)
fixes = [line.strip() for line in run.stdout.splitlines() if line.lstrip().startswith("fix:")]
print(json.dumps({"exit": run.returncode, "header": run.stdout.splitlines()[:1], "fixes": fixes,
                  "clone_only_fixes": [f for f in fixes if any(marker in f for marker in CLONE_ONLY)]}))
'''


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` from the temp directory: run from the clone, Python and pip would see its dppo_core as installed."""
    return subprocess.run(cmd, check=True, text=True, cwd=tempfile.gettempdir(), **kwargs)


def distributions(python: Path) -> dict[str, int]:
    """Every installed distribution of the environment and the bytes of its files."""
    code = ("import importlib.metadata as m, json, os\n"
            "out = {}\n"
            "for d in m.distributions():\n"
            "    size = 0\n"
            "    for f in d.files or []:\n"
            "        p = d.locate_file(f)\n"
            "        size += os.path.getsize(p) if os.path.isfile(p) else 0\n"
            "    out[d.metadata['Name'].lower()] = size\n"
            "print(json.dumps(out))")
    return json.loads(run([str(python), "-c", code], capture_output=True).stdout)


def torch_environment(venv: Path, torch: str) -> Path:
    """The environment with only ``torch`` (and its requirements), made once; later runs uninstall the rest."""
    python = venv / "bin" / "python"
    base = venv / BASE_LIST
    if not base.is_file():
        shutil.rmtree(venv, ignore_errors=True)
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(python), "-m", "pip", "install", "-q", f"torch=={torch}"])
        base.write_text("\n".join(sorted(distributions(python))))
    keep = set(base.read_text().split())
    extra = sorted(set(distributions(python)) - keep)
    if extra:
        run([str(python), "-m", "pip", "uninstall", "-q", "-y", *extra])
    found = run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True).stdout.strip()
    if not found.startswith(torch):  # an earlier run's install replaced it
        run([str(python), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", f"torch=={torch}"])
    return python


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chapters", nargs="*", help="chapter numbers (default: every notebooks/NN_*.ipynb)")
    ap.add_argument("--torch", default="2.12.0", help="the torch the environment has before the course install")
    ap.add_argument("--wheel", type=Path, help="the dppo-core wheel (default: built from this checkout)")
    ap.add_argument("--venv", type=Path, help="where the environment lives (default: a temp dir per torch)")
    ap.add_argument("--output", type=Path, help="write the JSON summary here")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="dppo-colab-"))
    wheel = args.wheel
    if wheel is None:
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(ROOT)])
        wheel = next((work / "dist").glob("dppo_core-*.whl"))
    venv = args.venv or Path(tempfile.gettempdir()) / f"dppo-colab-torch-{args.torch}"
    python = torch_environment(venv, args.torch)
    before = distributions(python)
    start = time.perf_counter()
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", f"{wheel.resolve()}[course]"],
                             text=True, capture_output=True, cwd=work)
    seconds = time.perf_counter() - start
    summary: dict = {"torch": args.torch, "wheel": wheel.name, "python": platform.python_version(),
                     "install_ok": install.returncode == 0, "install_seconds": round(seconds, 1)}
    if install.returncode:
        print(f"the course install failed: {install.stderr.strip().splitlines()[-1:]}")
        summary["install_error"] = install.stderr[-2000:]
    else:
        after = distributions(python)
        added = {k: v for k, v in after.items() if k not in before}
        summary["install_mib"] = round(sum(added.values()) / 2**20)
        summary["installed"] = {k: round(v / 2**20, 1) for k, v in sorted(added.items(), key=lambda kv: -kv[1])}
        torch_now = run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True).stdout
        summary["torch_after_install"] = torch_now.strip()
        if not torch_now.strip().startswith(args.torch):  # the install swapped the user's torch: Colab must not
            summary["install_ok"] = False
            print(f"the course install replaced torch {args.torch} with {torch_now.strip()}")
        print(f"course install with torch {args.torch}: {seconds:.0f} s, {summary['install_mib']} MiB in "
              f"{len(added)} distributions")
        run([str(python), "-m", "pip", "install", "-q", "nbclient", "ipykernel"])
        chapters = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
        if args.chapters:
            chapters = [p for p in chapters if p.name.split("_")[0] in args.chapters]
        where = work / "course"
        where.mkdir()
        for p in chapters:
            shutil.copy(p, where / p.name)
        closed = "http://127.0.0.1:9"
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and not k.startswith("DPPO_")}
        env |= {"HTTP_PROXY": closed, "HTTPS_PROXY": closed, "http_proxy": closed, "https_proxy": closed,
                "HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1", "DPPO_CACHE_DIR": str(work / "cache"),
                "TOKENIZERS_PARALLELISM": "false"}
        doctor = subprocess.run([str(python), "-c", DOCTOR], env=env, cwd=where, text=True, capture_output=True)
        summary["doctor"] = (json.loads(doctor.stdout) if doctor.returncode == 0
                             else {"error": doctor.stderr[-2000:], "clone_only_fixes": ["(the doctor did not run)"]})
        print(f"dppo doctor --quick from the wheel: {len(summary['doctor'].get('fixes', []))} fixes, clone-only ones: "
              f"{summary['doctor']['clone_only_fixes'] or 'none'}")
        (work / "runner.py").write_text(RUNNER)
        result = work / "chapters.json"
        start = time.perf_counter()
        subprocess.run([str(python), str(work / "runner.py"), str(result), *[str(where / p.name) for p in chapters]],
                       env=env, cwd=where, text=True)
        summary["chapters_seconds"] = round(time.perf_counter() - start)
        summary["chapters"] = json.loads(result.read_text()) if result.is_file() else {}
    ok = summary["install_ok"] and summary.get("chapters") and all(c["ok"] for c in summary["chapters"].values())
    ok = ok and not summary.get("doctor", {}).get("clone_only_fixes")   # a fix that needs a clone does not work here
    summary["ok"] = bool(ok)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{'passed' if ok else 'FAILED'}: torch {args.torch}, {len(summary.get('chapters', {}))} chapters"
          + (f" in {summary['chapters_seconds']} s" if "chapters_seconds" in summary else ""))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
