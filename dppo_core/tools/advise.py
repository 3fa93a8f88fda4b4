"""``dppo advise RUN_DIR``: would DPPO help this run? Read off a run's own ``groups.jsonl`` (any method's,
TRL's or a foreign trainer's written with :func:`dppo_core.grouplog.group_record`), and its ``metrics.jsonl``
and ``config.json`` where present.

What it computes (:func:`advise`), each with what it assumes:

- **persistence** (:func:`dppo_core.grouplog.persistence`): how far a prompt's last group tells whether its
  next will be all-equal (every reward equal: no gradient), what any pruning of prompts by history can see;
- **the predictor's separation**: the run replayed step by step with DPPO's own prompt predictor (a
  :class:`~dppo_core.history.PromptHistory` and :func:`~dppo_core.posterior.posterior_scores`, the scheme
  ``prompt_scheme: posterior`` uses): before each step its prompts are scored, then the step's groups
  observed. The AUC of the score for "this group is informative", over the groups whose prompt was seen before
  and over all;
- **the prompt stage**: DPPO's prompt keep probabilities π (the ``tiny-dppo`` preset's estimator through
  :func:`~dppo_core.estimator.make_estimator`, at ``prompt_prune_rate``, dense prompts off: the rate saves
  rollouts instead of refilling the batch) on each logged step's prompts, history as of the earlier steps: the
  expected share of prompts and of generated tokens rolled out, the expected all-equal share among the
  rolled-out groups (Σ π·[all-equal] / Σ π) against the logged one, and the variance factor Σ_{informative}
  (1/π) / their number (how much the weights multiply the second moment of the informative groups' gradient
  when those are of similar size; pruning a share c at random gives 1/c and leaves the all-equal share as it
  was);
- **the completion stage**: the share of generated tokens in all-equal groups (what skipping
  exactly-zero-advantage completions saves in the update, as ``grpo_skip`` does, when there is no KL term),
  and the expected tokens DPPO's completion pruning trains (the preset's keep probabilities on the logged
  advantages and lengths) as a share of the informative groups' tokens;
- **the prediction** (:func:`predicted_speedup`): the prompt stage against grpo_skip given the same prompts a
  step (batch-matched), from the effective batch its weights leave and a gradient noise scale measured on
  cpu-realistic;
- **the ceiling** (:func:`dppo_core.tools.bench.ceiling.oracle_ceiling`), where ``metrics.jsonl`` has the
  phase times: the run against an oracle that rolls out only its informative groups and trains as the run did.

The replay observes every logged group: it takes the logged trajectory as the one a pruned run would have
followed (pruning changes which prompts are seen, so the history and the policy would differ), and a pruned
run's log (π < 1) holds only the groups it rolled out, so its own selection is replayed on top. No figure
draws at random: all are expectations over the keep probabilities.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dppo_core.config import ConfigError, preset
from dppo_core.estimator import DPPOEstimator, make_estimator
from dppo_core.grouplog import FILENAME, informative, persistence, read_groups, read_records
from dppo_core.grpo import group_advantages
from dppo_core.posterior import posterior_scores

# format_advice: callers import it from here
from dppo_core.tools.advice_text import assumptions, format_advice, verdict  # noqa: F401

#: The metrics the ceiling's cost model is fitted to, per step of ``metrics.jsonl``.
PHASE_KEYS = ("time_rollout", "time_update", "step_time", "tokens_generated", "tokens_trained")
#: The preset whose estimator is replayed (its prompt and completion schemes, floors and half-life).
PRESET = "tiny-dppo"


class AdviseError(ValueError):
    """A run directory that cannot be read (missing, no group log, a malformed line): one line, exit code
    2."""


# --------------------------------------------------------------------------------------------------
# Reading a run
# --------------------------------------------------------------------------------------------------


def _check_record(record: Mapping[str, Any], path: Path) -> None:
    """A group-log line has ids, pi, rewards and lengths, one row per id, each step's rows of one length G >=
    2."""
    try:
        missing = [k for k in ("step", "ids", "rewards", "lengths") if k not in record]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        ids, rewards, lengths = record["ids"], record["rewards"], record["lengths"]
        pi = record.get("pi", [1.0] * len(ids))
        int(record["step"])
        if not (len(ids) == len(rewards) == len(lengths) == len(pi)):
            raise ValueError(f"{len(ids)} ids, {len(pi)} pi, {len(rewards)} reward rows, {len(lengths)} "
                             "length rows")
        sizes = {len(row) for row in rewards} | {len(row) for row in lengths}
        if len(sizes) > 1 or (sizes and min(sizes) < 2):
            raise ValueError(f"rows of {sorted(sizes)} completions; each step's groups need one size G >= 2")
        if not all(math.isfinite(float(x)) for row in rewards for x in row):
            raise ValueError("a reward is not a finite number")
    except (KeyError, TypeError, ValueError) as exc:
        raise AdviseError(f"{path}: the line of step {record.get('step')!r} is not a group record ({exc}); "
                          "each line needs step, ids, pi, rewards and lengths, one row per id, as "
                          "dppo_core.grouplog.group_record writes them") from None


def load_run(run: str | Path) -> dict[str, Any]:
    """A run's group log (required), metrics and config (None where absent or unreadable): ``{"dir", "groups",
    "metrics", "config"}``. ``run`` is a run directory, or the path of its ``groups.jsonl``. Raises
    :class:`AdviseError` naming the input and the fix."""
    path = Path(run).expanduser()
    if not path.exists():
        raise AdviseError(f"{run} does not exist; pass a run's output directory, the one holding {FILENAME} "
                          "(e.g. runs/tiny-grpo)")
    groups_path = path if path.is_file() else path / FILENAME
    if not groups_path.is_file():
        raise AdviseError(f"{run} has no {FILENAME}; dppo train and dppo bench write one per run (unless "
                          "log_groups is false); for another trainer, write one line per step with "
                          "dppo_core.grouplog.group_record and dppo_core.run.disk.append_jsonl")
    try:
        groups = [g for g in read_groups(groups_path) if g.get("ids")]
    except (KeyError, TypeError) as exc:  # a line without "step"
        raise AdviseError(f"{groups_path}: a line has no step ({exc}); each line is one step's group record "
                          "(dppo_core.grouplog.group_record)") from None
    if not groups:
        raise AdviseError(f"{groups_path} holds no group: pass the log of a run that has made at least one "
                          "step")
    for g in groups:
        _check_record(g, groups_path)
    folder = groups_path.parent
    metrics = read_records(folder / "metrics.jsonl") if (folder / "metrics.jsonl").is_file() else None
    config = None
    if (folder / "config.json").is_file():
        try:
            loaded = json.loads((folder / "config.json").read_text())
            config = loaded if isinstance(loaded, dict) else None
        except ValueError:
            config = None
    return {"dir": str(run), "groups": groups, "metrics": metrics, "config": config}


# --------------------------------------------------------------------------------------------------
# The figures
# --------------------------------------------------------------------------------------------------


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """The probability that a random positive is scored above a random negative, ties counted half
    (Mann-Whitney); None without both classes."""
    pos = sum(bool(y) for y in labels)
    neg = len(labels) - pos
    if not pos or not neg:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    rank_sum, i = 0.0, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        rank = (i + j) / 2 + 1  # tied scores share their mean rank
        rank_sum += rank * sum(bool(labels[order[k]]) for k in range(i, j + 1))
        i = j + 1
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def _setting(config: Mapping[str, Any] | None, key: str) -> Any:
    return None if config is None else config.get(key)


def run_settings(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run's KL weight and reward scaling (config.json; TRL's boolean ``scale_rewards`` read as group /
    none), and which were assumed: ``{"beta", "scale_rewards", "assumed"}``."""
    beta, scale, assumed = _setting(config, "beta"), _setting(config, "scale_rewards"), []
    if not isinstance(beta, (int, float)) or isinstance(beta, bool):
        beta = 0.0
        assumed.append("beta")
    if isinstance(scale, bool):
        scale = "group" if scale else "none"
    if scale not in ("group", "none", "batch"):
        scale = "group"
        assumed.append("scale_rewards")
    return {"beta": float(beta), "scale_rewards": scale, "assumed": assumed}


