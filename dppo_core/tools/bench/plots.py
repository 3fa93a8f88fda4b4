"""The bench's plots: ``accuracy_vs_step.png``, ``accuracy_vs_time.png`` and ``phases.png`` from a ``bench.json``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dppo_core.tools.bench.presets import METHODS, PHASES, TARGET_FRACTION


def plot_bench(result: Mapping[str, Any], output_dir: str | Path) -> list[Path]:
    """``accuracy_vs_step.png``, ``accuracy_vs_time.png`` and ``phases.png`` in ``output_dir``."""
    # Figure objects, not pyplot: nothing here touches the caller's backend or its open figures (a
    # notebook that runs the bench keeps showing its own plots inline)
    from matplotlib.figure import Figure

    output_dir = Path(output_dir)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    seeds = result["seeds"]
    written = []
    for fname, key, scale, xlabel in (
            ("accuracy_vs_step.png", "step", 1.0, "step"),
            ("accuracy_vs_time.png", "train_s", 60.0, "training wall-clock (min; evaluation excluded)")):
        fig = Figure(figsize=(6.4, 4.2))
        ax = fig.subplots()
        for name, m in result["methods"].items():
            pts = [p for p in m["curve"] if p["sampled_accuracy"] is not None]
            x = [p[key] / scale for p in pts]
            y = [p["sampled_accuracy"] for p in pts]
            ax.plot(x, y, marker="o", color=colors[name], label=name)
            if len(seeds) > 1:
                ax.fill_between(x, [a - p["sampled_std"] for a, p in zip(y, pts, strict=True)],
                                [a + p["sampled_std"] for a, p in zip(y, pts, strict=True)],
                                color=colors[name], alpha=0.15)
        ax.axhline(result["target_accuracy"], color="gray", ls="--", lw=1,
                   label=f"target ({TARGET_FRACTION:.0%} of {result.get('reference', 'grpo')})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out sampled accuracy (T=1)")
        ax.set_title(f"dppo bench {result['preset']}: mean over seeds {seeds}" + (" (± std)" if len(seeds) > 1 else ""))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(output_dir / fname, dpi=110)
        written.append(output_dir / fname)
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    names = list(result["methods"])
    bottom = [0.0] * len(names)
    for i, phase in enumerate(PHASES):
        per_step = [result["methods"][n]["phase_s"][phase] / max(1, result["methods"][n]["steps"]) for n in names]
        ax.bar(names, per_step, bottom=bottom, label=phase, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, per_step, strict=True)]
    ax.set_ylabel("seconds per step (mean over steps and seeds)")
    ax.set_title(f"dppo bench {result['preset']}: time per phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output_dir / "phases.png", dpi=110)
    written.append(output_dir / "phases.png")
    return written
