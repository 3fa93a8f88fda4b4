"""Which rollout engine is cheaper for SmolLM2-135M on a CPU: vLLM's CPU engine or the transformers one.

    python benchmarks/smollm2_engines.py [OUT] [--steps N] [--rounds R]
        (OUT: benchmarks/results/smollm2; defaults 3 steps, 1 round: about 15 minutes on 2 cores)

Each setting is a few steps of ``dppo train --preset smollm2-grpo`` alone on the machine (evaluation cut to
one problem, no checkpoints), as training runs the engine: ``rollout_engine=hf`` (the policy itself, PEFT's
LoRA layers in its forward) or ``rollout_engine=vllm`` (vLLM in-process, the LoRA adapter handed over after
every update: the ``sync`` phase), with ``cpu_threads`` 1 and 2. The settings run in ``--rounds`` rounds, each
round every setting once in turn, so that a change in the machine's load meets every setting alike. Per
setting, over the steps after the first of every round (the first warms up): the median seconds of a step's
rollout, of its sync, and the generated tokens per second of rollout + sync (a step's tokens over the two
phases' seconds), which is what choosing the engine changes. Writes ``OUT/engines.json`` and prints a table;
nothing else may run beside it.

``--folded`` measures instead (and adds to ``OUT/engines.json``) what vLLM would cost without serving the
adapter (the trainer's sync folds LoRA into the base weights when the engine serves none,
``VLLMRollout(lora=False)``; no configuration asks for it yet): in one process per thread count, a step's
rollout (8 training prompts x 8 completions, T = 1, the preset's prompt and length) by vLLM on the base
weights and by the transformers engine on the PEFT policy, three timed calls each after a warm-up, and the
time to push the folded weights into vLLM.

``--prefix`` measures instead (and adds to ``OUT/engines.json``) what computing the prompts' shared prefix once
saves (``HFRollout(share_prefix=...)``): one ``smollm2-realistic`` evaluation (181 held-out problems of levels
1-5, greedy and one sample at T = 1, :func:`dppo_core.evaluate.evaluate_policy`) and one step's rollout (8
training prompts x 8 completions), each timed with and without, alternating, three times, in one process per
thread count; with the accuracies each gave (the same samples either way, up to a near tie).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = (("hf", 1), ("vllm", 1), ("hf", 2), ("vllm", 2))


def _run(engine: str, threads: int, steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "dppo_core", "train", "--preset", "smollm2-grpo", f"max_steps={steps}",
           "eval_problems_per_level=1", "eval_samples=1", "eval_steps=0", "save_steps=0",
           f"rollout_engine={engine}", f"cpu_threads={threads}", f"output_dir={out}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{engine}, {threads} thread(s) failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "step_time" in r and r["step"] > 1]


def _folded(threads: int) -> dict:
    """In this process: vLLM on the base weights against the transformers engine on the PEFT policy."""
    import random

    import torch

    from dppo_core.config import preset
    from dppo_core.data import prompt_renderer
    from dppo_core.engines.hf import HFRollout
    from dppo_core.engines.types import SamplingConfig
    from dppo_core.engines.vllm import VLLMRollout
    from dppo_core.policy import load_policy, resolve_model_path
    from dppo_core.tasks import ArithmeticTask

    torch.set_num_threads(threads)
    config = preset("smollm2-grpo")
    path = resolve_model_path(config)
    policy, tokenizer = load_policy(config, path, torch.device("cpu"))
    render = prompt_renderer(config)
    problems = random.Random(0).sample(ArithmeticTask([3]).train(3), 8)
    prompts = [render(p.messages()) for p in problems]
    out: dict = {"cpu_threads": threads}
    engines = {"hf": HFRollout(policy, tokenizer), "vllm_base": VLLMRollout(path, tokenizer, lora=False)}
    for name, engine in engines.items():
        engine.generate(prompts, 8, SamplingConfig(max_tokens=32, temperature=1.0, seed=100))  # warm-up
        calls = []
        for seed in range(3):
            t = time.perf_counter()
            batch = engine.generate(prompts, 8, SamplingConfig(max_tokens=32, temperature=1.0, seed=seed))
            calls.append({"seconds": time.perf_counter() - t, "tokens": batch.num_generated_tokens})
        out[name] = {"calls": calls, "median_seconds": statistics.median(c["seconds"] for c in calls),
                     "tokens_per_s": statistics.median(c["tokens"] / c["seconds"] for c in calls)}
    t = time.perf_counter()
    engines["vllm_base"].sync(policy)  # LoRA folded into the base weights, pushed in memory
    out["vllm_folded_sync_seconds"] = time.perf_counter() - t
    return out


def _prefix(threads: int) -> dict:
    """In this process: an evaluation and a step's rollout with and without the shared prefix."""
    import random

    import torch

    from dppo_core.data import prompt_renderer
    from dppo_core.engines.hf import HFRollout
    from dppo_core.engines.types import SamplingConfig
    from dppo_core.evaluate import evaluate_policy
    from dppo_core.policy import load_policy, resolve_model_path
    from dppo_core.tasks import ArithmeticTask
    from dppo_core.tools.bench.presets import bench_preset, method_config

    torch.set_num_threads(threads)
    config = method_config(bench_preset("smollm2-realistic"), "grpo_skip", 0, tempfile.gettempdir())
    policy, tokenizer = load_policy(config, resolve_model_path(config), torch.device("cpu"))
    render = prompt_renderer(config)
    problems = random.Random(0).sample(ArithmeticTask([3]).train(3), config.prompts_per_step)
    prompts = [render(p.messages()) for p in problems]
    sampling = SamplingConfig(max_tokens=config.max_completion_length, temperature=1.0, seed=1)
    out: dict = {"cpu_threads": threads, "evaluation": {}, "rollout": {}}
    for repeat in range(3):
        for share in (True, False) if repeat % 2 == 0 else (False, True):
            engine = HFRollout(policy, tokenizer, share_prefix=share)
            t = time.perf_counter()
            record = evaluate_policy(config, engine, step=0)
            seconds = time.perf_counter() - t
            out["evaluation"].setdefault(str(share), []).append(
                {"seconds": seconds, "greedy": record["greedy_accuracy"], "sampled": record["sampled_accuracy"]})
            t = time.perf_counter()
            batch = engine.generate(prompts, config.num_generations, sampling)
            out["rollout"].setdefault(str(share), []).append(
                {"seconds": time.perf_counter() - t, "tokens": batch.num_generated_tokens})
    for kind in ("evaluation", "rollout"):
        out[f"{kind}_median_s"] = {share: statistics.median(r["seconds"] for r in runs)
                                   for share, runs in out[kind].items()}
    return out