def make_advice_estimator(group_size: int, prompt_prune_rate: float, completion_prune_rate: float | None,
                          beta: float, scale_rewards: str, prompt_scheme: str | None = None) -> DPPOEstimator:
    """The ``tiny-dppo`` preset's estimator at this run's G, KL weight and reward scaling, dense prompts off
    (``scale_rewards: batch``, which prompt pruning refuses, replayed as ``group``); ``prompt_scheme``
    replaces the preset's (``posterior``) when given."""
    updates: dict[str, Any] = {"prompt_prune_rate": prompt_prune_rate, "dense_prompts": False,
                               "num_generations": group_size, "beta": beta,
                               "scale_rewards": "group" if scale_rewards == "batch" else scale_rewards}
    if prompt_scheme is not None:
        updates["prompt_scheme"] = prompt_scheme
    if completion_prune_rate is not None:
        updates["completion_prune_rate"] = completion_prune_rate
    try:
        estimator = make_estimator(preset(PRESET).with_overrides(updates))
    except ConfigError as exc:
        raise AdviseError(str(exc)) from None
    assert isinstance(estimator, DPPOEstimator)
    return estimator


def _rewards_in_unit_interval(groups: Sequence[Mapping[str, Any]]) -> tuple[bool, float, float]:
    values = [float(x) for g in groups for row in g["rewards"] for x in row]
    lo, hi = min(values), max(values)
    return 0.0 <= lo and hi <= 1.0, lo, hi


