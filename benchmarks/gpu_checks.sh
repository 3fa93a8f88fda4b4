#!/usr/bin/env bash
# The GPU checks in one command, each one's output under DIR (default benchmarks/results/gpu):
#   machine.txt      nvidia-smi and the versions of torch, transformers, peft, bitsandbytes, vLLM
#   doctor.txt       dppo doctor --gpu (packing on every attention route, QLoRA, vLLM, a step of each method)
#   attention/       benchmarks/gpu_attention.py (update-pass time by layout and attention kernel)
#   rollout/         benchmarks/gpu_rollout.py (transformers rollouts: the compact loop against generate)
#   gpu-systems/     dppo bench --preset gpu-systems (step time per phase, each method padded/packed/shared)
#
#   bash benchmarks/gpu_checks.sh [DIR] [KEY=VALUE ...]    # KEY=VALUE: DPPOConfig overrides for gpu-systems
#
# Environment: PYTHON (default python3); DOCTOR_S, ATTENTION_S, ROLLOUT_S, SYSTEMS_S: a time limit in seconds for that stage
# (default none; 0 skips the stage; a stage stopped at its limit leaves what it wrote so far); DOCTOR_METHODS,
# SYSTEMS_METHODS: the methods to step (default: the doctor's and the preset's; gpu-systems needs grpo among them). A failing stage does not stop the next one; the exit
# status is the first failing stage's.
set -uo pipefail
out=${1:-benchmarks/results/gpu}
shift $(( $# > 0 ? 1 : 0 ))
py=${PYTHON:-python3}
mkdir -p "$out"
limit() { local s=$1; shift; if [ "$s" = 0 ]; then echo "skipped: $*"; elif [ -n "$s" ]; then timeout --signal=INT --kill-after=20 "$s" "$@"; else "$@"; fi; }
status=0
keep() { local rc=$?; if [ "$status" -eq 0 ] && [ "$rc" -ne 0 ]; then status=$rc; fi; }

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$py" - <<'PY'
import importlib.metadata as md
import platform
for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "vllm", "flash-attn"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
print("python", platform.python_version(), "| cpus", __import__("os").cpu_count())
PY
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

# shellcheck disable=SC2086
limit "${DOCTOR_S:-}" "$py" -m dppo_core doctor --gpu ${DOCTOR_METHODS:+--methods $DOCTOR_METHODS} 2>&1 \
  | tee "$out/doctor.txt"; keep
limit "${ATTENTION_S:-}" "$py" benchmarks/gpu_attention.py --output "$out/attention" 2>&1 \
  | tee "$out/attention.log"; keep
limit "${ROLLOUT_S:-}" "$py" benchmarks/gpu_rollout.py --output "$out/rollout" 2>&1 | tee "$out/rollout.log"; keep
# shellcheck disable=SC2086
limit "${SYSTEMS_S:-}" "$py" -m dppo_core bench --preset gpu-systems --output-dir "$out/gpu-systems" \
  ${SYSTEMS_METHODS:+--methods $SYSTEMS_METHODS} "$@" 2>&1 | tee "$out/gpu-systems.log"; keep
exit "$status"
