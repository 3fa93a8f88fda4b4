"""Long-run soundness: a 200-step DPPO run (pruning and packing on) watched for memory growth and drift.

Made with (from the repository root, 2 CPU cores):

    .venv/bin/python benchmarks/soak.py --output benchmarks/results/soak

The run is ``dppo train --preset tiny-dppo`` with packing on and the vLLM engine (in-process, so this
process's memory includes the engine's), evaluating only at the start and the end. After every step
the script records the process's resident memory (current and peak); every ``--mismatch-every`` steps it
measures the engine's log-prob mismatch on that step's rollouts right after generation (the engine
synced to the policy that the training model still is), so a drift of the weight sync shows as a trend.
OUTPUT/soak.json holds every measurement; OUTPUT/soak.md the summary (memory at step 20 and at the end,
steps per minute, mismatch first vs last).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import sys
import time
from pathlib import Path


def rss_mib() -> float:
    """Resident memory of this process now, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class WatchedEngine:
    """The trainer's engine, measuring the log-prob mismatch of every k-th training rollout."""

    def __init__(self, engine, trainer, every: int, log: list):
        self.engine, self.trainer, self.every, self.log = engine, trainer, every, log
        self.name = engine.name

    def generate(self, prompts, num_generations=1, sampling=None):
        from dppo_core.rollout import logprob_mismatch

        batch = self.engine.generate(prompts, num_generations, sampling)
        step = self.trainer.step + 1
        training = sampling is not None and num_generations == self.trainer.config.num_generations
        if training and (step == 1 or step % self.every == 0):
            m = logprob_mismatch(self.trainer.model, batch, self.trainer.config.temperature)
            self.log.append({"step": step, "mean_abs": m.mean_abs, "max_abs": m.max_abs, "tokens": m.num_tokens})
        return batch

    def sync(self, model):
        self.engine.sync(model)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", type=Path, default=Path("benchmarks/results/soak"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mismatch-every", type=int, default=20)
    ap.add_argument("--kv-cache-mib", type=int, default=None,
                    help="vLLM's KV cache size on CPU (default: the engine's, 1024 MiB)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides")
    args = ap.parse_args()

    from dppo_core.config import preset
    from dppo_core.trainer import DPPOTrainer

    run_dir = args.output / "run"
    overrides = [f"max_steps={args.steps}", f"output_dir={run_dir}", "packing=true", "rollout_engine=vllm",
                 "eval_problems_per_level=50", "eval_steps=0", "save_steps=50", *args.set]
    config = preset("tiny-dppo").with_overrides(overrides)
    memory, mismatch = [], []

    def on_record(record):
        if record.get("event") != "eval":
            memory.append({"step": record["step"], "rss_mib": rss_mib(), "peak_rss_mib": peak_rss_mib(),
                           "step_time": record["step_time"],
                           # Python objects alive: flat while RSS grows points at native memory, not a Python leak
                           "python_objects": len(gc.get_objects()) if record["step"] % 10 == 0 else None})

    trainer = DPPOTrainer(config, callbacks=[on_record])
    if args.kv_cache_mib is not None and config.rollout_engine == "vllm":
        from dppo_core.rollout import make_rollout_engine

        engine = make_rollout_engine("vllm", model=trainer.model, tokenizer=trainer.tokenizer, require=True,
                                     model_path=trainer.model_path, seed=config.seed,
                                     kv_cache_memory_bytes=args.kv_cache_mib << 20)
    else:
        engine = trainer.make_engine()
    trainer.engine = WatchedEngine(engine, trainer, args.mismatch_every, mismatch)
    t0 = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - t0

    at = {m["step"]: m for m in memory}
    first, last = at[min(20, args.steps)], memory[-1]
    train_s = sum(m["step_time"] for m in memory)
    summary = {
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, {platform.system()}",
        "overrides": overrides, "steps": len(memory), "wall_s": wall, "train_s": train_s,
        "steps_per_min": 60 * len(memory) / train_s,
        "rss_mib_at_20": first["rss_mib"], "peak_rss_mib_at_20": first["peak_rss_mib"],
        "rss_mib_at_end": last["rss_mib"], "peak_rss_mib_at_end": last["peak_rss_mib"],
        "mismatch": mismatch, "memory": memory,
        "eval_final": {k: v for k, v in result["eval"].items() if k.endswith("accuracy")},
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    mm = "\n".join(f"| {m['step']} | {m['mean_abs']:.2e} | {m['max_abs']:.2e} | {m['tokens']} |" for m in mismatch)
    (args.output / "soak.md").write_text(f"""# Soak run: {len(memory)} steps of tiny-dppo with packing, vLLM engine

Command: `{summary['command']}` ({summary['machine']}).

| | step {first['step']} | step {last['step']} |
|---|---|---|
| resident memory (MiB) | {first['rss_mib']:.0f} | {last['rss_mib']:.0f} |
| peak resident memory (MiB) | {first['peak_rss_mib']:.0f} | {last['peak_rss_mib']:.0f} |

{summary['steps_per_min']:.1f} steps per minute of training ({train_s / 60:.1f} min of steps, {wall / 60:.1f} min in all
with evaluation and engine start).

Engine log-prob mismatch on the step's rollouts, measured right after generation:

| step | mean abs | max abs | tokens |
|---|---|---|---|
{mm}
""")
    print((args.output / "soak.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
