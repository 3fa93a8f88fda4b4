"""Chapter 05 exercises, solved and checked: predict the expected kept count, a maximum age for the
history, what GRESO needs to become unbiased, and a prior for the posterior fitted to the pool.

Run: python dppo_core/assets/course/solutions/ch05_prompt_pruning.py   (seconds, no model: the histories are
built from synthetic rewards; tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from dppo_core.grpo import group_advantages
from dppo_core.posterior import beta_binomial_pmf, posterior_scores
from dppo_core.pruning import PromptHistory, greso_keep_probs, prompt_keep_probs, sample_keep

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Unseen prompts are always kept; re-read section 4 for which seen prompts each scheme lowers (in the "
        "proportional one, score-0 prompts stay at the floor)."),
    2: ("A record is stale only when step - record.step exceeds max_age (equal is still fresh); build a new "
        "PromptHistory rather than editing the old one."),
    3: ("The repaired estimate weights each kept x by 1 / pi and divides by the number of candidates, a "
        "constant, never by the number kept."),
    4: ("P(informative) is one minus the pmf's mass at 0 and at g passes; fit on the summed log-likelihood "
        "of all the counts, over a grid that reaches below 1."),
}

G = 8


def synthetic_history(n_seen: int = 30, seed: int = 0, step: int = 0):
    """A history of n_seen prompts whose last group of G had success rates spread over [0, 1] (some
    all-equal)."""
    gen = torch.Generator().manual_seed(seed)
    success = torch.rand(n_seen, 1, generator=gen) ** 2 * 1.4 - 0.2                  # some < 0 and > 1:
                                                                                     # all-equal
    rewards = (torch.rand(n_seen, G, generator=gen) < success).float()               # (n_seen, G)
    ids = [f"q{i}" for i in range(n_seen)]
    history = PromptHistory()
    history.update(ids, rewards, group_advantages(rewards), step=step)
    return history, ids, rewards


# --------------------------------------------------------------------------------------------------
# Exercise 1: change the prune rate and predict the expected number of prompts kept
# --------------------------------------------------------------------------------------------------

def predicted_kept(history: PromptHistory, ids: list[str], rate: float, scheme: str,
                   floor: float = 0.1) -> float:
    """E[kept] = sum of pi_q over the candidates ids, predicted from the counts alone (seen, unseen, score 0;
    history.score(pid) is None for an unseen prompt), without calling prompt_keep_probs."""
    scores = [history.score(pid) for pid in ids]
    n, unseen = len(ids), sum(s is None for s in scores)
    seen = n - unseen
    if rate == 0 or seen == 0:
        return float(n)
    if scheme == "paper":
        # the lower half of the seen prompts (rounded up) is kept with max(1 - r, floor)
        return n - math.ceil(seen / 2) * (1 - max(1 - rate, floor))
    # proportional: a budget of (1 - r) n, unseen prompts counted as kept; what the seen ones can reach is
    # between floor * seen (all on the floor) and positive + floor * zero (score-0 prompts never leave the
    # floor)
    zero = sum(s == 0 for s in scores)
    target = (1 - rate) * n - unseen
    return unseen + min(max(target, floor * seen), seen - zero + floor * zero)


def exercise_1(predicted_kept=predicted_kept) -> None:
    history, ids, rewards = synthetic_history()
    candidates = ids + [f"new{i}" for i in range(10)]                   # 30 seen, 10 never rolled out
    all_equal = int((rewards.std(1) == 0).sum())
    table = []
    for rate in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95):
        row = []
        for scheme in ("paper", "proportional"):
            ours = predicted_kept(history, candidates, rate, scheme)
            pi = prompt_keep_probs(history, candidates, rate, scheme=scheme)
            assert math.isclose(ours, pi.sum().item(), abs_tol=1e-9), (rate, scheme, ours, pi.sum().item())
            row.append(f"{ours:>9.2f}  {pi.sum().item():>7.2f}")
        table.append(f"{rate:>4.2f}   {row[0]}   {'':>13}{row[1]}")
    print(f"{len(ids)} seen prompts ({all_equal} all-equal last time) + 10 unseen")
    print("rate   paper: predicted  package   proportional: predicted  package", *table, sep="\n")
    # Then draw: coin flips keep E[kept] on average, the fixed-size design exactly floor or ceil of it.
    pi = prompt_keep_probs(history, candidates, 0.5, scheme="proportional")
    expected = pi.sum().item()
    bern = sample_keep(pi.expand(4000, -1), torch.Generator().manual_seed(0)).sum(1).double()
    assert abs(bern.mean().item() - expected) < 4 * bern.std().item() / 4000**0.5
    fixed = {int(sample_keep(pi, torch.Generator().manual_seed(d), fixed_size=True).sum())
             for d in range(500)}
    assert fixed <= {math.floor(expected), math.ceil(expected)}
    print(f"r = 0.5 proportional: E[kept] {expected:.2f}; Bernoulli draws {bern.mean().item():.2f} ± "
          f"{bern.std().item():.2f}; fixed-size draws keep {sorted(fixed)}")


# --------------------------------------------------------------------------------------------------
# Exercise 2: a maximum age for the history
# --------------------------------------------------------------------------------------------------

def fresh_history(history: PromptHistory, step: int, max_age: int) -> PromptHistory:
    """A copy of history without the records that are stale at ``step``: last updated more than max_age steps
    before it. Prompts whose record is dropped count as unseen (probability 1)."""
    return PromptHistory({pid: rec for pid, rec in history.records.items() if step - rec.step <= max_age})


def exercise_2(fresh_history=fresh_history) -> None:
    history, ids, _ = synthetic_history(step=0)
    rewards = torch.zeros(10, G)
    history.update(ids[:10], rewards, group_advantages(rewards), step=1)   # 10 seen again at step 1, 20 not
    for step, max_age in ((2, 0), (2, 1), (2, 2), (3, 1), (5, 10)):        # max_age = step - 0: still fresh
        for scheme in ("paper", "proportional"):
            package = prompt_keep_probs(history, ids, 0.5, scheme=scheme, step=step, max_age=max_age)
            ours = prompt_keep_probs(fresh_history(history, step, max_age), ids, 0.5, scheme=scheme)
            assert torch.allclose(ours, package), (step, max_age, scheme)
    stale = prompt_keep_probs(fresh_history(history, 2, 0), ids, 0.5)
    assert (stale == 1).all()  # records older than max_age count as unseen: every prompt kept for sure
    # Refresh half of the prompts at step 2: only those can be pruned now.
    rewards = torch.zeros(15, G)
    history.update(ids[:15], rewards, group_advantages(rewards), step=2)
    mixed = prompt_keep_probs(fresh_history(history, 2, 0), ids, 0.5)
    assert (mixed[15:] == 1).all() and (mixed[:15] < 1).any()
    print(f"max_age=0 at step 2: {int((stale == 1).sum())}/{len(ids)} prompts at pi = 1 (history too old); "
          f"after 15 are seen again at step 2, {int((mixed < 1).sum())} can be pruned")
    # Why it matters: a score describes the policy that produced it. A prompt the policy failed 20 steps ago
    # may be half-solved now; max_age stops pruning on evidence about a policy that no longer exists.


# --------------------------------------------------------------------------------------------------
# Exercise 3: GRESO with weights 1 / pi and a constant normaliser is unbiased
# --------------------------------------------------------------------------------------------------

def greso_estimate(keep: torch.Tensor, x: torch.Tensor) -> float:
    """GRESO's estimate of mean(x) from one draw: the plain mean of x over the kept prompts (keep: bools)."""
    return x[keep].mean().item()


