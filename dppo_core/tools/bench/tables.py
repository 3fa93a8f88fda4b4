"""The bench's results as text: the fixed-width table ``dppo bench`` prints, the Markdown tables of the README
and docs/benchmarks.md (speedups, their intervals, the ceiling), the README's rewrite between its markers, and
the per-level table of one evaluation. ``bench.json`` itself is :mod:`~dppo_core.tools.bench.report`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dppo_core.registry import ROLLOUT_PLANS, plan_name
from dppo_core.tools.bench.presets import BATCH_MATCHED, METHOD_OVERRIDES, TARGET_FRACTION, BenchError
from dppo_core.tools.bench.report import timing_notes
from dppo_core.tools.bench.summary import subset_scores


def format_duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(result: Mapping[str, Any], load: tuple[float, int] | None = None) -> str:
    """The results as a fixed-width table: one row per method, then what it means, and
    :func:`~dppo_core.tools.bench.report.timing_notes` (``load``:
    :func:`~dppo_core.tools.bench.report.machine_load` as the runs started) when its times cannot be trusted.
    With one seed the final accuracy has no spread over seeds: ``n/a``, not ``± 0.000``."""
    w = max(9, *(len(name) for name in result["methods"]))
    ref = result.get("reference", "grpo")
    head = (f"{'method':<{w}} {'steps':>5} {'acc before':>10} {'acc after':>15} {'to target':>9} "
            f"{'step s':>7} {'x step':>6} {'x wall':>6} {'x target':>8} {'bound':>6} {'of bound':>8} "
            f"{'generated':>10} {'trained':>10} {'density':>7}")
    lines = [head]
    for name, m in result["methods"].items():
        acc = m["accuracy"]
        sp = result[f"speedup_vs_{ref}"][name]
        tokens = m["tokens"]
        after = f"{fmt(acc['after'])} ± " + (fmt(acc['after_std']) if len(result["seeds"]) > 1 else "n/a")
        ttt = fmt(m["time_to_target_s"] / 60 if m["time_to_target_s"] is not None else None, ".1f", " min")
        lines.append(
            f"{name:<{w}} {m['steps']:>5} {fmt(acc['before']):>10} {after:>15} {ttt:>9} "
            f"{m['step_time_s']['median']:>7.2f} {fmt(sp['step_time'], '.2f'):>6} "
            f"{fmt(sp['wall'], '.2f'):>6} {fmt(sp['time_to_target'], '.2f'):>8} "
            f"{fmt(result['token_cost_bound'][name], '.2f'):>6} "
            f"{fmt(result['fraction_of_bound'][name], '.2f'):>8} {tokens['generated']:>10,} "
            f"{tokens['trained']:>10,} {tokens['trained'] / max(1, tokens['row_capacity']):>7.2f}")
    seeds = result["seeds"]
    lines.append(f"\nsampled accuracy (T=1) on held-out problems, mean over the trained levels, {len(seeds)} "
                 f"seed(s) {seeds}; target {result['target_accuracy']:.3f} ({TARGET_FRACTION:.0%} of {ref}'s "
                 "final); times are training time (sum of step times)")
    lines.append(f"x step / x wall / x target: speedup over {ref} in median step time, training time and "
                 "time to target; bound: the speedup the token counts predict; of bound: x wall / bound"
                 + ("; ± n/a: one seed, so no spread over seeds" if len(seeds) == 1 else ""))
    for name, base in (result.get("batch_matched") or {}).items():
        by_target = ((result.get("speedup_vs") or {}).get(base) or {}).get(name, {}).get("by_target", {})
        said = " / ".join(f"{_speedup_cell(e)} to {float(f):.0%}" for f, e in sorted(by_target.items()))
        lines.append(f"{name} rolls out fewer prompts per step than {ref}: against its batch-matched {base} "
                     f"(the same rolled-out prompts per step) {said or 'no target reached'}")
    notes = timing_notes(result, load)
    return "\n".join(lines + ([""] + notes if notes else []))


def _speedup_cell(entry: Mapping[str, Any]) -> str:
    """``1.13x [0.93, 1.37]`` from a ``by_target`` entry of
    :func:`~dppo_core.tools.bench.summary.speedups_vs`."""
    x = "–" if entry.get("time_to_target") is None else f"{entry['time_to_target']:.2f}x"
    return x + (f" [{entry['ci95'][0]:.2f}, {entry['ci95'][1]:.2f}]" if entry.get("ci95") else "")


#: Markers around the README's results table, which :func:`update_readme` rewrites from a ``bench.json``.
README_MARKERS = ("<!-- bench:{preset}:start -->", "<!-- bench:{preset}:end -->")


def format_markdown(result: Mapping[str, Any], command: str | None = None) -> str:
    """The results as a Markdown table, one row per method, with the settings and machine under it."""
    seeds, ref = result["seeds"], result.get("reference", "grpo")
    lines = ["| method | final accuracy (sampled) | time to target | median step "
             "| speedup: step / training / to target "
             "| token-cost bound | of bound | tokens generated | tokens trained | density |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        acc, sp, tokens = m["accuracy"], result[f"speedup_vs_{ref}"][name], m["tokens"]
        ttt = m["time_to_target_s"]
        reached = m.get("time_to_target_reached", "")
        ttt_text = f"{ttt / 60:.1f} min" if ttt is not None else f"not reached ({reached})"
        spread = f" ± {acc['after_std']:.3f}" if len(seeds) > 1 else ""
        speedups = " / ".join(fmt(sp[k], ".2f", "x") for k in ("step_time", "wall", "time_to_target"))
        density = tokens["trained"] / max(1, tokens["row_capacity"])
        lines.append(
            f"| `{name}`{_marks(result, name, ref)} | {fmt(acc['after'])}{spread} | {ttt_text} "
            f"| {m['step_time_s']['median']:.2f} s "
            f"| {speedups} | {fmt(result['token_cost_bound'][name], '.2f', 'x')} "
            f"| {fmt(result['fraction_of_bound'][name], '.2f')} "
            f"| {tokens['generated']:,} | {tokens['trained']:,} | {density:.2f} |")
    grpo = result["methods"][ref]["accuracy"]
    fraction = result.get("target_fraction_of_grpo", TARGET_FRACTION)
    lines += ["",
              f"Preset `{result['preset']}`, seeds {seeds} (means over seeds"
              + ("; ± is the standard deviation of the final accuracy over seeds" if len(seeds) > 1 else "")
              + f"). Accuracy: held-out sampled (T=1) accuracy over the trained levels, "
              f"{fmt(grpo['before'])} before training. Target: {result['target_accuracy']:.3f}, "
              f"{fraction:.0%} of {ref}'s final accuracy. Times are training time (the sum of step times; "
              f"evaluation excluded). Machine: {result['machine']}."]
    lines += format_speedups_vs(result) + format_intervals(result) + format_target_sweep(result)
    if command:
        lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def _interval(entry: Mapping[str, Any] | None) -> str:
    if not entry or entry.get("mean") is None:
        return "–"
    missed = f", {entry['missing']} missed" if entry.get("missing") else ""
    if entry.get("low") is None:
        return f"{entry['mean']:.2f}x (n={entry['n']}{missed})"
    return f"{entry['mean']:.2f}x [{entry['low']:.2f}, {entry['high']:.2f}] (n={entry['n']}{missed})"


def format_speedups_vs(result: Mapping[str, Any]) -> list[str]:
    """Markdown tables of the time-to-target speedups with bootstrap intervals, per baseline (grpo,
    grpo_skip)."""
    lines: list[str] = []
    for ref, table in (result.get("speedup_vs") or {}).items():
        fractions = sorted({f for m in table.values() for f in m["by_target"]})
        lines += ["", f"Against `{ref}`: time to each target (a fraction of `{ref}`'s final accuracy), from "
                      "each seed's interpolated crossing, Σ baseline time / Σ method time over the seeds "
                      "where both reached it, 95% bootstrap interval over seeds; and the accuracy when the "
                      "baseline's training time is spent.", "",
                  "| method | " + " | ".join(f"to {float(f):.0%} target" for f in fractions)
                  + f" | accuracy at `{ref}`'s time |",
                  "|---|" + "---|" * (len(fractions) + 1)]
        matched = result.get("batch_matched") or {}
        changed = changed_objective(result.get("configs") or {})
        for name, m in table.items():
            if name == ref:
                continue
            cells = []
            for f in fractions:
                e = m["by_target"][f]
                cells.append(_speedup_cell(e) + f" (n={e['n']}"
                             + (f", {e['missed']} missed)" if e["missed"] else ")"))
            acc = fmt(m["accuracy_at_equal_time"])
            lines.append(f"| `{name}`{_marks(result, name, ref)} | " + " | ".join(cells) + f" | {acc} |")
        if any(unmatched_mark(name, ref, matched) for name in table):
            lines += ["", unmatched_note(result)]
        if shown := {name: plan for name, plan in changed.items() if name in table and name != ref}:
            lines += ["", "`†`: trains a changed objective: its rollout plan ("
                      + ", ".join(f"`{plan}`" for plan in sorted(set(shown.values())))
                      + ") is not exact (dppo_core/registry.py): its groups are not a draw from the "
                      "full batch's, so its loss and gradient at the step's parameters are not unbiased for "
                      "the full batch's."]
        lines += format_ceiling(result, ref, fractions)
    return lines


def unmatched_note(result: Mapping[str, Any]) -> str:
    """What ``*`` means, and whether the batch-matched baseline ran in this bench."""
    ran = set(BATCH_MATCHED.values()) & set(result.get("methods") or {})
    return ("`*`: rolls out fewer prompts per step than this baseline: part of its gain is a smaller "
            "batch's, which every method can have; its own is against its batch-matched baseline "
            "(`grpo_skip_matched`" + (")." if ran else ", not run in this bench)."))


def changed_objective(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The methods of ``configs`` (bench.json's) whose rollout plan is not exact in the registry (it trains
    another objective than the full batch's: dynamic sampling, the offline filter), each with its plan. A
    configuration from before rollout plans were recorded (no ``rollout_plan``) has its method's plan."""
    plans = {m: plan_name(c.get("rollout_plan", METHOD_OVERRIDES.get(m, {}).get("rollout_plan", "auto")),
                          c.get("pilot_size", 0)) for m, c in configs.items()}
    return {m: p for m, p in plans.items() if p in ROLLOUT_PLANS and not ROLLOUT_PLANS[p].exact}


