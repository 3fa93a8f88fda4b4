"""``dppo advise`` in words: the report of :func:`dppo_core.tools.advise.advise` as plain sentences
(:func:`verdict`), what its figures assume (:func:`assumptions`) and the text the command prints
(:func:`format_advice`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dppo_core.registry import PROMPT_SCHEMES


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


#: AUC bands of the verdict: at least the first, history "sees much"; at least the second, "some"; else
#: "little".
SEES_MUCH, SEES_SOME = 0.8, 0.65
#: The drop (in points of the all-equal share of rolled-out groups) from which the prompt stage is said to
#: make better batches rather than only thinner ones: a replayed drop of 12 points (the fitted rule on
#: cpu-realistic's grpo_skip seed-1 log) went with a measured 14; the replayed 2-5 points of the posterior
#: rule on the curated pools did not move the batches. It does not say the prompt stage pays: against
#: grpo_skip given the same prompts a step (batch-matched, eight seeds;
#: benchmarks/results/realistic-pool/matched/) that 14-point cut reached the targets 1.16x [1.00, 1.37] /
#: 1.00x [0.80, 1.23] sooner, no difference (issue #63: the 1.36x-1.46x this was first set from compared a
#: half batch with a full one).
PAYS_POINTS = 0.10
#: The predicted speedup against the batch-matched grpo_skip
#: (:func:`~dppo_core.tools.advise.predicted_speedup`) from which the verdict says the rollout budget should
#: pay: above the prediction's mean error on the persistence map (|log(predicted / measured)| 0.13 over its
#: two points; benchmarks/results/persistence-map/map.json).
PREDICTED_PAYS = 1.15


def verdict(r: Mapping[str, Any]) -> list[str]:
    """The report's figures in plain words: what history sees, what each stage would save, the ceiling, a
    bottom line."""
    p, ps, cs, ce = r["persistence"], r["prompt_stage"], r["completion_stage"], r["ceiling"]
    out = []
    if p["after_equal"] + p["after_mixed"] == 0:
        out.append("history sees nothing: no prompt was rolled out twice, so a prompt's past cannot tell its "
                   "next group (the prompt stage would prune every prompt alike, by the prior)")
    else:
        out.append(f"history sees P(all-equal | previous all-equal) = {_num(p['p_equal_after_equal'])} "
                   f"against P(all-equal | previous mixed) = {_num(p['p_equal_after_mixed'])}; "
                   f"{_pct(p['share_equal_with_equal_previous'])} of the all-equal groups that had a "
                   "previous group had an all-equal one")
    auc_seen = ps.get("auc_seen")
    if "why_not" in ps:
        out.append(f"the prompt stage: {ps['why_not']}")
    else:
        sees = ("much" if auc_seen >= SEES_MUCH else "some" if auc_seen >= SEES_SOME else "little") \
            if auc_seen is not None else None
        out.append(f"DPPO's posterior predictor separates informative groups with AUC {_num(auc_seen)} on "
                   f"prompts seen before ({ps['groups_seen']:,} groups; {_num(ps['auc_all'])} over all "
                   f"{ps['groups']:,})"
                   + (f": it sees {sees}" if sees else "") + " (0.5: no separation)")
        out.append(f"the prompt stage at rate {r['settings']['prompt_prune_rate']:g} would roll out "
                   f"{_pct(ps['prompt_share_rolled_out'])} of the prompts "
                   f"({_pct(ps['token_share_rolled_out'])} of the generated tokens), "
                   f"{_pct(ps['all_equal_share_rolled_out'])} of them all-equal instead of "
                   f"{_pct(ps['all_equal_share_logged'])}, with variance factor "
                   f"{_num(ps['variance_factor'])} (the same share pruned at random: "
                   f"{_num(ps['random_variance_factor'])}, all-equal share unchanged)")
    beta = r["settings"]["beta"]
    skip = (f"skipping the all-equal groups' completions in the update (exactly zero loss; grpo_skip) saves "
            f"{_pct(cs['all_equal_token_share'])} of the tokens a GRPO update trains" if beta == 0 else
            f"with a KL term (beta {beta:g}) all-equal groups still have a loss, so skipping them is not "
            f"free ({_pct(cs['all_equal_token_share'])} of the tokens are in them)")
    out.append(f"the completion stage: {skip}; DPPO's completion pruning "
               f"({r['settings']['completion_scheme']}, rate {r['settings']['completion_prune_rate']:g}) "
               f"trains {_pct(cs['dppo_trained_share_of_informative'])} of the informative groups' tokens in "
               f"expectation ({_pct(cs['dppo_trained_share_of_generated'])} of all generated)")
    if ce.get("speedup") is not None:
        fit = ce["rollout_fit"]
        out.append(f"the ceiling: an oracle that rolls out only this run's informative groups "
                   f"({_pct(ce['informative_token_share'])} of its tokens) and trains as it did would take "
                   f"{ce['speedup']:.2f}x less training time ({fit['model']} rollout fit, R² "
                   f"{fit['r2']:.2f}); no pruning that must roll a group out to see it is informative can do "
                   "better at equal learning per step")
    else:
        out.append(f"the ceiling: not computed ({ce['why_not']})")
    pred = r.get("prediction") or {}
    if pred.get("steps_speedup") is not None:
        time = (f"; a step {pred['step_cost_ratio']:.2f}x the baseline's time: "
                f"{pred['time_speedup']:.2f}x in time"
                if pred.get("time_speedup") is not None
                else " (no phase times: the time a step not predicted)")
        out.append("against grpo_skip given the same prompts a step at random (batch-matched): the 1/(π p) "
                   f"weights of both stages leave an effective batch {pred['effective_batch_ratio']:.2f}x "
                   f"the baseline's {pred['informative_groups_per_step']:.1f} informative groups a step; at "
                   f"a gradient noise scale of {pred['noise_scale']:g} such groups that predicts a speedup "
                   f"in steps of {pred['steps_speedup']:.2f}x (at most "
                   f"{pred['effective_batch_ratio']:.2f}x){time}")
    out.append("bottom line: " + _bottom_line(r))
    return out


def _bottom_line(r: Mapping[str, Any]) -> str:
    p, ps, cs = r["persistence"], r["prompt_stage"], r["completion_stage"]
    equal = p["share_all_equal"]
    if equal is not None and equal < 0.1:
        return (f"little to prune: only {_pct(equal)} of the groups are all-equal; what DPPO would save is "
                "the completion stage's")
    if "why_not" in ps:
        return "only the completion stage and the ceiling apply to these rewards"
    if r["settings"]["prompt_prune_rate"] == 0:
        return (f"the prompt stage is off (rate 0); the completion stage trains "
                f"{_pct(cs['dppo_trained_share_of_generated'])} of the generated tokens in expectation")
    drop = ps["all_equal_share_logged"] - (ps["all_equal_share_rolled_out"] or 0.0)
    predicted = (r.get("prediction") or {}).get("time_speedup")
    if drop >= PAYS_POINTS and predicted is not None and predicted >= PREDICTED_PAYS:
        return (f"the prompt stage should pay here as a rollout budget: history cuts the all-equal share by "
                f"{100 * drop:.0f} points, and the prediction is {predicted:.2f}x sooner than grpo_skip "
                "given the same prompts a step (on the persistence map at 0.96 it predicted 1.27x, and ten "
                "seeds measured 1.27x [1.01, 1.60] / 1.24x [0.90, 1.71] to 50% / 75% of the baseline's "
                "climb: at the edge, then no difference; benchmarks/results/persistence-map); run "
                "dppo_budget against grpo_skip_matched, and against grpo_skip at the full batch too, which "
                "there was as fast on twice the rollouts")
    if drop >= PAYS_POINTS:
        return ("the prompt stage makes better batches here: history cuts the all-equal share of rolled-out "
                f"groups by {100 * drop:.0f} points while rolling out {_pct(ps['prompt_share_rolled_out'])} "
                "of the prompts; that is not yet a faster run"
                + (f" (predicted {predicted:.2f}x against grpo_skip given the same prompts a step)"
                   if predicted else "")
                + ": on cpu-realistic a 14-point cut, spent as a rollout budget, reached the "
                "targets no sooner than grpo_skip given the same prompts a step (1.16x [1.00, 1.37] / 1.00x "
                "[0.80, 1.23], eight seeds: benchmarks/results/realistic-pool/matched), because the 1/π "
                "weights cost what the extra informative groups bring; measure against a batch-matched "
                "baseline (dppo bench's grpo_skip_matched) before counting on fewer rollouts, and expect the "
                "completion stage's saving in the update")
    return ("the prompt stage would mostly thin the batch: it cuts the all-equal share by only "
            f"{100 * drop:.0f} points (at least {100 * PAYS_POINTS:.0f} would make better batches, which has "
            "not yet been measured to pay over a batch-matched baseline), at about a smaller batch's noise; "
            "expect DPPO's gain from the update (with both stages it trains "
            f"{_pct(cs['both_stages_trained_share_of_generated'])} of the generated tokens in expectation), "
            "not from fewer rollouts"
            + ("; --prompt-scheme fitted replays the sharper rule, which cuts more where many prompts are "
               "solved always or never" if PROMPT_SCHEMES[r["settings"]["prompt_scheme"]].prior != "fitted"
               else ""))


def rule_words(scheme: str) -> str:
    """How the replayed prompt rule scores prompts, for :func:`assumptions` (the parenthesis is closed there):
    the registry's summary of ``scheme`` (one that reads no pass counts is replayed as ``posterior``)."""
    rule = PROMPT_SCHEMES[scheme]
    if "pass_counts" not in rule.reads:
        return rule_words(next(n for n, c in PROMPT_SCHEMES.items() if c.prior == "uniform"))
    return rule.summary + ("" if rule.prior == "uniform" else f" (prompt_scheme {scheme}")