def repaired_estimate(keep: torch.Tensor, pi: torch.Tensor, x: torch.Tensor) -> float:
    """The same draw, weighted: each kept prompt's x by 1 / pi, summed, divided by the number of
    candidates."""
    return (keep / pi * x).sum().item() / len(x)


def exercise_3(greso_estimate=greso_estimate, repaired_estimate=repaired_estimate) -> None:
    history, ids, rewards = synthetic_history(n_seen=12, seed=3)
    pi = greso_keep_probs(history, ids, 0.5)                      # 1 - r for last time's all-equal prompts,
                                                                  # else 1
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(len(ids), generator=gen, dtype=torch.float64)  # what each prompt gives *now*
    x[pi < 1] *= 0.3                                              # all-equal last time: gives less now,
                                                                  # not nothing
    target = x.mean().item()
    everything = torch.ones(len(ids), dtype=torch.bool)           # nothing pruned: both are the plain mean
    assert math.isclose(greso_estimate(everything, x), target, rel_tol=1e-12)
    assert math.isclose(repaired_estimate(everything, torch.ones_like(pi), x), target, rel_tol=1e-12)
    random_ids = (pi < 1).nonzero().flatten().tolist()
    e_greso = e_weighted = 0.0
    for bits in itertools.product([False, True], repeat=len(random_ids)):   # every draw, exactly
        keep = everything.clone()
        keep[random_ids] = torch.tensor(bits)
        prob = math.prod(pi[j].item() if b else 1 - pi[j].item()
                         for j, b in zip(random_ids, bits, strict=True))
        e_greso += prob * greso_estimate(keep, x)
        e_weighted += prob * repaired_estimate(keep, pi, x)
    print(f"{len(random_ids)} of {len(ids)} prompts skippable | target {target:.4f} | GRESO {e_greso:.4f} | "
          f"GRESO + 1/pi weights, / {len(ids)}: {e_weighted:.4f}")
    assert math.isclose(e_weighted, target, rel_tol=1e-12)
    assert e_greso - target > 0.01    # over-represents the prompts that were informative last time
    # What GRESO left out: the kept prompts do not stand in for the skipped ones. Weighting each kept prompt
    # by 1 / pi (and dividing by the candidate count, a constant) restores E[K_q / pi_q] = 1 for every prompt.