def _describe(kind: str, row: dict) -> str:
    if kind == "prefix":
        ev, ro = row["evaluation_median_s"], row["rollout_median_s"]
        return (f"evaluation {ev['True']:.1f} s shared, {ev['False']:.1f} s whole; a step's rollout "
                f"{ro['True']:.1f} s / {ro['False']:.1f} s")
    return (f"a step's rollout: transformers (PEFT policy) {row['hf']['median_seconds']:.1f} s, vLLM on the base "
            f"weights {row['vllm_base']['median_seconds']:.1f} s; folded sync {row['vllm_folded_sync_seconds']:.2f} s")


def _command(argv: list[str]) -> str:
    """The command as run, with paths under the working directory written relative to it."""
    cwd = Path.cwd().resolve()
    words = [str(Path(a).resolve().relative_to(cwd)) if Path(a).is_absolute() and Path(a).resolve().is_relative_to(cwd)
             else a for a in argv]
    return "python benchmarks/smollm2_engines.py " + " ".join(words)


def _side_measurement(kind: str, out: Path, argv: list[str]) -> None:
    """``--folded`` or ``--prefix``: its worker in a fresh process per thread count, added to OUT/engines.json."""
    runs = []
    for threads in (1, 2):
        proc = subprocess.run([sys.executable, __file__, "--worker", kind, str(threads)], capture_output=True,
                              text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if proc.returncode:
            raise SystemExit(f"--{kind} with {threads} thread(s) failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{threads} thread(s): {_describe(kind, runs[-1])}", flush=True)
    report = json.loads((out / "engines.json").read_text()) if (out / "engines.json").is_file() else {}
    report[kind] = {"command": _command(argv), "runs": runs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path("benchmarks/results/smollm2"))
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--folded", action="store_true", help="time vLLM on folded weights instead (above)")
    parser.add_argument("--prefix", action="store_true", help="time the shared prefix instead (above)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        kind, threads = args.worker
        print(json.dumps((_folded if kind == "folded" else _prefix)(int(threads))))
        return 0
    out = args.out
    if args.prefix or args.folded:
        _side_measurement("prefix" if args.prefix else "folded", out, argv)
        return 0
    steps: dict[tuple[str, int], list[dict]] = {s: [] for s in SETTINGS}
    walls: dict[tuple[str, int], list[float]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="smollm2-engines-") as tmp:
        for r in range(args.rounds):
            for engine, threads in SETTINGS:
                t0 = time.perf_counter()
                steps[engine, threads] += _run(engine, threads, args.steps, Path(tmp) / f"{engine}-t{threads}-r{r}")
                walls[engine, threads].append(time.perf_counter() - t0)
                print(f"round {r + 1}: {engine}, {threads} thread(s) done in {walls[engine, threads][-1]:.0f} s",
                      flush=True)
    results = []
    for (engine, threads), rows in steps.items():
        tokens_per_s = [r["tokens_generated"] / (r["time_rollout"] + r.get("time_sync", 0.0)) for r in rows]
        row = {"engine": engine, "cpu_threads": threads, "steps_timed": len(rows),
               "run_wall_s": [round(w, 1) for w in walls[engine, threads]],
               "median_time_rollout": statistics.median(r["time_rollout"] for r in rows),
               "median_time_sync": statistics.median(r.get("time_sync", 0.0) for r in rows),
               "median_step_time": statistics.median(r["step_time"] for r in rows),
               "median_tokens_per_step": statistics.median(r["tokens_generated"] for r in rows),
               "median_tokens_per_s": statistics.median(tokens_per_s)}
        results.append(row)
    print("| engine | threads | rollout s | sync s | tokens / s (rollout + sync) | whole step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in results:
        print(f"| {row['engine']} | {row['cpu_threads']} | {row['median_time_rollout']:.1f} | "
              f"{row['median_time_sync']:.2f} | {row['median_tokens_per_s']:.0f} | {row['median_step_time']:.1f} |")
    load = os.getloadavg()
    # the --folded and --prefix sections of an earlier measurement are kept
    earlier = json.loads((out / "engines.json").read_text()) if (out / "engines.json").is_file() else {}
    report = {**{k: v for k, v in earlier.items() if k in ("folded", "prefix")},
              "command": _command(argv), "cpu_count": os.cpu_count(),
              "steps_per_run": args.steps, "rounds": args.rounds, "load_average_after": [round(x, 2) for x in load],
              "settings": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
