"""Chapter 08 exercises, solved and checked: time to target, Amdahl's law for completion pruning, and why
the measured speedup can beat the token-cost bound.

Run: python notebooks/solutions/ch08_dppo_end_to_end.py
(under a second, no model; tests/test_solutions.py runs it too)
"""

from __future__ import annotations

import math
import random

from dppo_core.bench import compare, time_to_target, token_cost_bound
from dppo_core.packing import PackSequence, pack, pad, plan_rows

# --------------------------------------------------------------------------------------------------
# Exercise 1: time to target
# --------------------------------------------------------------------------------------------------


def my_time_to_target(curve, target):
    """Training time of the first evaluation with sampled accuracy >= target; None if there is none."""
    for point in curve:
        if point.get("sampled_accuracy") is not None and point["sampled_accuracy"] >= target:
            return point["train_s"]
    return None


def exercise_1(my_time_to_target=my_time_to_target) -> None:
    curve = [{"step": 0, "train_s": 0.0, "sampled_accuracy": 0.40},
             {"step": 10, "train_s": 50.0, "sampled_accuracy": 0.52},
             {"step": 20, "train_s": 101.0, "sampled_accuracy": 0.49},   # noise: dips below again
             {"step": 30, "train_s": 150.0, "sampled_accuracy": 0.58}]
    for target in (0.3, 0.4, 0.5, 0.52, 0.55, 0.58, 0.6):
        assert my_time_to_target(curve, target) == time_to_target(curve, target)
    assert my_time_to_target(curve, 0.4) == 0.0         # reached at the start: time 0, not None
    assert my_time_to_target(curve, 0.52) == 50.0       # "at or above": equality counts
    gap = [{"step": 0, "train_s": 0.0, "sampled_accuracy": None},   # an evaluation that did not run
           {"step": 10, "train_s": 40.0, "sampled_accuracy": 0.7}]
    assert my_time_to_target(gap, 0.5) == time_to_target(gap, 0.5) == 40.0
    assert my_time_to_target(curve, 0.5) == 50.0        # the first crossing counts, not the last
    assert my_time_to_target(curve, 0.6) is None        # never reached: no time (not infinity, not the end)
    print("time to target: first crossing 50 s for 0.5; None for 0.6")


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
    # grpo: 100 s of training = rollout + 2 s reward + update + 8 s fixed, on 10,000 tokens; the update's share
    # u of the time varies, and the method trains a fraction k of the tokens
    for update in (20.0, 50.0, 80.0):
        grpo = _method(100.0, 10_000, 10_000, rollout=90.0 - update, reward=2.0, update=update)
        u = update / 100.0
        for k in (1.0, 0.5, 0.25, 0.1, 0.0):
            method = _method(0.0, 10_000, round(10_000 * k))
            assert math.isclose(amdahl_bound(u, k), token_cost_bound(grpo, method), rel_tol=1e-9)
    u = 0.45                                            # about the update's share of a step in section 4's runs
    assert math.isclose(amdahl_bound(u, 0.0), 1.0 / (1.0 - u))   # the limit as k -> 0
    print(f"training on a fraction k of the tokens: bound 1 / (1 - u + u k), at most {amdahl_bound(u, 0.0):.2f}x "
          f"as k -> 0 when the update is {u:.0%} of the time; beyond that only rollout pruning helps")


# --------------------------------------------------------------------------------------------------
# Exercise 3: beating the bound
# --------------------------------------------------------------------------------------------------


def slots(lengths: list[int], layout: str, *, micro_batch: int = 64, budget: int = 128,
          window: int = 16) -> int:
    """Token slots one update pays for (rows x width, summed over its forwards) for sequences of ``lengths``.

    ``"padded"``: one sequence per row, micro-batches of ``micro_batch`` sequences in the given order, each as
    wide as its longest sequence. ``"packed"``: ``plan_rows(lengths, budget, window)`` rows in one batch, as wide
    as its longest row.
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
    # A cost model: rollout and reward per generated token, the update per token SLOT it pays for, a fixed part.
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
        # the bound prices a trained token at grpo's slots per token; a denser layout pays fewer, a sparser more
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
