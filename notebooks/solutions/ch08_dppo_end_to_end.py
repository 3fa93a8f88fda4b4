"""Chapter 08 exercises, solved and checked: time to target, Amdahl's law for completion pruning, and why
the measured speedup can beat the token-cost bound.

Run: python notebooks/solutions/ch08_dppo_end_to_end.py
(under a second, no model; tests/test_solutions.py runs it too)
"""

from __future__ import annotations

import math

from dppo_core.bench import compare, time_to_target, token_cost_bound

# --------------------------------------------------------------------------------------------------
# Exercise 1: time to target
# --------------------------------------------------------------------------------------------------


def my_time_to_target(curve, target):
    """Training time of the first evaluation with sampled accuracy >= target; None if there is none."""
    for point in curve:
        if point.get("sampled_accuracy") is not None and point["sampled_accuracy"] >= target:
            return point["train_s"]
    return None


def exercise_1() -> None:
    curve = [{"step": 0, "train_s": 0.0, "sampled_accuracy": 0.40},
             {"step": 10, "train_s": 50.0, "sampled_accuracy": 0.52},
             {"step": 20, "train_s": 101.0, "sampled_accuracy": 0.49},   # noise: dips below again
             {"step": 30, "train_s": 150.0, "sampled_accuracy": 0.58}]
    for target in (0.3, 0.5, 0.55, 0.6):
        assert my_time_to_target(curve, target) == time_to_target(curve, target)
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


def exercise_2() -> None:
    # grpo: 100 s of training = 40 s rollout + 2 s reward + 50 s update + 8 s fixed, on 10,000 tokens
    grpo = _method(100.0, 10_000, 10_000, rollout=40.0, reward=2.0, update=50.0)
    u = 50.0 / 100.0                                     # the update's share of grpo's time
    for k in (1.0, 0.5, 0.25, 0.0):
        predicted = 1.0 / (1.0 - u + u * k)              # Amdahl: only the update share shrinks, by k
        method = _method(0.0, 10_000, round(10_000 * k))
        assert math.isclose(token_cost_bound(grpo, method), predicted, rel_tol=1e-9)
    limit = 1.0 / (1.0 - u)
    print(f"training on a fraction k of the tokens: bound 1 / (1 - u + u k), at most {limit:.1f}x as k -> 0 "
          f"(u = update share = {u:.2f}); beyond that only rollout pruning helps")


# --------------------------------------------------------------------------------------------------
# Exercise 3: beating the bound
# --------------------------------------------------------------------------------------------------


def exercise_3() -> None:
    grpo = _method(100.0, 10_000, 10_000, rollout=40.0, reward=2.0, update=50.0)
    grpo["tokens"]["row_capacity"] = 16_000              # padded micro-batches: 0.62 dense
    padded = _method(75.0, 10_000, 5_000, rollout=40.0, reward=2.0, update=25.0)
    padded["tokens"]["row_capacity"] = 8_000             # same density as grpo: each token costs the same
    packed = _method(62.0, 10_000, 5_000, rollout=40.0, reward=2.0, update=12.0)
    packed["tokens"]["row_capacity"] = 5_300             # dense rows: fewer slots paid per trained token
    result = compare({"grpo": grpo, "padded": padded, "packed": packed})
    bound = result["token_cost_bound"]
    assert math.isclose(bound["padded"], bound["packed"])           # same tokens: same bound
    assert math.isclose(result["fraction_of_bound"]["padded"], 1.0)  # token saving became time, no more
    assert result["fraction_of_bound"]["packed"] > 1.0               # each trained token got cheaper
    density = {n: m["tokens"]["trained"] / m["tokens"]["row_capacity"] for n, m in
               {"grpo": grpo, "padded": padded, "packed": packed}.items()}
    assert density["packed"] > density["padded"]
    print(f"bound {bound['packed']:.2f} for both; fraction of bound: padded "
          f"{result['fraction_of_bound']['padded']:.2f}, packed {result['fraction_of_bound']['packed']:.2f} "
          f"(density {density['padded']:.2f} vs {density['packed']:.2f})")


def main() -> None:
    exercise_1()
    exercise_2()
    exercise_3()
    print("chapter 08 solutions: all checks passed")


if __name__ == "__main__":
    main()