def replay_prompt_stage(groups: Sequence[Mapping[str, Any]], estimator: DPPOEstimator) -> dict[str, Any]:
    """The posterior predictor's AUC and the prompt stage's expected saving, replayed over the log (module
    docstring).

    Before each step: every logged prompt's posterior score and keep probability π from the history of the
    earlier steps; then the step's groups are observed (``estimator.observe``: ``history.update`` with group
    advantages). Needs rewards in [0, 1] (the posterior reads them as pass rates: ValueError otherwise)."""
    scores: list[float] = []
    probs: list[float] = []
    labels: list[bool] = []
    seen: list[bool] = []
    tokens: list[int] = []
    scale = estimator.scale_rewards
    for g in groups:
        step, ids, g_size = int(g["step"]), list(g["ids"]), len(g["rewards"][0])
        estimator.group_size = g_size
        history = estimator.history
        seen += [history.score(pid, step, estimator.history_max_age) is not None for pid in ids]
        scores += posterior_scores(history, ids, g_size, step=step, max_age=estimator.history_max_age,
                                   scale_rewards=scale).tolist()
        probs += estimator.prompt_probs(ids, step).tolist()
        labels += [informative(r) for r in g["rewards"]]
        tokens += [sum(lens) for lens in g["lengths"]]
        rewards = torch.tensor(g["rewards"], dtype=torch.float64)
        estimator.observe(ids, rewards, group_advantages(rewards, scale), step)
    n, kept = len(labels), sum(probs)
    equal_kept = sum(p for p, y in zip(probs, labels, strict=True) if not y)
    useful = [p for p, y in zip(probs, labels, strict=True) if y]
    seen_idx = [i for i, s in enumerate(seen) if s]
    return {
        "auc_seen": auc([scores[i] for i in seen_idx], [labels[i] for i in seen_idx]),
        "groups_seen": len(seen_idx),
        "auc_all": auc(scores, labels),
        "groups": n,
        "prompt_share_rolled_out": kept / n,
        "token_share_rolled_out": (sum(p * t for p, t in zip(probs, tokens, strict=True))
                                   / max(1, sum(tokens))),
        "tokens_rolled_out": sum(p * t for p, t in zip(probs, tokens, strict=True)),
        "tokens_logged": sum(tokens),
        "all_equal_share_rolled_out": equal_kept / kept if kept else None,
        "all_equal_share_logged": 1 - sum(labels) / n,
        "variance_factor": sum(1 / p for p in useful) / len(useful) if useful else None,
        "random_variance_factor": n / kept if kept else None,
        "probs": probs,
    }


def completion_stage(groups: Sequence[Mapping[str, Any]], estimator: DPPOEstimator,
                     prompt_probs: Sequence[float] | None = None) -> dict[str, Any]:
    """The update's saving on the logged groups: the share of generated tokens in all-equal groups (what
    skipping exactly-zero-advantage completions saves, at beta = 0), and the tokens DPPO's completion pruning
    trains in expectation (Σ p·length, p the estimator's completion keep probabilities on the group advantages
    and logged lengths), as a share of the informative groups' tokens and of all generated; with
    ``prompt_probs`` (one per logged group, in order) also after the prompt stage (Σ π Σ p·length over all
    generated) and both stages' variance factor Σ A² / (π p) / Σ A² over the completions with A ≠ 0 (1/π alone
    for the prompt stage with group-scaled advantages; the completion stage's weights on top, with gradients
    of size ∝ |A|)."""
    total = informative_tokens = equal_tokens = trained = trained_informative = both = signal = weighted = 0.0
    q = 0
    for g in groups:
        rewards = torch.tensor(g["rewards"], dtype=torch.float64)
        lengths = torch.tensor(g["lengths"], dtype=torch.float64)
        adv = group_advantages(rewards, estimator.scale_rewards)
        probs = estimator.completion_probs(adv, lengths)
        expected = (probs * lengths).sum(dim=1).tolist()
        # Σ A² / p per group: the second moment its completions' weights leave, with gradients of size ∝ |A|
        square = adv.pow(2)
        inverse = torch.where(square > 0, square / probs.clamp_min(1e-12),
                              torch.zeros_like(square)).sum(dim=1)
        for row, lens, kept, a2, a2_p in zip(g["rewards"], g["lengths"], expected, square.sum(dim=1).tolist(),
                                             inverse.tolist(), strict=True):
            pi = prompt_probs[q] if prompt_probs is not None else 1.0
            signal += a2
            weighted += a2_p / pi
            n = float(sum(lens))
            total += n
            trained += kept
            if informative(row):
                informative_tokens += n
                trained_informative += kept
            else:
                equal_tokens += n
            both += kept * pi
            q += 1
    return {
        "tokens_generated": total,
        "all_equal_token_share": equal_tokens / total if total else None,
        "skip_trained_share": informative_tokens / total if total else None,
        "dppo_trained_share_of_informative": (trained_informative / informative_tokens
                                              if informative_tokens else None),
        "dppo_trained_share_of_generated": trained / total if total else None,
        "both_stages_trained_share_of_generated": (both / total if total and prompt_probs is not None
                                                   else None),
        "both_stages_variance_factor": weighted / signal if signal and prompt_probs is not None else None,
    }


