"""The physical ceiling of pruning: how much sooner a method could at best have reached the target than a
baseline.

The oracle rolls out only the baseline's groups whose rewards are not all equal (the informative ones: every
other group has A = 0 everywhere and no gradient) and trains them as the method does (its completion pruning
and packing), and it learns per step as the baseline does. No unbiased pruning of prompts can do better
without learning more per step: it must roll a prompt out to know its group is informative. The ceiling is the
baseline's training time over the oracle's, computed per seed from the two runs' own logs:

- ``groups.jsonl`` (:mod:`dppo_core.grouplog`): the baseline's groups, so which were informative and how many
  tokens they generated;
- ``metrics.jsonl``: the measured per-phase times, to which the cost model is fitted by least squares over the
  baseline's and the method's steps together (the same engine rolls out for both, and both pack what they
  train):

  * rollout s = c0 + cL · the step's longest completion + cT · generated tokens (:func:`rollout_fit`). A
    batched decode runs until its longest completion ends, so the decode steps, not the token count, carry
    most of a rollout's time (on the committed CPU runs the tokens alone explain R² 0.01-0.10 of it, with the
    longest completion 0.5-0.6). The oracle's longest completion is the longest of its informative groups;
  * update s = u0 + u1 · trained tokens;
  * everything else (reward, prune, pack, sync and the gaps between phases): the baseline's mean per step (the
    oracle runs the baseline's steps, so it keeps their bookkeeping).

  Every coefficient is kept >= 0 (a time never shrinks with more work: :func:`nonnegative_fit`). Where a fit's
  R² is under :data:`MIN_R2`, that phase is taken as proportional to its tokens instead (no per-step or
  per-decode-step part), which can only raise the ceiling (:func:`cost_fit`; ``model`` in each fit names the
  one used, and the fallback is named in the bench report).

  The oracle's step s trains κ × the informative tokens of the baseline's step s, κ the method's own trained
  tokens over the tokens of its informative groups (its completion pruning; 1 when it keeps every completion
  of an informative group). Its time is Σ_s c0 + cL L_s + cT N_s + u0 + u1 κ N_s + other, N_s the informative
  tokens and L_s their longest completion (a step with N_s = 0 pays only ``other``).

The ceiling is given over the whole run (``speedup``) and, per target, up to the baseline's time to that
target (``by_target``: the share of informative groups falls as the policy learns, so the two differ); the
fraction reached divides the measured time-to-target speedup by the ceiling to the same target.

What it leaves out: learning per step is taken as equal (the method's extra variance would only lower what it
reaches, so the ceiling stays an upper bound for an unbiased method), and the fit's residuals (``r2`` per
fit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dppo_core.grouplog import informative, read_groups
from dppo_core.tools.bench.presets import run_dir
from dppo_core.tools.bench.summary import read_jsonl, time_to_target


def linear_fit(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Least squares y = a + b x with a, b >= 0 (a time is never negative): ``{"a", "b", "r2"}``. When the
    free fit has a < 0 the line goes through 0 (a = 0); when it has b < 0, or x does not vary, b = 0 and
    a = mean y."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xs) == 0:
        raise ValueError("no steps to fit the cost model to")
    if len(xs) < 2 or np.ptp(xs) == 0:
        return {"a": float(ys.mean()), "b": 0.0, "r2": 0.0}
    b, a = np.polyfit(xs, ys, 1)
    if a < 0:
        a, b = 0.0, float(xs @ ys / (xs @ xs))
    if b < 0:
        a, b = float(ys.mean()), 0.0
    residual = ys - (a + b * xs)
    total = float(((ys - ys.mean()) ** 2).sum())
    return {"a": float(a), "b": float(b), "r2": 1.0 - float((residual ** 2).sum()) / total if total else 1.0}


#: Below this R², a fit's slope is not identified by the runs' steps (their token counts vary too little); the
#: cost is then taken as proportional to the tokens (:func:`cost_fit`).
MIN_R2 = 0.5


def nonnegative_fit(columns: Mapping[str, Sequence[float]], y: Sequence[float]) -> dict[str, float]:
    """Least squares y = c0 + Σ_k c_k x_k with every coefficient >= 0: ``{"c0", <each column's name>, "r2"}``.

    Exact for a few columns: every subset of the coefficients is fitted freely, and the best fit whose
    coefficients are all >= 0 is kept (the constraint's solution is one of them); an empty model predicts
    0."""
    ys = np.asarray(y, dtype=float)
    if len(ys) == 0:
        raise ValueError("no steps to fit the cost model to")
    names = ["c0", *columns]
    design = np.column_stack([np.ones(len(ys)), *(np.asarray(columns[k], dtype=float) for k in columns)])
    best, best_sse = np.zeros(len(names)), float(ys @ ys)
    for mask in range(1, 2 ** len(names)):
        used = [j for j in range(len(names)) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(design[:, used], ys, rcond=None)
        if (coef < 0).any():
            continue
        sse = float(((ys - design[:, used] @ coef) ** 2).sum())
        if sse < best_sse - 1e-12 * max(1.0, best_sse):
            best, best_sse = np.zeros(len(names)), sse
            best[used] = coef
    total = float(((ys - ys.mean()) ** 2).sum())
    return {**{k: float(v) for k, v in zip(names, best, strict=True)},
            "r2": 1.0 - best_sse / total if total else 1.0}


def rollout_fit(longest: Sequence[float], tokens: Sequence[float],
                seconds: Sequence[float]) -> dict[str, Any]:
    """The rollout's cost, c0 + cL · longest completion + cT · generated tokens (``model: "decode-aware"``),
    fitted with every coefficient >= 0; when its R² is under :data:`MIN_R2`, the time taken as proportional to
    the tokens (``model: "proportional"``: c0 = cL = 0, cT = Σ seconds / Σ tokens), which can only raise the
    ceiling."""
    fit = nonnegative_fit({"c_longest": longest, "c_tokens": tokens}, seconds)
    if fit["r2"] >= MIN_R2:
        return {**fit, "model": "decode-aware"}
    total = float(np.sum(tokens))
    return {"c0": 0.0, "c_longest": 0.0, "c_tokens": float(np.sum(seconds)) / total if total else 0.0,
            "r2": fit["r2"], "model": "proportional"}


def cost_fit(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """:func:`linear_fit` (``model: "affine"``) when its R² is at least :data:`MIN_R2`; otherwise the time
    taken as proportional to ``x`` (``model: "proportional"``: a = 0, b = Σy / Σx). The proportional model
    lets the oracle save every per-step cost too, so it can only raise the ceiling: the ceiling stays an upper
    bound."""
    fit = linear_fit(x, y)
    if fit["r2"] >= MIN_R2:
        return {**fit, "model": "affine"}
    total = float(np.sum(x))
    return {"a": 0.0, "b": float(np.sum(y)) / total if total else 0.0, "r2": fit["r2"],
            "model": "proportional"}


def _steps(metrics: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [m for m in metrics if "step_time" in m and not m.get("skipped")]


def informative_tokens(groups: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Per step, the generated tokens of its informative groups."""
    return {g["step"]: sum(sum(lens) for r, lens in zip(g["rewards"], g["lengths"], strict=True)
                           if informative(r))
            for g in groups}


def longest_completion(groups: Sequence[Mapping[str, Any]], only_informative: bool = False) -> dict[int, int]:
    """Per step, its longest completion in tokens (of its informative groups only, 0 where none)."""
    return {g["step"]: max((max(lens, default=0) for r, lens in zip(g["rewards"], g["lengths"], strict=True)
                            if informative(r) or not only_informative), default=0) for g in groups}


def _per_step(values: Mapping[int, int], metrics: Sequence[Mapping[str, Any]], who: str) -> list[int]:
    missing = [m["step"] for m in metrics if m["step"] not in values]
    if missing:
        raise ValueError(f"the {who}'s groups.jsonl has no line for step(s) {missing[:5]}: it and "
                         "metrics.jsonl must come from the same run")
    return [values[m["step"]] for m in metrics]


def oracle_ceiling(base_metrics: Sequence[Mapping[str, Any]], base_groups: Sequence[Mapping[str, Any]],
                   method_metrics: Sequence[Mapping[str, Any]], method_groups: Sequence[Mapping[str, Any]],
                   until: Mapping[str, float | None] | None = None) -> dict[str, Any]:
    """One seed's ceiling of the method over the baseline (the module docstring's model), with its parts.

    ``speedup`` is over the whole run; ``until`` (name -> a training time of the baseline, e.g. its time to a
    target) adds ``by_time``: per name, that time over the oracle's time for the same steps of the baseline
    (the step in progress at that time counted in proportion), None where the time is None.
    """
    base, steps = _steps(base_metrics), _steps(method_metrics)
    if not base or not steps:
        raise ValueError("the baseline's or the method's metrics.jsonl has no steps")
    both = [*base, *steps]  # the same engine and packing for both: one fit over their steps
    longest = [*_per_step(longest_completion(base_groups), base, "baseline"),
               *_per_step(longest_completion(method_groups), steps, "method")]
    rollout = rollout_fit(longest, [m["tokens_generated"] for m in both], [m["time_rollout"] for m in both])
    update = cost_fit([m["tokens_trained"] for m in both], [m["time_update"] for m in both])
    other = float(np.mean([m["step_time"] - m["time_rollout"] - m["time_update"] for m in base]))
    own_informative = sum(informative_tokens(method_groups).values())
    kappa = sum(m["tokens_trained"] for m in steps) / own_informative if own_informative else 1.0
    useful = _per_step(informative_tokens(base_groups), base, "baseline")
    useful_longest = _per_step(longest_completion(base_groups, only_informative=True), base, "baseline")
    # a step without an informative group rolls out and trains nothing (the oracle knows), but still pays
    # `other`
    oracle_steps = [(rollout["c0"] + rollout["c_longest"] * length + rollout["c_tokens"] * n
                     + update["a"] + update["b"] * kappa * n if n else 0.0) + other
                    for n, length in zip(useful, useful_longest, strict=True)]
    base_steps = [m["step_time"] for m in base]
    oracle, base_time = sum(oracle_steps), sum(base_steps)
    out = {"speedup": base_time / oracle if oracle > 0 else None, "baseline_s": base_time, "oracle_s": oracle,
           "informative_token_share": sum(useful) / max(1, sum(m["tokens_generated"] for m in base)),
           "kappa": kappa, "rollout_fit": rollout, "update_fit": update, "other_s_per_step": other}
    if until is not None:
        out["by_time"] = {name: _ratio_until(t, base_steps, oracle_steps) for name, t in until.items()}
    return out


def _ratio_until(t: float | None, base_steps: Sequence[float], oracle_steps: Sequence[float]) -> float | None:
    """``t`` over the oracle's time for the baseline steps done by training time ``t``."""
    if t is None or t <= 0:
        return None
    spent = oracle = 0.0
    for b, o in zip(base_steps, oracle_steps, strict=True):
        if spent + b >= t:
            oracle += o * (t - spent) / b if b > 0 else 0.0
            break
        spent, oracle = spent + b, oracle + o
    return t / oracle if oracle > 0 else None


def ceilings(groups_dir: str | Path, metrics_dir: str | Path, runs: Mapping[str, Sequence[Mapping[str, Any]]],
             baselines: Sequence[str],
             speedups: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per baseline and method, the ceiling over the seeds both ran and the fraction of it reached.

    ``speedup``: over the whole run (mean over seeds, and ``per_seed``); ``by_target``: per target of
    ``speedups`` (:func:`~dppo_core.tools.bench.summary.speedups_vs` per baseline), the ceiling up to the
    baseline's time to that target (mean over the seeds where the baseline reached it), and
    ``fraction_reached``: the measured time-to-target speedup over it. Groups are read from ``groups_dir``'s
    runs, times from ``metrics_dir``'s (the same directory, or ``--times-from``'s). A method without
    ``groups.jsonl`` (a TRL peer, or a run made before the log existed) gets None with the reason."""
    out: dict[str, dict[str, Any]] = {}
    for base in baselines:
        if base not in runs:
            continue
        out[base] = {}
        targets = {f: t["target"] for f, t in
                   next(iter(speedups.get(base, {}).values()), {}).get("by_target", {}).items()}
        curves = {r["seed"]: r["curve"] for r in runs[base]}
        for method, rs in runs.items():
            if method == base:
                continue
            per_seed, reason = [], None
            for r in rs:
                seed = r["seed"]
                if seed not in curves:
                    continue
                until = {f: time_to_target(curves[seed], target) for f, target in targets.items()}
                try:
                    per_seed.append(oracle_ceiling(
                        read_jsonl(run_dir(metrics_dir, base, seed) / "metrics.jsonl"),
                        read_groups(run_dir(groups_dir, base, seed)),
                        read_jsonl(run_dir(metrics_dir, method, seed) / "metrics.jsonl"),
                        read_groups(run_dir(groups_dir, method, seed)), until))
                except (FileNotFoundError, ValueError) as exc:
                    reason = str(exc)
                    break
            if reason is None and any(c["speedup"] is None for c in per_seed):
                reason = "the cost model fitted to these runs predicts no time for the oracle"
            if reason is not None or not per_seed:
                out[base][method] = {"speedup": None, "why_not": reason or "no seed both ran"}
                continue
            measured = speedups.get(base, {}).get(method, {}).get("by_target", {})
            by_target = {}
            for f in targets:
                values = [c["by_time"][f] for c in per_seed if c["by_time"].get(f) is not None]
                ceiling = float(np.mean(values)) if values else None
                got = measured.get(f, {}).get("time_to_target")
                by_target[f] = {"ceiling": ceiling, "n": len(values),
                                "fraction_reached": got / ceiling if got and ceiling else None}
            out[base][method] = {
                "speedup": float(np.mean([c["speedup"] for c in per_seed])),
                "per_seed": [c["speedup"] for c in per_seed], "by_target": by_target,
                "fraction_reached": {f: t["fraction_reached"] for f, t in by_target.items()},
                "kappa": float(np.mean([c["kappa"] for c in per_seed])),
                "informative_token_share": float(np.mean([c["informative_token_share"] for c in per_seed])),
                "seeds": per_seed}
    return out
