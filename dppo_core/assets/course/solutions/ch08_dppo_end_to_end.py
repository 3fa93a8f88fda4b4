"""Chapter 08 exercises, solved and checked: the time to target interpolated between evaluations, Amdahl's law
for completion pruning, and why the measured speedup can beat the token-cost bound.

Run: python dppo_core/assets/course/solutions/ch08_dppo_end_to_end.py
(under a second, no model; tests/course/test_solutions.py runs it too)
"""

from __future__ import annotations

import math
import random

from dppo_core.packing import PackSequence, pack, pad, plan_rows
from dppo_core.tools.bench import compare, time_to_target, token_cost_bound

# What check() prints under a failed verdict, one sentence per exercise: the mistake to look for first.
HINTS: dict[int, str] = {
    1: ("Interpolate from the last evaluation below the target, skip accuracies that are None, and return "
        "None, not the last time, if none reaches it."),
    2: ("The bound is GRPO's time over the method's: the 1 - u that pruning does not touch stays, and only "
        "the update's share u shrinks, by the factor k."),
    3: ("Padded pays, per chunk of 64 sequences in order, its size times its longest sequence; packed pays "
        "the rows times the longest row, not the budget."),
}

# --------------------------------------------------------------------------------------------------
# Exercise 1: time to target, between the evaluations
# --------------------------------------------------------------------------------------------------


def my_crossing_time(curve, target):
    """Training time at which the accuracy first reaches ``target``, interpolated linearly between the last
    evaluation below it and the first at or above it (that one's time if it is the first evaluation); None if
    no evaluation reaches it. Evaluations whose accuracy is None are skipped."""
    prev = None
    for point in curve:
        acc = point.get("sampled_accuracy")
        if acc is None:
            continue
        if acc >= target:
            if prev is None:
                return point["train_s"]
            t0, a0 = prev
            return t0 + (target - a0) / (acc - a0) * (point["train_s"] - t0)
        prev = (point["train_s"], acc)
    return None


def first_evaluation_at_or_above(curve, target):
    """§3's coarse time to target: the time of the first evaluation at or above ``target`` (None if none is),
    resolved to the evaluation cadence."""
    return next((p["train_s"] for p in curve
                 if p["sampled_accuracy"] is not None and p["sampled_accuracy"] >= target),
                None)


def _evaluated(times, accuracy):
    return [{"step": 10 * k, "train_s": t, "sampled_accuracy": accuracy(t)} for k, t in enumerate(times)]


