"""Reward correctness and speed on the six benchmark sets' reference answers.

Made with (from the repository root, benchmark data at ../shared/data/benchmarks or $DPPO_DATA_DIR):

    .venv/bin/python benchmarks/reward_speed.py --output benchmarks/results/reward_speed.json

Measures, per set: how many reference answers verify against themselves through ``math_reward`` and
through the symbolic path alone; MATH-500 agreement between the boxed answer of each reference solution
and the final answer; and the time per call of ``math_reward``, of the numeric fast path and of the
symbolic path (math-verify, parse caches cleared before every call) on the same plain-number pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from dppo_core import rewards
from dppo_core.benchmark_data import BOX_INSTRUCTION, EVAL_SUITE, load_benchmark, read_jsonl
from dppo_core.grading import (
    DEFAULT_TIMEOUT,
    extract_answer,
    fast_equivalence,
    parse_number,
    symbolic,
    symbolic_equivalence,
)
from dppo_core.rewards import math_reward, math_rewards


def data_dir() -> Path:
    env = os.environ.get("DPPO_DATA_DIR")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks"
    if not d.is_dir():
        sys.exit(f"benchmark data not found at {d}; set DPPO_DATA_DIR")
    return d


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def symbolic_uncached(pred: str, gold: str):
    symbolic._parse.cache_clear()
    return timed(symbolic_equivalence, pred, gold)


def summary(seconds: list[float]) -> dict:
    s = sorted(seconds)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"n": len(s), "median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * q(0.9),
            "p99_ms": 1e3 * q(0.99), "max_ms": 1e3 * s[-1], "mean_ms": 1e3 * statistics.fmean(s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/reward_speed.json"))
    args = parser.parse_args()
    root = data_dir()
    suite = {name: load_benchmark(name, data_dir=root) for name in EVAL_SUITE}

    # 1. self-verification: through math_reward, and through the symbolic path alone
    selfcheck, call_times, symbolic_times = {}, [], []
    for name, records in suite.items():
        ok = ok_symbolic = 0
        misses = []
        for r in records:
            x, dt = timed(math_reward, f"So the final answer is \\boxed{{{r.answer}}}.", r.answer)
            call_times.append(dt)
            ok += x == 1.0
            y, dt = symbolic_uncached(r.answer, r.answer)
            symbolic_times.append(dt)
            ok_symbolic += y
            if not y:
                misses.append(r.answer)
        selfcheck[name] = {"problems": len(records), "math_reward": ok, "symbolic_only": ok_symbolic,
                           "symbolic_misses": misses}
        print(f"{name:<14} {len(records):>5} problems  self-verified {ok}  (symbolic path alone {ok_symbolic})")

    # 2. MATH-500: boxed answer of each reference solution vs the final answer
    solutions = {s.problem.strip(): s for s in read_jsonl(root / "math500_solutions.jsonl")}
    pairs = [(solutions[t.problem.replace(BOX_INSTRUCTION, "").strip()], t) for t in suite["math500"]]
    agree = [math_reward(s.solution, t.answer) for s, t in pairs]
    agree_symbolic = [symbolic_equivalence(extract_answer(s.solution), t.answer) for s, t in pairs]
    math500 = {
        "problems": len(pairs),
        "agreement": sum(agree) / len(pairs),
        "agreement_symbolic_only": sum(agree_symbolic) / len(pairs),
        "misses": [{"id": t.id, "extracted": extract_answer(s.solution), "answer": t.answer}
                   for (s, t), x in zip(pairs, agree, strict=True) if x != 1.0],
    }
    print(f"MATH-500 agreement {math500['agreement']:.3f} (symbolic path alone "
          f"{math500['agreement_symbolic_only']:.3f}), misses: {math500['misses']}")
    gsm = suite["gsm8k"]
    gsm_ok = sum(math_rewards([r.solution for r in gsm], [r.answer for r in gsm]))
    print(f"GSM8K reference solutions scoring 1.0: {gsm_ok:.0f}/{len(gsm)}")

    # 3. fast path vs symbolic path on the same plain-number pairs: a right answer written differently
    #    ("18.0" for "18") and a wrong one (off by one), so the string check cannot decide either
    numeric_pairs = []
    for records in suite.values():
        for r in records:
            v = parse_number(r.answer)
            if v is not None and v.denominator == 1 and abs(v) < 10**15 and r.answer.lstrip("-").isdigit():
                numeric_pairs += [(f"{v}.0", r.answer), (str(v + 1), r.answer)]
    fast_times, slow_times, disagreements = [], [], []
    for pred, gold in numeric_pairs:
        completion = f"So the final answer is \\boxed{{{pred}}}."
        fast, dt_fast = timed(math_reward, completion, gold)
        slow, dt_slow = symbolic_uncached(pred, gold)
        fast_times.append(dt_fast)
        slow_times.append(dt_slow)
        assert fast_equivalence(pred, gold) is not None
        if fast != float(slow):
            disagreements.append({"pred": pred, "gold": gold, "fast": fast, "symbolic": slow})
    ratio = statistics.median(slow_times) / statistics.median(fast_times)
    print(f"plain numbers ({len(numeric_pairs)} pairs): math_reward (fast path) median "
          f"{1e6 * statistics.median(fast_times):.1f} us, symbolic path median "
          f"{1e3 * statistics.median(slow_times):.2f} ms, ratio {ratio:.0f}x, disagreements {len(disagreements)}")

    # 4. batch throughput on symbolic pairs (wrong sign of each MATH-500 answer that is not a number)
    hard = [r.answer for r in suite["math500"] + suite["olympiadbench"] if parse_number(r.answer) is None]
    completions = [f"\\boxed{{-({a})}}" for a in hard]
    batch = {}
    for workers in (1, rewards.default_num_workers()):
        symbolic._parse.cache_clear()
        math_rewards(completions[:4], hard[:4], num_workers=workers, min_parallel=1)  # start the workers
        symbolic._parse.cache_clear()
        _, dt = timed(math_rewards, completions, hard, num_workers=workers, min_parallel=1)
        batch[f"workers={workers}"] = {"completions": len(hard), "seconds": dt,
                                       "per_completion_ms": 1e3 * dt / len(hard)}
        print(f"batch of {len(hard)} symbolic checks with {workers} worker(s): {dt:.1f} s")

    result = {
        "command": "python benchmarks/reward_speed.py --output benchmarks/results/reward_speed.json",
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                    "cpus": rewards.default_num_workers()},
        "timeout_s": DEFAULT_TIMEOUT,
        "self_verification": selfcheck,
        "math500_solutions": math500,
        "gsm8k_solutions": {"problems": len(gsm), "score_1": int(gsm_ok)},
        "math_reward_on_reference_answers": summary(call_times),
        "symbolic_path_on_reference_answers": summary(symbolic_times),
        "plain_numbers": {"pairs": len(numeric_pairs), "fast_path": summary(fast_times),
                          "symbolic_path": summary(slow_times), "median_ratio": ratio,
                          "disagreements": disagreements},
        "batch": batch,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
