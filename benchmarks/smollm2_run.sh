#!/usr/bin/env bash
# GRPO and DPPO on a real pretrained model, side by side on one machine: SmolLM2-135M-Instruct (dppo build --model
# smollm2-135m), presets smollm2-grpo and smollm2-dppo (LoRA, level 3 with one solved example, 60 steps, one thread
# each, so the two runs share a 2-core machine one core each and meet the same load). Each run evaluates greedy and
# sampled accuracy on 200 held-out level-3 problems at steps 0, 20, 40 and 60.
#   bash benchmarks/smollm2_run.sh [OUT]      (OUT: benchmarks/results/smollm2; about 45 minutes)
# Then: python benchmarks/smollm2_summary.py OUT (the table, from the runs' logs). Each run's wall-clock seconds go to
# OUT/<method>.wall_s; its console output to RUNS_DIR/<method>.log (it names the model cache's path).
set -euo pipefail
out=${1:-benchmarks/results/smollm2}
py=${PYTHON:-.venv/bin/python}
runs=${RUNS_DIR:-runs/smollm2-bench}  # checkpoints and adapters stay out of the repository
"$py" -m dppo_core build --model smollm2-135m
mkdir -p "$out" "$runs"
for method in grpo dppo; do
  (
    start=$(date +%s)
    "$py" -m dppo_core train --preset "smollm2-$method" output_dir="$runs/$method" save_steps=0 --overwrite \
      > "$runs/$method.log" 2>&1
    echo $(( $(date +%s) - start )) > "$out/$method.wall_s"
  ) &
done
wait
for method in grpo dppo; do
  mkdir -p "$out/$method"
  cp "$runs/$method"/{config.json,metrics.jsonl,eval.jsonl,groups.jsonl} "$out/$method/"
done
