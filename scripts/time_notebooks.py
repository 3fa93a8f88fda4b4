"""Run the chapter notebooks top to bottom and write how long each took into notebooks/README.md.

    .venv/bin/python scripts/time_notebooks.py                   # every chapter, notebooks/NN_*.ipynb
    .venv/bin/python scripts/time_notebooks.py 03 07             # some chapters
    .venv/bin/python scripts/time_notebooks.py --write-outputs   # also store the fresh outputs in the notebooks
    .venv/bin/python scripts/time_notebooks.py --no-readme       # only print the table

`make notebooks` runs it with --write-outputs under the Makefile's kernel settings (ATEN_CPU_CAPABILITY,
MKL_CBWR, ONEDNN_MAX_CPU_ISA), the first of `make test`'s two settings (which runs the chapters under its second): the
outputs nbval compares hold under both (and on other CPUs); those it ignores (timings, chaotic numbers) are this
machine's.

Each notebook runs in a fresh kernel (nbclient, which jupyterlab's nbconvert brings) with the working
directory notebooks/, as JupyterLab and nbval run it. The warm-started model ships with the package, so the
first chapter that needs it copies it into $DPPO_CACHE_DIR in a second.

The table (wall-clock seconds, the kernel's CPU seconds, the cores this process may use) replaces what lies
between the two marker lines in notebooks/README.md, with a line that says how it was measured: the device,
OMP_NUM_THREADS, the process's nice level and the load average before and after. Wall-clock time on a busy
machine is pessimistic; CPU seconds change less with load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
README = NOTEBOOKS / "README.md"
START, END = "<!-- timing:start -->", "<!-- timing:end -->"


def children_cpu_seconds() -> float:
    """User + system CPU time of every finished child process (the kernels, and what they waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"GPU ({torch.cuda.get_device_name(0)})"
    except ImportError:
        pass
    return "CPU only"


def run_notebook(path: Path, timeout: int, write: bool) -> tuple[float, float, str | None]:
    """Execute one notebook in a fresh kernel; return (wall seconds, kernel CPU seconds, error or None)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    cpu0, t0 = children_cpu_seconds(), time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as exc:
        error = str(exc).strip().splitlines()[-1][:200]
    wall, cpu = time.perf_counter() - t0, children_cpu_seconds() - cpu0
    if write and error is None:
        nb.metadata.pop("widgets", None)     # the sliders' saved state: large, and they need a live kernel anyway
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return wall, cpu, error


def table(rows: list[tuple[str, float, float, str | None]], how: str) -> str:
    lines = ["| chapter | seconds (wall clock) | CPU seconds (kernel) | cores |", "|---|---:|---:|---:|"]
    for name, wall, cpu, error in rows:
        link = f"[{name.split('_')[0]}]({name})"
        wall_s = f"{wall:.0f}" if error is None else f"failed after {wall:.0f}: {error}"
        lines.append(f"| {link} | {wall_s} | {cpu:.0f} | {cores()} |")
    total_wall, total_cpu = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"| all | {total_wall:.0f} | {total_cpu:.0f} | {cores()} |")
    return "\n".join(lines) + "\n\n" + how + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter numbers (00 01 ...); default: every notebooks/NN_*.ipynb")
    parser.add_argument("--write-outputs", action="store_true",
                        help="save each executed notebook in place (its stored outputs become this run's)")
    parser.add_argument("--no-readme", action="store_true", help="print the table, do not touch notebooks/README.md")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one cell may take (default 3600)")
    args = parser.parse_args()

    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))
    if args.chapters:
        paths = [p for p in paths if p.name.split("_")[0] in set(args.chapters)]
        missing = set(args.chapters) - {p.name.split("_")[0] for p in paths}
        if missing:
            parser.error(f"no notebook for chapter(s) {sorted(missing)} in {NOTEBOOKS}")
    load_before = os.getloadavg()[0]
    rows = []
    for path in paths:
        wall, cpu, error = run_notebook(path, args.timeout, args.write_outputs)
        rows.append((path.name, wall, cpu, error))
        status = "ok" if error is None else f"FAILED: {error}"
        print(f"{path.name:<36} {wall:7.1f} s wall, {cpu:7.1f} s CPU  {status}", flush=True)
    load_after = os.getloadavg()[0]

    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    command = " ".join(["python scripts/time_notebooks.py", *args.chapters])
    how = (f"Measured by `{command}`: {device()}, {cores()} cores, OMP_NUM_THREADS={threads}, nice {os.nice(0)}, "
           f"Python {platform.python_version()}; load average {load_before:.1f} before, {load_after:.1f} after.")
    text = table(rows, how)
    print()
    print(text)
    if not args.no_readme:
        readme = README.read_text()
        if START not in readme or END not in readme:
            print(f"{README} has no {START} ... {END} markers: table not written", file=sys.stderr)
            return 1
        head, rest = readme.split(START, 1)
        _, tail = rest.split(END, 1)
        README.write_text(f"{head}{START}\n{text}{END}{tail}")
        print(f"written to {README.relative_to(ROOT)}")
    return 1 if any(r[3] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