def exercise_1(my_crossing_time=my_crossing_time) -> None:
    # a curve that is exactly linear between its evaluations: acc(t) = 0.4 + 0.002 t, evaluated at uneven
    # times; the true crossing of a target a is (a - 0.4) / 0.002, wherever the evaluations fall
    times = [0.0, 37.0, 81.0, 120.0, 166.0]
    line = _evaluated(times, lambda t: 0.4 + 0.002 * t)
    for target in (0.45, 0.5, 0.55, 0.6, 0.7):
        exact = (target - 0.4) / 0.002
        assert math.isclose(my_crossing_time(line, target), exact, rel_tol=1e-9, abs_tol=1e-9)
    assert my_crossing_time(line, 0.4) == 0.0              # reached at the first evaluation: its time
    assert my_crossing_time(line, 0.8) is None             # never reached (0.732 at the end):
                                                           # None, not the end
    # a curve that crosses, dips below again and crosses once more: the first crossing counts
    dip = [{"step": 0, "train_s": 0.0, "sampled_accuracy": 0.40},
           {"step": 10, "train_s": 50.0, "sampled_accuracy": 0.60},
           {"step": 20, "train_s": 101.0, "sampled_accuracy": 0.45},
           {"step": 30, "train_s": 150.0, "sampled_accuracy": 0.70}]
    assert math.isclose(my_crossing_time(dip, 0.5), 25.0)  # halfway from 0.40 at 0 s to 0.60 at 50 s
    assert math.isclose(my_crossing_time(dip, 0.65), 101.0 + 0.8 * 49.0)   # only the second rise reaches 0.65
    # an evaluation that did not run is skipped: interpolate across the gap
    gap = [{"step": 0, "train_s": 0.0, "sampled_accuracy": 0.30},
           {"step": 10, "train_s": 40.0, "sampled_accuracy": None},
           {"step": 20, "train_s": 80.0, "sampled_accuracy": 0.70}]
    assert math.isclose(my_crossing_time(gap, 0.5), 40.0)
    # against the package's time_to_target (the same interpolated crossing), and next to the coarse first
    # evaluation at or above the target: never later, equal when an evaluation lands exactly on the target
    # (or the first one already reaches it), None together
    rng = random.Random(0)
    for _ in range(200):
        t, acc, curve = 0.0, rng.uniform(0.2, 0.5), []
        for k in range(rng.randint(1, 8)):
            curve.append({"step": 10 * k, "train_s": t,
                          "sampled_accuracy": None if rng.random() < 0.1 else acc})
            t, acc = t + rng.uniform(5.0, 60.0), min(1.0, max(0.0, acc + rng.uniform(-0.08, 0.15)))
        for target in (rng.uniform(0.2, 0.9),
                       *(p["sampled_accuracy"] for p in curve if p["sampled_accuracy"])):
            mine, coarse = my_crossing_time(curve, target), first_evaluation_at_or_above(curve, target)
            theirs = time_to_target(curve, target)
            assert (mine is None) == (theirs is None) == (coarse is None)
            if mine is not None:
                assert math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-9)
                assert mine <= coarse + 1e-9
    print(f"crossing 0.5 at {my_crossing_time(dip, 0.5):.1f} s by interpolation; the first evaluation at or "
          f"above it says {first_evaluation_at_or_above(dip, 0.5):.0f} s (the package's time_to_target: "
          f"{time_to_target(dip, 0.5):.1f} s)")


# --------------------------------------------------------------------------------------------------
# Exercise 2: Amdahl's law for completion pruning
# --------------------------------------------------------------------------------------------------


def _method(wall, generated, trained, rollout=0.0, reward=0.0, update=0.0):
    return {"wall_s": wall, "tokens": {"generated": generated, "trained": trained, "row_capacity": trained},
            "phase_s": {"rollout": rollout, "reward": reward, "prune": 0.0, "pack": 0.0, "update": update,
                        "sync": 0.0},
            "step_time_s": {"median": wall / 10}, "time_to_target_s": None}


def amdahl_bound(u: float, k: float) -> float:
    """The token-cost bound of a method that generates every token but trains a fraction k of them, when the
    update is a share u of GRPO's training time: only that share shrinks, by k."""
    return 1.0 / (1.0 - u + u * k)


def exercise_2(amdahl_bound=amdahl_bound) -> None:
    # grpo: 100 s of training = rollout + 2 s reward + update + 8 s fixed, on 10,000 tokens; the update's
    # share u of the time varies, and the method trains a fraction k of the tokens
    for update in (20.0, 50.0, 80.0):
        grpo = _method(100.0, 10_000, 10_000, rollout=90.0 - update, reward=2.0, update=update)
        u = update / 100.0
        for k in (1.0, 0.5, 0.25, 0.1, 0.0):
            method = _method(0.0, 10_000, round(10_000 * k))
            assert math.isclose(amdahl_bound(u, k), token_cost_bound(grpo, method), rel_tol=1e-9)
    u = 0.45  # about the update's share of a step in section 4's runs
    assert math.isclose(amdahl_bound(u, 0.0), 1.0 / (1.0 - u))   # the limit as k -> 0
    print("training on a fraction k of the tokens: bound 1 / (1 - u + u k), at most "
          f"{amdahl_bound(u, 0.0):.2f}x as k -> 0 when the update is {u:.0%} of the time; beyond that only "
          "rollout pruning helps")