def ceiling(groups: Sequence[Mapping[str, Any]],
            metrics: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """The oracle ceiling of the run over itself (:func:`~dppo_core.tools.bench.ceiling.oracle_ceiling`), or
    ``{"speedup": None, "why_not": ...}``."""
    if metrics is None:
        return {"speedup": None, "why_not": "no metrics.jsonl beside groups.jsonl: the phase times the cost "
                                            "model is fitted to are not there"}
    steps = [m for m in metrics if "step_time" in m and not m.get("skipped")]
    missing = sorted({k for m in steps for k in (*PHASE_KEYS, "step")
                      if not isinstance(m.get(k), (int, float))})
    if not steps:
        return {"speedup": None, "why_not": "metrics.jsonl has no step with step_time (a foreign or TRL "
                                            "run's metrics): the ceiling needs " + ", ".join(PHASE_KEYS)}
    if missing:
        return {"speedup": None, "why_not": f"metrics.jsonl lacks {', '.join(missing)} on some steps: the "
                                            "ceiling needs " + ", ".join(PHASE_KEYS) + " per step"}
    from dppo_core.tools.bench.ceiling import oracle_ceiling  # the bench's package: only where it is needed

    try:
        out = oracle_ceiling(steps, groups, steps, groups)
    except ValueError as exc:
        return {"speedup": None, "why_not": str(exc)}
    if out["speedup"] is None:
        out["why_not"] = "the cost model fitted to this run predicts no time for the oracle"
    return out


#: The gradient noise scale, in informative groups per step, that :func:`predicted_speedup` assumes: measured
#: from grpo_skip at 32 and at 16 prompts a step on cpu-realistic (eight seeds; benchmarks/noise_scale.py,
#: benchmarks/results/realistic-pool/noise_scale.json: the mean over its two targets).
NOISE_SCALE = 10.4


def predicted_speedup(prompt: Mapping[str, Any], completion: Mapping[str, Any], prompts_per_step: float,
                      update_share: float | None, noise_scale: float = NOISE_SCALE) -> dict[str, Any]:
    """What the replayed stages predict for DPPO rolling out only its kept prompts against grpo_skip given as
    many prompts a step, picked at random (batch-matched): ``prompt`` from :func:`replay_prompt_stage`,
    ``completion`` from :func:`completion_stage` with the prompt probabilities.

    Both estimate the pool's gradient from the informative groups they roll out. The baseline has B =
    ``prompts_per_step`` x (share rolled out) x (1 - logged all-equal share) informative groups a step,
    weighted alike; DPPO's weights 1/(π p) make its estimate as noisy as ρ B such groups, ρ =
    ``random_variance_factor`` / ``both_stages_variance_factor`` (each variance is the informative groups'
    second moment times its factor over the candidates). Steps to a target fall with the batch as S(B) = S_min
    (1 + B_noise / B) (McCandlish et al., 2018), so DPPO needs (1 + B_noise / B) / (1 + B_noise / (ρ B)) times
    fewer steps: between 1 (B_noise = 0) and ρ. A step costs 1 + ``update_share`` x (tokens DPPO trains /
    tokens the baseline trains - 1) times the baseline's (the rollouts are the same count; None: no phase
    times, no time predicted)."""
    rvf, vf = prompt.get("random_variance_factor"), completion.get("both_stages_variance_factor")
    if not vf or not rvf:
        return {"why_not": "the replay kept no informative group"}
    batch = prompts_per_step * prompt["prompt_share_rolled_out"] * (1 - prompt["all_equal_share_logged"])
    rho = rvf / vf
    steps = (1 + noise_scale / batch) / (1 + noise_scale / (rho * batch)) if batch > 0 else 1.0
    baseline_trained = prompt["prompt_share_rolled_out"] * completion["skip_trained_share"]
    trained = (completion["both_stages_trained_share_of_generated"] / baseline_trained if baseline_trained
               else None)
    cost = None if update_share is None or trained is None else 1 + update_share * (trained - 1)
    return {"effective_batch_ratio": rho, "informative_groups_per_step": batch, "noise_scale": noise_scale,
            "steps_speedup": steps, "trained_token_ratio": trained, "step_cost_ratio": cost,
            "time_speedup": None if cost is None else steps / cost}


def advise(run: str | Path, prompt_prune_rate: float = 0.5, completion_prune_rate: float | None = None,
           prompt_scheme: str | None = None, noise_scale: float = NOISE_SCALE) -> dict[str, Any]:
    """Every figure of the module docstring for one run, as a JSON-ready dict (ratios rounded to 4 decimals),
    with ``why_not`` where a figure cannot be computed, the ``verdict`` in plain words and the
    ``assumptions``.

    ``completion_prune_rate``: None takes the preset's (0.5); ``prompt_scheme``: None the preset's
    (``posterior``; ``fitted`` is the sharper one, docs/benchmarks.md); ``noise_scale``:
    :func:`predicted_speedup`'s. Raises :class:`AdviseError` for an input that cannot work."""
    for name, rate in (("--prompt-prune-rate", prompt_prune_rate),
                       ("--completion-prune-rate", completion_prune_rate)):
        if rate is not None and not 0 <= rate < 1:
            raise AdviseError(f"{name} {rate}: a prune rate is the expected share pruned, in [0, 1), "
                              "e.g. 0.5")
    loaded = load_run(run)
    groups = loaded["groups"]
    settings = run_settings(loaded["config"])
    estimator = make_advice_estimator(len(groups[0]["rewards"][0]), prompt_prune_rate, completion_prune_rate,
                                      settings["beta"], settings["scale_rewards"], prompt_scheme)
    pers = persistence(groups)
    unit, lo, hi = _rewards_in_unit_interval(groups)
    prompt: dict[str, Any]
    if unit:
        prompt = replay_prompt_stage(groups, estimator)
    else:
        prompt = {"why_not": f"rewards run from {lo:g} to {hi:g}, outside [0, 1]: the posterior reads them "
                             "as pass rates and does not apply (prompt_scheme paper or proportional, which "
                             "read only |A|, would; not replayed here)"}
    probs = prompt.pop("probs", None)
    report: dict[str, Any] = {
        "run": loaded["dir"], "steps": len(groups), "groups": pers.groups, "prompts": pers.prompts,
        "group_size": sorted({len(g["rewards"][0]) for g in groups}), "rewards": [lo, hi],
        "pruned_log": any(float(p) < 1 for g in groups for p in g.get("pi", [])),
        "settings": {"preset": PRESET, "prompt_prune_rate": prompt_prune_rate,
                     "prompt_scheme": estimator.prompt_scheme,
                     "min_prompt_keep_prob": estimator.min_prompt_keep_prob,
                     "posterior_half_life": estimator.posterior_half_life,
                     "completion_prune_rate": estimator.completion_prune_rate,
                     "completion_scheme": estimator.completion_scheme,
                     "min_completion_keep_prob": estimator.min_completion_keep_prob,
                     "length_exponent": estimator.length_exponent, **settings},
        "persistence": pers.to_dict(),
        "prompt_stage": prompt,
        "completion_stage": completion_stage(groups, estimator, probs),
        "ceiling": ceiling(groups, loaded["metrics"]),
    }
    metrics = [m for m in loaded["metrics"] or [] if "step_time" in m]
    generated = sum(m.get("tokens_generated") or 0 for m in metrics)
    report["completion_stage"]["logged_trained_share"] = (
        sum(m.get("tokens_trained") or 0 for m in metrics) / generated if generated else None)
    if "why_not" not in prompt:
        update = [m["time_update"] / m["step_time"] for m in metrics
                  if m.get("time_update") and m.get("step_time")]
        report["prediction"] = predicted_speedup(prompt, report["completion_stage"],
                                                 pers.groups / len(groups),
                                                 sum(update) / len(update) if update else None, noise_scale)
    report = _rounded(report)
    report["verdict"] = verdict(report)
    report["assumptions"] = assumptions(report)
    return report


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
