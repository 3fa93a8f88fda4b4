# The two commands a newcomer needs (each does its own setup):
#   make demo   run the main job on the embedded tiny model and task
#   make test   run the whole test suite, notebooks included
PY := .venv/bin/python
# Models built by the demo, the tests and the notebooks are cached here (shared, so each is built once).
export DPPO_CACHE_DIR ?= $(CURDIR)/.cache/dppo
export VLLM_LOGGING_LEVEL ?= WARNING
export TOKENIZERS_PARALLELISM ?= false
# The same floating-point results on every x86-64 CPU with AVX2, with or without AVX-512: PyTorch's own
# kernels, MKL and oneDNN otherwise pick wider vector code where they can, which sums in another order, and
# over the 600 steps of the warm start that is a different model (and different stored notebook outputs).
# No effect on a CPU whose best is AVX2; not set on other CPUs (ARM, x86 without AVX2).
ifeq ($(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo yes),yes)
export ATEN_CPU_CAPABILITY ?= avx2
export MKL_CBWR ?= AVX2
export ONEDNN_MAX_CPU_ISA ?= AVX2
endif

.PHONY: setup demo test test-fast lint notebooks clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m dppo_core.cli demo

# The warm-started tiny model ships with the package (copied into the cache at first use): notebooks use it.
# (setup with DPPO_SETUP_BROWSER=1 also makes sure Chromium is there for tests/test_browser.py.)
test:
	DPPO_SETUP_BROWSER=1 bash scripts/setup.sh
	$(PY) -m dppo_core.cli build
	$(PY) -m pytest tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg

# Unit tests only (no notebooks, no slow tests): the inner loop while developing.
test-fast: setup
	$(PY) -m pytest tests -m "not slow"

# Re-execute every chapter and store its outputs (what nbval compares), with the timing table in notebooks/README.md.
notebooks: setup
	$(PY) -m dppo_core.cli build
	$(PY) scripts/time_notebooks.py --write-outputs

lint: setup
	$(PY) -m ruff check dppo_core tests scripts benchmarks notebooks/solutions

clean:
	rm -rf .venv .cache .pytest_cache build *.egg-info