# --------------------------------------------------------------------------------------------------
# Exercise 3: beating the bound
# --------------------------------------------------------------------------------------------------


def slots(lengths: list[int], layout: str, *, micro_batch: int = 64, budget: int = 128,
          window: int = 16) -> int:
    """Token slots one update pays for (rows x width, summed over its forwards) for sequences of ``lengths``.

    ``"padded"``: one sequence per row, micro-batches of ``micro_batch`` sequences in the given order, each as
    wide as its longest sequence. ``"packed"``: ``plan_rows(lengths, budget, window)`` rows in one batch, as
    wide as its longest row.
    """
    if layout == "padded":
        chunks = [lengths[j : j + micro_batch] for j in range(0, len(lengths), micro_batch)]
        return sum(len(c) * max(c) for c in chunks)
    rows = plan_rows(lengths, budget, window)
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def exercise_3(slots=slots) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(25, 28) + min(63, 6 + int(rng.expovariate(1 / 14))) for _ in range(256)]
    seqs = [PackSequence([1] * 8, [1] * (n - 8)) for n in lengths]
    kept = sorted(rng.sample(range(256), 96))            # a method that trains 96 of the 256 sequences
    kept_lengths = [lengths[i] for i in kept]
    # the student's slot counts against the package's layouts
    assert slots(lengths, "padded") == sum(pad(seqs[j : j + 64]).capacity for j in range(0, 256, 64))
    assert slots(kept_lengths, "padded") == sum(pad([seqs[i] for i in kept[j : j + 64]]).capacity
                                                for j in range(0, 96, 64))
    assert slots(kept_lengths, "packed") == pack([seqs[i] for i in kept], 128, window=16).capacity
    # A cost model: rollout and reward per generated token, the update per token SLOT it pays for, a fixed
    # part.
    c_gen, c_slot, fixed = 2e-3, 1e-3, 5.0

    def run(trained: list[int], layout: str) -> dict:
        capacity = slots(trained, layout)
        m = _method(fixed + c_gen * sum(lengths) + c_slot * capacity, sum(lengths), sum(trained),
                    rollout=c_gen * sum(lengths), update=c_slot * capacity)
        m["tokens"]["row_capacity"] = capacity
        return m

    methods = {"grpo": run(lengths, "padded"), "padded": run(kept_lengths, "padded"),
               "packed": run(kept_lengths, "packed")}
    result = compare(methods)
    bound, fraction = result["token_cost_bound"], result["fraction_of_bound"]
    assert math.isclose(bound["padded"], bound["packed"])           # the same tokens: the same bound
    density = {n: m["tokens"]["trained"] / m["tokens"]["row_capacity"] for n, m in methods.items()}
    for name in ("padded", "packed"):
        # the bound prices a trained token at grpo's slots per token; a denser layout pays fewer, a sparser
        # more
        assert (fraction[name] > 1.0) == (density[name] > density["grpo"])
        # exactly: predicted time (a trained token at grpo's slots per token) over the time it took
        per_token = methods["grpo"]["tokens"]["row_capacity"] / sum(lengths)
        predicted = fixed + c_gen * sum(lengths) + c_slot * per_token * sum(kept_lengths)
        assert math.isclose(fraction[name], predicted / methods[name]["wall_s"], rel_tol=1e-9)
    assert fraction["packed"] > 1.0 and fraction["packed"] > fraction["padded"]
    print(f"bound {bound['packed']:.2f} for both; fraction of bound: padded {fraction['padded']:.2f}, packed "
          f"{fraction['packed']:.2f} (density grpo {density['grpo']:.2f}, padded {density['padded']:.2f}, "
          f"packed {density['packed']:.2f})")


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 08 solutions: all checks passed")


if __name__ == "__main__":
    main()
