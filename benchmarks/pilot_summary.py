"""Pilot, then continue, in training: ``dppo_pilot`` against ``dppo`` from one bench's runs (issue #51's comparison).

    python benchmarks/pilot_summary.py benchmarks/results/pilot/realistic

Reads ``DIR/bench.json`` (``dppo bench`` with ``dppo``, ``dppo_pilot`` and a reference among its methods) and each
run's ``groups.jsonl`` and ``metrics.jsonl``, and writes ``DIR/pilot_summary.json``:

- ``pilot_vs_dppo``: time-to-target speedups of ``dppo_pilot`` over ``dppo`` (targets 90% and 95% of ``dppo``'s
  final sampled accuracy, paired per seed, bootstrap intervals: the bench's own
  :func:`dppo_core.tools.bench.summary.speedups_vs`);
- per method, summed over seeds: tokens generated, decode steps (one engine call's longest completion per step, a
  pilot's two calls'), rollout seconds and seconds per thousand generated tokens and per decode step, update seconds,
  tokens trained, and from the group logs the groups rolled out, the share of the trained groups that were all equal
  and, for the pilot, the share of groups stopped after their pilot;
- the final accuracy's mean and spread over seeds (from ``bench.json``).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from dppo_core.grouplog import informative, read_groups, read_records
from dppo_core.tools.bench.summary import speedups_vs


def method_stats(root: Path, method: str, seeds: list[int]) -> dict:
    tokens = decode = trained = groups = equal = stopped = 0
    rollout = update = 0.0
    for seed in seeds:
        run = root / "runs" / method / f"seed-{seed}"
        steps = [m for m in read_records(run / "metrics.jsonl") if "loss" in m]
        tokens += sum(m["tokens_generated"] for m in steps)
        decode += sum(m.get("decode_steps", m.get("completion_length_max")) or 0 for m in steps)
        trained += sum(m["tokens_trained"] for m in steps)
        rollout += sum(m.get("time_rollout", 0.0) for m in steps)  # a step whose groups all stopped: not logged
        update += sum(m.get("time_update", 0.0) for m in steps)
        for line in read_groups(run):
            groups += len(line["rewards"]) + len(line.get("stopped", {}).get("ids", []))
            equal += sum(not informative(r) for r in line["rewards"])
            stopped += len(line.get("stopped", {}).get("ids", []))
    trained_groups = groups - stopped
    return {"tokens_generated": tokens, "decode_steps": decode, "rollout_s": round(rollout, 2),
            "rollout_ms_per_1k_tokens": round(1e6 * rollout / tokens, 2),
            "rollout_ms_per_decode_step": round(1e3 * rollout / decode, 2), "update_s": round(update, 2),
            "tokens_trained": trained, "groups_rolled_out": groups, "groups_stopped_share": round(stopped / groups, 4),
            "trained_groups_all_equal_share": round(equal / max(1, trained_groups), 4)}


def main() -> int:
    root = Path(sys.argv[1])
    bench = json.loads((root / "bench.json").read_text())
    runs: dict[str, list] = {}
    for r in bench["runs"]:
        runs.setdefault(r["method"], []).append(r)
    seeds = sorted(bench["seeds"])
    out = {"command": "python benchmarks/pilot_summary.py " + " ".join(sys.argv[1:]), "bench": bench["command"],
           "machine": bench["machine"], "seeds": seeds,
           "pilot_vs_dppo": speedups_vs({m: runs[m] for m in ("dppo", "dppo_pilot")}, "dppo")["dppo_pilot"],
           "methods": {}}
    for method, rs in runs.items():
        finals = [r["accuracy"]["after"] for r in rs]
        out["methods"][method] = {**method_stats(root, method, seeds),
                                  "final_accuracy_mean": round(statistics.mean(finals), 4),
                                  "final_accuracy_sd": round(statistics.stdev(finals), 4) if len(finals) > 1 else None}
    (root / "pilot_summary.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