def assumptions(r: Mapping[str, Any]) -> list[str]:
    """What the figures assume, for this run."""
    s = r["settings"]
    out = ["the replay observes every logged group in order: the logged trajectory is taken as the one a "
           "pruned run would follow (pruning changes which prompts are seen, hence the history and the "
           "policy)",
           f"DPPO as the {s['preset']} preset: prompts kept ∝ "
           + rule_words(s["prompt_scheme"])
           + f"; half-life {s['posterior_half_life']:g} steps, floor {s['min_prompt_keep_prob']:g}), dense "
           "prompts off (the rate saves rollouts rather than refilling the batch); completions by the "
           f"{s['completion_scheme']} scheme (γ {s['length_exponent']:g}, floor "
           f"{s['min_completion_keep_prob']:g}); every figure is an expectation over the keep probabilities, "
           "not one draw",
           "the variance factor treats the informative groups' gradients as of similar size (it is the "
           "factor on their second moment)",
           "all-equal means every reward of the group equal (every advantage 0)"]
    if s["assumed"]:
        out.append(f"no config.json value for {' and '.join(s['assumed'])}: assumed beta 0 (no KL term) and "
                   "group scaling")
    if s["scale_rewards"] == "batch":
        out.append("the run scaled rewards batch-wide, which prompt pruning refuses: replayed with group "
                   "scaling")
    if r["pruned_log"]:
        out.append("this run pruned prompts itself (logged π < 1): its log holds only the groups it rolled "
                   "out, so its persistence is of a selected sample and the replay prunes its selection "
                   "again")
    if r["ceiling"].get("speedup") is not None:
        out.append("the ceiling takes learning per step as equal and fits its cost model to this run's own "
                   "steps (rollout: c0 + cL · longest completion + cT · tokens; update: u0 + u1 · trained "
                   "tokens)")
    return out


def format_advice(r: Mapping[str, Any]) -> str:
    """The report as text: a header, the figures in words, the assumptions."""
    sizes = ", ".join(map(str, r["group_size"]))
    lines = [f"would DPPO help {r['run']}? {r['steps']:,} steps, {r['groups']:,} groups of G = {sizes}, "
             f"{r['prompts']:,} prompts; rewards from {r['rewards'][0]:g} to {r['rewards'][1]:g}"]
    lines += [f"- {line}" for line in r["verdict"]]
    lines += ["assumptions:"] + [f"- {line}" for line in r["assumptions"]]
    return "\n".join(lines)