# --------------------------------------------------------------------------------------------------
# Exercise 4: an empirical-Bayes prior for the posterior
# --------------------------------------------------------------------------------------------------

def p_informative(a: float, b: float, g: int = G) -> float:
    """1 - E[p^G] - E[(1-p)^G] for p ~ Beta(a, b): the Beta-binomial's mass strictly between 0 and G
    passes."""
    pmf = beta_binomial_pmf(a, b, g)
    return float(1.0 - pmf[0] - pmf[-1])


def fit_prior(k: np.ndarray, g: int = G) -> tuple[float, float]:
    """(a, b) maximising the Beta-binomial likelihood of the pass counts k (one group of g per prompt), on a
    log grid: the prior that best explains the pool's first groups."""
    counts = np.bincount(k, minlength=g + 1)
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 121))
    best, arg = -np.inf, (1.0, 1.0)
    for a in grid:
        for b in grid:
            ll = float(counts @ np.log(beta_binomial_pmf(a, b, g) + 1e-300))
            if ll > best:
                best, arg = ll, (float(a), float(b))
    return arg


def exercise_4(p_informative=p_informative, fit_prior=fit_prior) -> None:
    n, true_prior = 2000, (0.4, 0.6)
    rng = np.random.default_rng(0)
    p = rng.beta(*true_prior, size=n)                   # each prompt's success rate (many near 0 or 1)
    k1, k2 = rng.binomial(G, p), rng.binomial(G, p)     # its first group and the next one (same policy)
    fitted = fit_prior(k1)
    print(f"true prior Beta{true_prior}, fitted from the first groups Beta({fitted[0]:.2f}, {fitted[1]:.2f})")
    assert abs(fitted[0] - true_prior[0]) < 0.1 and abs(fitted[1] - true_prior[1]) < 0.15

    # the package's scores are sqrt(P(informative)) under the prior + the evidence: check by hand, both priors
    history = PromptHistory()
    ids = [f"q{i}" for i in range(n)]
    rewards = torch.from_numpy((np.arange(G)[None, :] < k1[:, None]).astype(np.float32))
    history.update(ids, rewards, group_advantages(rewards), step=0)
    print("last group's passes k | share | informative next time: observed | uniform prior | fitted prior")
    predicted = {}
    for name, prior in (("uniform", (1.0, 1.0)), ("fitted", fitted)):
        pred = posterior_scores(history, ids, G, prior=prior).numpy() ** 2
        hand = np.array([p_informative(prior[0] + k, prior[1] + G - k) for k in k1])
        assert np.allclose(pred, hand, atol=1e-12)
        predicted[name] = pred
    informative = (k2 > 0) & (k2 < G)
    gaps = {"uniform": 0.0, "fitted": 0.0}
    for label, mask in (("0 (all wrong)", k1 == 0), ("1-7", (k1 > 0) & (k1 < G)), ("8 (all right)", k1 == G)):
        obs = informative[mask].mean()
        row = {name: predicted[name][mask].mean() for name in predicted}
        for name in gaps:
            gaps[name] += mask.mean() * abs(row[name] - obs)
        print(f"{label:>14} | {mask.mean():.2f} | {obs:.3f} | {row['uniform']:.3f} | {row['fitted']:.3f}")
    print(f"calibration error (weighted mean |predicted - observed|): uniform {gaps['uniform']:.3f}, "
          f"fitted {gaps['fitted']:.3f}")
    assert gaps["fitted"] < 0.5 * gaps["uniform"]
    # The uniform prior expects every prompt to be anywhere in [0, 1], so after one all-wrong group it still
    # gives the next group a ~47% chance of signal; a pool where most prompts sit near 0 or 1 says otherwise.
    # A prior fitted to the pool (empirical Bayes) calibrates the scores: the prompt stage then spends its
    # rollouts where the signal is. The trainer uses Beta(1, 1); posterior_scores(..., prior=) takes another.


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    exercise_4()
    print("chapter 05 solutions: all checks passed")


if __name__ == "__main__":
    main()
