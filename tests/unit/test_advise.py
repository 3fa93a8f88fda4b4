"""`dppo advise RUN_DIR` (dppo_core/tools/advise.py) on synthetic group logs whose answers are known by hand."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dppo_core.grouplog import group_record
from dppo_core.run.disk import append_jsonl
from dppo_core.tools.advise import NOISE_SCALE, AdviseError, advise, auc, format_advice, predicted_speedup
from dppo_core.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
HALF_LIFE = 20.0  # the tiny-dppo preset's posterior_half_life


def write_run(folder: Path, steps: list[list[tuple[str, list[float], list[int]]]], config: dict | None = None,
              metrics: list[dict] | None = None) -> Path:
    """A run directory: groups.jsonl from (prompt id, rewards, lengths) per group per step (steps counted from 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    for step, groups in enumerate(steps, start=1):
        ids = [g[0] for g in groups]
        append_jsonl(folder / "groups.jsonl", group_record(
            step, len(ids), ids, torch.ones(len(ids)), torch.tensor([g[1] for g in groups], dtype=torch.float64),
            torch.tensor([g[2] for g in groups])))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    for m in metrics or []:
        append_jsonl(folder / "metrics.jsonl", m)
    return folder


def p_informative(successes: float, failures: float, g: int) -> float:
    """1 - E[p^G] - E[(1 - p)^G] for p ~ Beta(1 + successes, 1 + failures), by the moments' product formula (not
    the package's Beta-binomial sum)."""
    a, b = 1 + successes, 1 + failures
    moment = lambda x, y: math.prod((x + k) / (x + y + k) for k in range(g))  # noqa: E731
    return 1 - moment(a, b) - moment(b, a)


# --------------------------------------------------------------------------------------------------
# Two prompts, two steps: every figure by hand
# --------------------------------------------------------------------------------------------------

SOLVED = ("A", [1, 1, 1, 1], [2, 2, 2, 2])  # always all correct: 8 tokens
MIXED = ("C", [1, 1, 0, 0], [1, 3, 5, 7])  # always half right: 16 tokens


def test_two_steps_every_figure_by_hand(tmp_path):
    r = advise(write_run(tmp_path / "run", [[SOLVED, MIXED], [SOLVED, MIXED]]))
    # step 1: both unseen, equal prior scores, so each kept with 0.5 (half of 2 prompts). Step 2: A's evidence is
    # 4 successes, C's 2 and 2, each discounted by one step of the half-life; π ∝ √P(informative), summing to 1
    d = 0.5 ** (1 / HALF_LIFE)
    s_a, s_c = math.sqrt(p_informative(4 * d, 0, 4)), math.sqrt(p_informative(2 * d, 2 * d, 4))
    pi_a, pi_c = s_a / (s_a + s_c), s_c / (s_a + s_c)
    assert 0.2 < pi_a < pi_c < 1  # no floor or cap binds: the split above is exact
    ps = r["prompt_stage"]
    assert ps["prompt_share_rolled_out"] == 0.5
    assert ps["all_equal_share_logged"] == 0.5
    assert ps["all_equal_share_rolled_out"] == round((0.5 + pi_a) / 2, 4) < 0.5
    assert ps["variance_factor"] == round((1 / 0.5 + 1 / pi_c) / 2, 4) < 2.0 == ps["random_variance_factor"]
    assert ps["token_share_rolled_out"] == round((0.5 * 8 + 0.5 * 16 + pi_a * 8 + pi_c * 16) / 48, 4)
    assert ps["tokens_logged"] == 48
    # AUC over prompts seen before: C (informative) above A at step 2; over all: step 1's two tie (half a pair)
    assert ps["auc_seen"] == 1.0 and ps["groups_seen"] == 2
    assert ps["auc_all"] == 3.5 / 4
    # the completion stage: A's 16 of 48 tokens are all-equal; C's group keeps half its tokens in expectation
    # (p ∝ |A| / length with floor 0.2 and a budget of 8 of 16 tokens: p = 1, 7/9, 7/15, 1/3, none at a bound)
    cs = r["completion_stage"]
    assert cs["all_equal_token_share"] == round(16 / 48, 4) and cs["skip_trained_share"] == round(32 / 48, 4)
    assert cs["dppo_trained_share_of_informative"] == 0.5
    assert cs["dppo_trained_share_of_generated"] == round(16 / 48, 4)
    assert cs["both_stages_trained_share_of_generated"] == round((0.5 * 8 + pi_c * 8) / 48, 4)
    assert cs["logged_trained_share"] is None
    # persistence: one transition each way
    p = r["persistence"]
    assert (p["after_equal"], p["equal_after_equal"], p["after_mixed"], p["equal_after_mixed"]) == (1, 1, 1, 0)
    assert r["ceiling"] == {"speedup": None, "why_not": "no metrics.jsonl beside groups.jsonl: the phase times the "
                                                        "cost model is fitted to are not there"}
    assert any("no config.json value for beta and scale_rewards" in a for a in r["assumptions"])


def test_a_lower_prompt_rate_rolls_out_more(tmp_path):
    run = write_run(tmp_path / "run", [[SOLVED, MIXED], [SOLVED, MIXED]])
    assert advise(run, prompt_prune_rate=0.25)["prompt_stage"]["prompt_share_rolled_out"] == 0.75
    none = advise(run, prompt_prune_rate=0.0)["prompt_stage"]
    assert none["prompt_share_rolled_out"] == 1.0 and none["variance_factor"] == 1.0
    assert none["all_equal_share_rolled_out"] == none["all_equal_share_logged"] == 0.5
    assert advise(run, prompt_prune_rate=0.0)["verdict"][-1] == (
        "bottom line: the prompt stage is off (rate 0); the completion stage trains 33.3% of the generated tokens in "
        "expectation")


def test_a_pruned_runs_log_is_flagged(tmp_path):
    run = write_run(tmp_path / "run", [[SOLVED, MIXED]] * 2)
    assert not advise(run)["pruned_log"]
    append_jsonl(run / "groups.jsonl", group_record(3, 4, ["A"], torch.tensor([0.4]), torch.tensor([[1.0, 0, 1, 0]]),
                                                    torch.tensor([[3, 3, 3, 3]])))
    r = advise(run)
    assert r["pruned_log"] and r["steps"] == 3
    assert any(a.startswith("this run pruned prompts itself (logged π < 1)") for a in r["assumptions"])


# --------------------------------------------------------------------------------------------------
# Persistent prompts, prompts history cannot see, a coin
# --------------------------------------------------------------------------------------------------


def _persistent_steps(n: int = 6) -> list:
    """A always all correct, B always all wrong, C and D always half right; every prompt every step."""
    return [[("A", [1, 1, 1, 1], [4] * 4), ("B", [0, 0, 0, 0], [4] * 4),
             ("C", [1, 0, 1, 0], [4] * 4), ("D", [0, 1, 0, 1], [4] * 4)] for _ in range(n)]


def test_persistent_prompts_are_seen_exactly(tmp_path):
    r = advise(write_run(tmp_path / "run", _persistent_steps()))
    p = r["persistence"]
    assert p["p_equal_after_equal"] == 1.0 and p["p_equal_after_mixed"] == 0.0
    assert (p["after_equal"], p["after_mixed"], p["prompts_always_solved"], p["prompts_never_solved"]) == (10, 10, 1, 1)
    ps = r["prompt_stage"]
    assert ps["auc_seen"] == 1.0 and ps["groups_seen"] == 20
    # over all 24 groups: step 1's four tie at the prior, below every later informative group and above every later
    # all-equal one: of 12 x 12 pairs, 120 + 20 won, 4 tied
    assert ps["auc_all"] == round(142 / 144, 4)
    assert ps["prompt_share_rolled_out"] == 0.5
    assert ps["all_equal_share_rolled_out"] < ps["all_equal_share_logged"] == 0.5
    assert ps["variance_factor"] < ps["random_variance_factor"] == 2.0
    assert "P(all-equal | previous all-equal) = 1.00 against P(all-equal | previous mixed) = 0.00" in r["verdict"][0]
    assert "it sees much" in r["verdict"][1]


def test_the_fitted_scheme_cuts_more_all_equal_groups_on_a_pool_solved_always_or_never(tmp_path, capsys):
    """--prompt-scheme fitted on a pool of 30 prompts, 10 always solved, 10 never, 10 half right, seen for 6 steps:
    the fit is U-shaped, so it rolls out fewer all-equal groups than the uniform prior's √ rule at the same share,
    for a variance factor still below a random cut's; and what it replays is named."""
    steps = [[(f"s{i}", [1, 1, 1, 1], [2] * 4) for i in range(10)] + [(f"n{i}", [0, 0, 0, 0], [2] * 4)
                                                                      for i in range(10)]
             + [(f"m{i}", [1, 1, 0, 0], [2] * 4) for i in range(10)] for _ in range(6)]
    run = write_run(tmp_path / "run", steps)
    post, fitted = advise(run), advise(run, prompt_scheme="fitted")
    assert post["settings"]["prompt_scheme"] == "posterior" and fitted["settings"]["prompt_scheme"] == "fitted"
    a, b = post["prompt_stage"], fitted["prompt_stage"]
    assert a["prompt_share_rolled_out"] == b["prompt_share_rolled_out"] == 0.5
    assert b["all_equal_share_rolled_out"] < a["all_equal_share_rolled_out"] - 0.1
    assert b["variance_factor"] < b["random_variance_factor"]
    assert "fitted to the pool" in " ".join(fitted["assumptions"]) and "uniform prior" in " ".join(post["assumptions"])
    assert main(["advise", str(run), "--json", "--prompt-scheme", "fitted"]) == 0
    assert json.loads(capsys.readouterr().out) == fitted


def test_the_prediction_lies_between_no_gain_and_the_effective_batch():
    """A rule that keeps every informative group and completion (variance factor 1) where a random half has 2: ρ = 2.
    32 prompts a step, half rolled out, half of the logged groups all-equal: the matched baseline has 8 informative
    groups a step. No noise: no gain from a larger batch; noise 8: (1 + 1) / (1 + 1/2); boundless noise: ρ. Half the
    step in the update, DPPO training all the informative tokens (half the generated) where the baseline trains
    half of them: 1.5x the time a step."""
    prompt = {"random_variance_factor": 2.0, "prompt_share_rolled_out": 0.5, "all_equal_share_logged": 0.5}
    completion = {"both_stages_variance_factor": 1.0, "both_stages_trained_share_of_generated": 0.5,
                  "skip_trained_share": 0.5}
    assert predicted_speedup(prompt, completion, 32, None, 0.0)["steps_speedup"] == 1.0
    mid = predicted_speedup(prompt, completion, 32, 0.5, 8.0)
    assert mid["informative_groups_per_step"] == 8.0 and mid["effective_batch_ratio"] == 2.0
    assert mid["steps_speedup"] == pytest.approx(2 / 1.5) and mid["step_cost_ratio"] == pytest.approx(1.5)
    assert mid["time_speedup"] == pytest.approx(2 / 1.5 / 1.5) and mid["trained_token_ratio"] == 2.0
    assert predicted_speedup(prompt, completion, 32, None, 1e12)["steps_speedup"] == pytest.approx(2.0)
    assert predicted_speedup(prompt, completion, 32, None, 8.0)["time_speedup"] is None
    # the completion stage's weights count: a factor of 2 on top of the prompt stage's 1 leaves no gain
    assert predicted_speedup(prompt, {**completion, "both_stages_variance_factor": 2.0}, 32, None, 8.0)[
        "steps_speedup"] == pytest.approx(1.0)
    assert "why_not" in predicted_speedup(prompt, {**completion, "both_stages_variance_factor": None}, 32, None)


def test_a_pool_solved_always_or_never_is_predicted_to_pay(tmp_path):
    """10 prompts always solved, 10 never, 10 half right, 6 steps, the update a twentieth of each step, no completion
    pruning: the fitted rule keeps the half-right ones and drops the rest, so the prediction is well above 1 and the
    bottom line says to run the rollout budget against both baselines; without phase times it predicts steps only and
    says nothing of time."""
    steps = [[(f"s{i}", [1, 1, 1, 1], [2] * 4) for i in range(10)] + [(f"n{i}", [0, 0, 0, 0], [2] * 4)
                                                                      for i in range(10)]
             + [(f"m{i}", [1, 1, 0, 0], [2] * 4) for i in range(10)] for _ in range(6)]
    metrics = [{"step": k, "step_time": 2.0, "time_update": 0.1, "time_rollout": 1.9, "tokens_generated": 240,
                "tokens_trained": 80} for k in range(1, 7)]
    r = advise(write_run(tmp_path / "run", steps, metrics=metrics), prompt_scheme="fitted", completion_prune_rate=0.0)
    pred = r["prediction"]
    assert pred["effective_batch_ratio"] > 1.2 and pred["time_speedup"] > 1.15
    assert r["verdict"][-1].startswith("bottom line: the prompt stage should pay here as a rollout budget")
    bare = advise(write_run(tmp_path / "bare", steps), prompt_scheme="fitted", completion_prune_rate=0.0)
    assert bare["prediction"]["time_speedup"] is None and "should pay" not in bare["verdict"][-1]


def test_both_stages_variance_factor_by_hand(tmp_path):
    """Completion pruning off, so p = 1 on every A ≠ 0: the factor is Σ G / π over the informative groups / their
    G's: the prompt stage's own variance factor."""
    run = write_run(tmp_path / "run", _persistent_steps())
    r = advise(run, completion_prune_rate=0.0)
    assert r["completion_stage"]["both_stages_variance_factor"] == pytest.approx(
        r["prompt_stage"]["variance_factor"], abs=1e-4)


def test_the_report_carries_the_prediction_and_the_command_its_noise_scale(tmp_path, capsys):
    run = write_run(tmp_path / "run", _persistent_steps())
    report = advise(run)
    assert report["prediction"]["noise_scale"] == NOISE_SCALE
    assert any(line.startswith("against grpo_skip given the same prompts") for line in report["verdict"])
    assert main(["advise", str(run), "--json", "--noise-scale", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["prediction"]["noise_scale"] == 3
    assert main(["advise", str(run), "--noise-scale", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: --noise-scale -1.0")


def test_history_that_never_repeats_a_prompt_sees_nothing(tmp_path):
    steps = [[(f"s{s}-eq", [1, 1, 1, 1], [3] * 4), (f"s{s}-mix", [1, 0, 0, 0], [3] * 4),
              (f"s{s}-zero", [0, 0, 0, 0], [3] * 4)] for s in range(4)]
    r = advise(write_run(tmp_path / "run", steps))
    ps = r["prompt_stage"]
    assert ps["auc_seen"] is None and ps["groups_seen"] == 0
    assert ps["auc_all"] == 0.5  # every group scored by the same prior
    assert ps["all_equal_share_rolled_out"] == ps["all_equal_share_logged"] == round(2 / 3, 4)
    assert ps["variance_factor"] == ps["random_variance_factor"] == 2.0
    assert r["verdict"][0].startswith("history sees nothing: no prompt was rolled out twice")
    assert r["verdict"][-1].startswith("bottom line: the prompt stage would mostly thin the batch: it cuts the "
                                       "all-equal share by only 0 points")


def test_a_coin_flip_log_gives_no_separation(tmp_path):
    """20 prompts at success rate 0.5 with G = 2, 40 steps: half the groups all-equal, whatever came before."""
    rng = random.Random(7)
    steps = [[(f"p{i}", [float(rng.random() < 0.5) for _ in range(2)], [5, 5]) for i in range(20)]
             for _ in range(40)]
    r = advise(write_run(tmp_path / "run", steps))
    p, ps = r["persistence"], r["prompt_stage"]
    assert abs(p["p_equal_after_equal"] - p["p_equal_after_mixed"]) < 0.06
    assert abs(ps["auc_seen"] - 0.5) < 0.04 and abs(ps["auc_all"] - 0.5) < 0.04
    # the same replay written out independently: discounted evidence, the moments' formula, AUC over every pair
    evidence: dict[str, tuple[float, float, int]] = {}
    scored = []
    for step, groups in enumerate(steps, start=1):
        for pid, rewards, _ in groups:
            if pid in evidence:
                s, f, at = evidence[pid]
                scored.append((p_informative(s * 0.5 ** ((step - at) / HALF_LIFE),
                                             f * 0.5 ** ((step - at) / HALF_LIFE), 2), rewards[0] != rewards[1]))
        for pid, rewards, _ in groups:
            s, f, at = evidence.get(pid, (0.0, 0.0, step))
            d = 0.5 ** ((step - at) / HALF_LIFE)
            evidence[pid] = (s * d + sum(rewards), f * d + 2 - sum(rewards), step)
    pos = [x for x, y in scored if y]
    neg = [x for x, y in scored if not y]
    by_pairs = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    assert ps["groups_seen"] == len(scored) == 780
    assert ps["auc_seen"] == pytest.approx(by_pairs, abs=2e-4)
    assert abs(ps["all_equal_share_rolled_out"] - ps["all_equal_share_logged"]) < 0.01
    assert "it sees little" in r["verdict"][1]


def test_auc_against_every_pair():
    rng = random.Random(3)
    scores = [rng.choice([0.1, 0.2, 0.3, 0.4]) for _ in range(60)]
    labels = [rng.random() < 0.4 for _ in range(60)]
    pairs = [(s, t) for s, y in zip(scores, labels, strict=True) if y
             for t, z in zip(scores, labels, strict=True) if not z]
    assert auc(scores, labels) == pytest.approx(sum((s > t) + 0.5 * (s == t) for s, t in pairs) / len(pairs))
    assert auc([0.3, 0.1], [True, False]) == 1.0 and auc([0.1, 0.3], [True, False]) == 0.0
    assert auc([1.0, 2.0], [True, True]) is None


# --------------------------------------------------------------------------------------------------
# Rewards outside [0, 1], a KL term, the ceiling
# --------------------------------------------------------------------------------------------------


def test_rewards_outside_the_unit_interval_skip_only_the_posterior(tmp_path):
    steps = [[("A", [2, 2, 2, 2], [2] * 4), ("C", [2, -1, 2, -1], [1, 3, 5, 7])]] * 3
    r = advise(write_run(tmp_path / "run", steps))
    assert r["prompt_stage"] == {"why_not": "rewards run from -1 to 2, outside [0, 1]: the posterior reads them as "
                                            "pass rates and does not apply (prompt_scheme paper or proportional, "
                                            "which read only |A|, would; not replayed here)"}
    assert r["completion_stage"]["all_equal_token_share"] == round(24 / 72, 4)
    assert r["completion_stage"]["dppo_trained_share_of_informative"] == 0.5
    assert r["persistence"]["p_equal_after_equal"] == 1.0
    assert r["verdict"][-1] == "bottom line: only the completion stage and the ceiling apply to these rewards"
    assert "does not apply" in format_advice(r)


def test_a_kl_term_keeps_all_equal_groups_in_the_update(tmp_path):
    run = write_run(tmp_path / "run", [[SOLVED, MIXED]] * 2, config={"beta": 0.04, "scale_rewards": "group"})
    r = advise(run)
    assert r["settings"]["beta"] == 0.04 and r["settings"]["assumed"] == []
    cs = r["completion_stage"]
    # with beta > 0 A's completions (A = 0) keep a loss: each is kept with 1 - 0.5 (every score 0: spread evenly)
    assert cs["dppo_trained_share_of_generated"] == round((16 + 8) / 48, 4)
    assert "with a KL term (beta 0.04) all-equal groups still have a loss" in r["verdict"][3]


def test_the_ceiling_of_a_run_whose_times_follow_the_cost_model_exactly(tmp_path):
    c0, c_longest, c_tokens, u0, u1, other = 0.1, 0.01, 0.001, 0.05, 0.002, 0.02
    # per step: an all-equal group and an informative one, G = 2, of varying lengths
    shapes = [((30, 10), (5, 8)), ((6, 4), (20, 12)), ((40, 40), (9, 3)), ((7, 7), (15, 30)), ((25, 2), (4, 16)),
              ((3, 3), (11, 2))]
    steps, metrics, base, oracle = [], [], 0.0, 0.0
    for step, (equal, mixed) in enumerate(shapes, start=1):
        steps.append([(f"e{step}", [1, 1], list(equal)), (f"m{step}", [1, 0], list(mixed))])
        tokens, useful = sum(equal) + sum(mixed), sum(mixed)
        rollout = c0 + c_longest * max(*equal, *mixed) + c_tokens * tokens
        update = u0 + u1 * useful  # trains the informative group only, as grpo_skip does
        metrics.append({"step": step, "time_rollout": rollout, "time_update": update,
                        "step_time": rollout + update + other, "tokens_generated": tokens, "tokens_trained": useful})
        base += rollout + update + other
        oracle += c0 + c_longest * max(mixed) + c_tokens * useful + u0 + u1 * useful + other
    r = advise(write_run(tmp_path / "run", steps, metrics=metrics))
    ce = r["ceiling"]
    assert ce["speedup"] == round(base / oracle, 4) and ce["speedup"] > 1
    assert ce["rollout_fit"]["model"] == "decode-aware" and ce["rollout_fit"]["r2"] == 1.0
    assert ce["kappa"] == 1.0 and ce["update_fit"]["model"] == "affine"
    assert r["completion_stage"]["logged_trained_share"] == round(sum(m["tokens_trained"] for m in metrics)
                                                                 / sum(m["tokens_generated"] for m in metrics), 4)
    assert f"would take {base / oracle:.2f}x less training time (decode-aware rollout fit, R² 1.00)" in r["verdict"][4]


def test_the_ceiling_says_why_not_for_foreign_metrics(tmp_path):
    run = write_run(tmp_path / "run", [[SOLVED, MIXED]] * 2, metrics=[{"step": 1, "loss": 0.1}, {"step": 2}])
    assert advise(run)["ceiling"]["why_not"].startswith("metrics.jsonl has no step with step_time")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_time": 1.0, "time_rollout": 0.5}) + "\n")
    assert advise(run)["ceiling"]["why_not"] == (
        "metrics.jsonl lacks time_update, tokens_generated, tokens_trained on some steps: the ceiling needs "
        "time_rollout, time_update, step_time, tokens_generated, tokens_trained per step")


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def test_the_command_prints_words_and_json(tmp_path, capsys):
    run = write_run(tmp_path / "run", _persistent_steps())
    assert main(["advise", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"would DPPO help {run}? 6 steps, 24 groups of G = 4, 4 prompts; rewards from 0 to 1\n- "
                          "history sees P(all-equal | previous all-equal) = 1.00")
    assert "\nassumptions:\n- the replay observes every logged group in order" in out
    assert main(["advise", str(run / "groups.jsonl"), "--json", "--prompt-prune-rate", "0.25"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == advise(run / "groups.jsonl", prompt_prune_rate=0.25)
    assert report["prompt_stage"]["prompt_share_rolled_out"] == 0.75


@pytest.mark.parametrize("case", ["missing", "no log", "empty log", "bad line", "rate"])
def test_bad_inputs_are_one_line(tmp_path, capsys, case):
    run = tmp_path / "run"
    argv = ["advise", str(run)]
    if case == "no log":
        run.mkdir()
    elif case == "empty log":
        run.mkdir()
        (run / "groups.jsonl").write_text("")
    elif case == "bad line":
        run.mkdir()
        (run / "groups.jsonl").write_text(json.dumps({"step": 1, "ids": ["a", "b"], "rewards": [[1, 0]]}) + "\n")
    elif case == "rate":
        write_run(run, [[SOLVED, MIXED]])
        argv += ["--prompt-prune-rate", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    expected = {
        "missing": f"error: {run} does not exist; pass a run's output directory, the one holding groups.jsonl",
        "no log": f"error: {run} has no groups.jsonl; dppo train and dppo bench write one per run",
        "empty log": f"error: {run / 'groups.jsonl'} holds no group: pass the log of a run",
        "bad line": f"error: {run / 'groups.jsonl'}: the line of step 1 is not a group record (no lengths); each line "
                    "needs step, ids, pi, rewards and lengths",
        "rate": "error: --prompt-prune-rate 1.0: a prune rate is the expected share pruned, in [0, 1), e.g. 0.5",
    }[case]
    assert err.startswith(expected), err
    with pytest.raises(AdviseError):
        advise(run, prompt_prune_rate=1.0)


def test_python_m_dppo_core_advise_runs_as_a_command(tmp_path):
    run = write_run(tmp_path / "run", [[SOLVED, MIXED]] * 2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "dppo_core", "advise", str(run), "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prompt_stage"]["auc_seen"] == 1.0
