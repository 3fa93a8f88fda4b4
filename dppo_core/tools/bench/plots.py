"""The bench's plots: ``accuracy_vs_step.png``, ``accuracy_vs_time.png`` and ``phases.png`` from a
``bench.json``.

Each method has one colour and line style in every figure (:data:`METHOD_STYLES`: matplotlib's cycle repeats
after ten, and the bench has more methods); a title names the run (its directory) and the preset; a legend
names each method's prompts rolled out per step, so a comparison at different batches says so on its face.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dppo_core.tools.bench.presets import PHASES, TARGET_FRACTION

#: (colour, line style) of each bench method, from the 20 colours of matplotlib's ``tab20``: the baselines in
#: blues and greys, DPPO's modes in reds and oranges, the other methods each its own hue; a method's variant
#: takes its hue's light shade and a dashed line.
METHOD_STYLES: dict[str, tuple[str, str]] = {
    "grpo": ("#7f7f7f", "-"), "grpo_half": ("#c7c7c7", "--"),
    "grpo_skip": ("#1f77b4", "-"), "grpo_skip_matched": ("#aec7e8", "--"),
    "dppo": ("#d62728", "-"), "dppo_paper": ("#ff9896", "--"),
    "dppo_budget": ("#ff7f0e", "-"), "dppo_budget_pilot": ("#ffbb78", "--"),
    "dppo_pilot": ("#8c564b", "-"),
    "trl_grpo": ("#bcbd22", "-"), "trl_dppo": ("#dbdb8d", "--"),
    "cppo": ("#9467bd", "-"), "pods": ("#c5b0d5", "--"),
    "greso": ("#e377c2", "-"), "greso_sampling": ("#f7b6d2", "--"),
    "dapo_sampling": ("#2ca02c", "-"), "dapo_oversampled": ("#98df8a", "--"),
    "grpo_skip_filtered": ("#17becf", "-"),
}
#: The phases' colours in ``phases.png`` (muted, apart from the methods' colours).
PHASE_COLOURS: dict[str, str] = {"rollout": "#4c72b0", "reward": "#dd8452", "prune": "#55a868",
                                 "pack": "#c44e52", "update": "#8172b3", "sync": "#937860"}


def run_title(result: Mapping[str, Any], output_dir: str | Path) -> str:
    """The run's directory and its preset (``cpu-own-best (dppo bench --preset cpu-baselines)``), or the
    preset alone where the directory is named after it."""
    name, preset = Path(output_dir).resolve().name, result["preset"]
    return f"dppo bench {preset}" if name == preset else f"{name} (dppo bench --preset {preset})"


def method_label(result: Mapping[str, Any], name: str) -> str:
    """``name`` with the prompts it rolled out per step (``prompts_rolled_out``, what its logs say), or, in a
    bench from before that was kept, its config's batch (and the share a rollout budget rolls out of it)."""
    count = result["methods"][name].get("prompts_rolled_out")
    if count is not None:
        return f"{name} ({count:g} prompts/step)"
    config = (result.get("configs") or {}).get(name, {})
    batch, rate = config.get("prompts_per_step"), config.get("prompt_prune_rate") or 0
    if batch is None:
        return name
    budget = rate > 0 and not config.get("dense_prompts") and config.get("pruning") == "dppo"
    return f"{name} (batch {batch}" + (f", about {batch * (1 - rate):g} rolled out)" if budget else ")")


def plot_bench(result: Mapping[str, Any], output_dir: str | Path) -> list[Path]:
    """``accuracy_vs_step.png``, ``accuracy_vs_time.png`` and ``phases.png`` in ``output_dir``."""
    # Figure objects, not pyplot: nothing here touches the caller's backend or its open figures (a
    # notebook that runs the bench keeps showing its own plots inline)
    from matplotlib.figure import Figure

    output_dir = Path(output_dir)
    seeds = result["seeds"]
    title = run_title(result, output_dir)
    written = []
    for fname, key, scale, xlabel in (
            ("accuracy_vs_step.png", "step", 1.0, "step"),
            ("accuracy_vs_time.png", "train_s", 60.0, "training wall-clock (min; evaluation excluded)")):
        fig = Figure(figsize=(7.2, 4.6))
        ax = fig.subplots()
        for name, m in result["methods"].items():
            colour, style = METHOD_STYLES[name]
            pts = [p for p in m["curve"] if p["sampled_accuracy"] is not None]
            x = [p[key] / scale for p in pts]
            y = [p["sampled_accuracy"] for p in pts]
            ax.plot(x, y, marker="o", ms=3, color=colour, ls=style, label=method_label(result, name))
            if len(seeds) > 1:
                ax.fill_between(x, [a - p["sampled_std"] for a, p in zip(y, pts, strict=True)],
                                [a + p["sampled_std"] for a, p in zip(y, pts, strict=True)],
                                color=colour, alpha=0.12)
        ax.axhline(result["target_accuracy"], color="gray", ls=":", lw=1,
                   label=f"target ({TARGET_FRACTION:.0%} of {result.get('reference', 'grpo')})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out sampled accuracy (T=1)")
        ax.set_title(f"{title}\nmean over seeds {', '.join(map(str, seeds))}"
                     + (" (± std across seeds)" if len(seeds) > 1 else ""), fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(output_dir / fname, dpi=110)
        written.append(output_dir / fname)
    written.append(_phases(result, output_dir, title, Figure))
    return written


def _phases(result: Mapping[str, Any], output_dir: Path, title: str, figure: Any) -> Path:
    """Seconds per step by phase, one horizontal bar per method (names on the y axis do not overlap)."""
    names = list(result["methods"])
    fig = figure(figsize=(7.2, 1.4 + 0.42 * len(names)))
    ax = fig.subplots()
    left = [0.0] * len(names)
    rows = list(range(len(names)))[::-1]  # the first method on top
    for phase in PHASES:
        per_step = [result["methods"][n]["phase_s"][phase] / max(1, result["methods"][n]["steps"])
                    for n in names]
        ax.barh(rows, per_step, left=left, label=phase, color=PHASE_COLOURS[phase], height=0.6)
        left = [b + v for b, v in zip(left, per_step, strict=True)]
    ax.set_yticks(rows, [method_label(result, n) for n in names], fontsize=8)
    ax.set_xlabel("seconds per step (mean over steps and seeds)")
    ax.set_title(f"{title}: time per phase", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(output_dir / "phases.png", dpi=110, bbox_inches="tight")
    return output_dir / "phases.png"