def unmatched_mark(name: str, ref: str, matched: Mapping[str, str] | None = None) -> str:
    """`` *`` when ``name`` rolls out fewer prompts per step than ``ref`` (a batch-matched method against
    another baseline than its own, whether or not that baseline ran: ``matched``, else
    :data:`~dppo_core.tools.bench.presets.BATCH_MATCHED`), else ``""``."""
    base = (matched or {}).get(name) or BATCH_MATCHED.get(name)
    return " *" if base is not None and base != ref else ""


def _marks(result: Mapping[str, Any], name: str, ref: str) -> str:
    """`` *`` (:func:`unmatched_mark`) and `` †`` (:func:`changed_objective`) for ``name``'s row against
    ``ref``."""
    changed = changed_objective(result.get("configs") or {})
    return unmatched_mark(name, ref, result.get("batch_matched") or {}) + (" †" if name in changed else "")


def format_target_sweep(result: Mapping[str, Any]) -> list[str]:
    """Markdown tables of each speedup against the target fraction (``target_sweep``), per baseline."""
    lines: list[str] = []
    for ref, table in (result.get("target_sweep") or {}).items():
        fractions = sorted({f for m in table.values() for f in m["by_target"]}, key=float)
        rows = [(name, m) for name, m in table.items() if name != ref]
        if not rows:
            continue
        lines += ["", f"Against `{ref}` at every target from {float(fractions[0]):.0%} to "
                      f"{float(fractions[-1]):.0%} of its final accuracy (Σ baseline time / Σ method time, "
                      "95% bootstrap interval over seeds): where the speedup depends on the target, the "
                      "headline's two columns do not tell it alone.", "",
                  "| method | " + " | ".join(f"{float(f) * 100:g}%" for f in fractions) + " |",
                  "|---|" + "---|" * len(fractions)]
        for name, m in rows:
            cells = []
            for f in fractions:
                e = m["by_target"][f]
                cells.append(_speedup_cell(e) + (f" ({e['missed']} missed)" if e["missed"] else ""))
            lines.append(f"| `{name}`{_marks(result, name, ref)} | " + " | ".join(cells) + " |")
    return lines


