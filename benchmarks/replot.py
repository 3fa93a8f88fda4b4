"""Redraw the committed bench figures from their ``bench.json`` (issue #67: one colour per method, titles that name
the run, legends that name the batch sizes), without re-running or re-summarising anything.

Made with (from the repository root; a few seconds a bench on one core):

    .venv/bin/python benchmarks/replot.py benchmarks/results

Every directory under the given ones holding a ``bench.json`` and a bench figure (``accuracy_vs_time.png``) gets its
three figures redrawn by :func:`dppo_core.tools.bench.plots.plot_bench`, the one ``dppo bench`` draws them with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dppo_core.tools.bench.plots import plot_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+", type=Path, help="folders searched for bench.json")
    args = ap.parse_args()
    for root in args.roots:
        for path in sorted(root.rglob("bench.json")):
            if (path.parent / "accuracy_vs_time.png").exists():
                plot_bench(json.loads(path.read_text()), path.parent)
                print(f"redrew {path.parent}")


if __name__ == "__main__":
    main()