def format_ceiling(result: Mapping[str, Any], ref: str, fractions: Sequence[str]) -> list[str]:
    """The ceiling of each method over ``ref`` (:mod:`~dppo_core.tools.bench.ceiling`) and the fraction
    reached."""
    table = (result.get("ceiling") or {}).get(ref) or {}
    rows = [(name, c) for name, c in table.items() if c.get("speedup")]
    if not rows:
        return []
    lines = ["", f"The ceiling over `{ref}`: an oracle that rolls out only `{ref}`'s informative groups "
                 "(rewards not all equal) and trains them as the method does, learning per step as `{ref}` "
                 "does; cost model fitted to the runs' own phase times (dppo_core/tools/bench/ceiling.py). "
                 "Per target: the ceiling up to `{ref}`'s time to it (mean over seeds), and the fraction of "
                 "it the speedup above reached; last column: the ceiling over the whole "
                 "run (per seed).".replace("{ref}", ref), "",
             "| method | " + " | ".join(f"to {float(f):.0%} target: ceiling, reached" for f in fractions)
             + " | whole run (per seed) |", "|---|" + "---|" * (len(fractions) + 1)]
    for name, c in rows:
        seeds = ", ".join(f"{x:.2f}" for x in c["per_seed"])
        cells = []
        for f in fractions:
            t = c.get("by_target", {}).get(f, {})
            cells.append(f"{fmt(t.get('ceiling'), '.2f', 'x')}, {fmt(t.get('fraction_reached'), '.0%')}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {c['speedup']:.2f}x ({seeds}) |")
    lines += ["", "Rollout cost model (c0 + cL · longest completion + cT · generated tokens, fitted per seed "
                  "to both runs' steps): "
                  + "; ".join(f"`{name}` {_rollout_models(c)}" for name, c in rows) + "."]
    return lines


def _rollout_models(ceiling: Mapping[str, Any]) -> str:
    """The rollout fits of a ceiling's seeds in words: which model, and the range of its R²."""
    fits = [s["rollout_fit"] for s in ceiling.get("seeds", []) if "rollout_fit" in s]
    if not fits:
        return "not recorded"
    r2 = [f["r2"] for f in fits]
    proportional = sum(f.get("model") == "proportional" for f in fits)
    said = f"R² {min(r2):.2f}-{max(r2):.2f}"
    if proportional:
        said += (f", the proportional fallback (time per generated token) in {proportional} of {len(fits)} "
                 "seeds, where R² < 0.5")
    return said


def format_intervals(result: Mapping[str, Any]) -> list[str]:
    """Markdown tables of the speedups paired by seed with 95% intervals, against grpo and grpo_skip (if
    run)."""
    lines: list[str] = []
    for ref, table in (result.get("speedup_intervals") or {}).items():
        lines += ["", f"Speedup over `{ref}`, paired by seed: geometric mean, 95% t-interval on the log "
                      "ratios, seeds with a ratio (a seed where either run missed the target has none).", "",
                  "| method | median step | training time | time to target (interpolated crossing) |",
                  "|---|---|---|---|"]
        for name, m in table.items():
            if name != ref:
                lines.append(f"| `{name}`{_marks(result, name, ref)} | {_interval(m['step_time'])} "
                             f"| {_interval(m['wall'])} | {_interval(m['time_to_target'])} |")
    return lines


def update_readme(readme: str | Path, result: Mapping[str, Any], command: str | None = None,
                  name: str | None = None) -> bool:
    """Replace the text between the README's ``bench:NAME`` markers (``name``, default the result's preset)
    with :func:`format_markdown`'s table.

    Returns whether the file changed. The markers must be there (one pair), so a table is never appended
    somewhere unexpected.
    """
    readme = Path(readme)
    start, end = (m.format(preset=name or result["preset"]) for m in README_MARKERS)
    text = readme.read_text()
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise BenchError(f"{readme} needs one line {start} and, after it, one line {end} around the results "
                         "table")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    new = f"{head}{start}\n{format_markdown(result, command)}\n{end}{tail}"
    if new != text:
        readme.write_text(new)
    return new != text


def format_levels(record: Mapping[str, Any]) -> str:
    """Per-level greedy and sampled accuracy of one evaluation record, as a small table."""
    greedy, sampled = subset_scores(record, "greedy"), subset_scores(record, "sampled")
    lines = [f"{'level':>8} {'greedy':>8} {'sampled':>8}"]
    for level in sampled:
        lines.append(f"{level:>8} {fmt(greedy.get(level)):>8} {fmt(sampled[level]):>8}")
    lines.append(f"{'mean':>8} {fmt(record.get('greedy_accuracy')):>8} "
                 f"{fmt(record.get('sampled_accuracy')):>8}")
    return "\n".join(lines)
