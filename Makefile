# The two commands a newcomer needs (each does its own setup):
#   make demo   run the main job on the embedded tiny model and task
#   make test   run the test suite, notebooks included (all but the warm start's rebuild: make test-rebuild)
PY := .venv/bin/python
# Models built by the demo, the tests and the notebooks are cached here (shared, so each is built once).
export DPPO_CACHE_DIR ?= $(CURDIR)/.cache/dppo
export VLLM_LOGGING_LEVEL ?= WARNING
export TOKENIZERS_PARALLELISM ?= false
# The kernel setting the stored notebook outputs and pinned runs were recorded with: PyTorch's own kernels,
# MKL and oneDNN pinned to AVX2 (otherwise they pick wider vector code where they can, which sums in another
# order). Pins narrow the differences between CPUs; they do not remove them (an Intel CPU with AVX-512 rounds a
# 600-step training differently from an AMD one under the same pins), so the suite asserts nothing that needs
# another CPU's bits, and `make test` runs it under a second setting too (PERTURBED, below).
# Not set on CPUs without AVX2 (ARM, old x86).
ifeq ($(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo yes),yes)
export ATEN_CPU_CAPABILITY ?= avx2
export MKL_CBWR ?= AVX2
export ONEDNN_MAX_CPU_ISA ?= AVX2
endif

# The second setting: other kernels on this same CPU, which sum in other orders
# (tests/system/test_numerics_settings.py shows it): MKL's compatible code path and oneDNN without AVX (every matrix
# product), and on a CPU with AVX-512 PyTorch's own kernels at AVX-512 (softmax, for one; what an unpinned Intel
# machine runs). It stands in for another machine: the tests marked `numerics` (each test whose outcome can depend on
# a floating-point kernel: a model's forward, training, a softmax or long float32 sums; not the exact, integer or
# float64 checks, which it cannot change) must pass under it too, and every chapter under nbval runs under it (only
# there: docs/testing.md says why), with a model cache of its own (as a fresh machine builds its own models).
# (Not ATEN_CPU_CAPABILITY=default: with it, torch.compile's C++ code for vLLM's CPU engine fails to build.)
PERTURBED_ATEN := $(if $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo yes),avx512,\
	$(if $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo yes),avx2,default))
PERTURBED := ATEN_CPU_CAPABILITY=$(PERTURBED_ATEN) MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 \
	DPPO_CACHE_DIR=$(CURDIR)/.cache/dppo-perturbed
NBVAL := --nbval --nbval-sanitize-with notebooks/sanitize.cfg
# `make test` runs each setting in TEST_WORKERS pytest-xdist workers (TEST_WORKERS=0: one process). --dist loadfile
# keeps a file's tests in one worker (a chapter's cells run in order in one kernel, a module's fixtures are built
# once); tests/conftest.py hands out the longest files first (tests/durations.json) and has the workers' threads
# sleep rather than spin while they wait (OMP_WAIT_POLICY=PASSIVE).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
TEST_ARGS ?=

.PHONY: setup demo test test-perturbed test-rebuild test-fast test-colab test-verl dist lint hooks notebooks clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m dppo_core demo --overwrite

# The warm-started tiny model ships with the package (copied into the cache at first use): notebooks use it.
# (setup with DPPO_SETUP_BROWSER=1 also makes sure Chromium is there for tests/course/test_browser.py.)
# Then the numerics tests again, and every chapter under nbval, under the second kernel setting (test-perturbed): the
# chapters run there only, as nbval compares the same stored outputs under either setting (docs/testing.md says why).
# Every test but the warm start's 600-step rebuild (the `rebuild` marker; `make test-rebuild`, below).
test:
	DPPO_SETUP_BROWSER=1 bash scripts/setup.sh
	$(PY) -m dppo_core build
	$(PY) -m pytest $(XDIST) -m "not rebuild" tests $(TEST_ARGS)
	$(MAKE) --no-print-directory test-perturbed

# The shipped warm start rebuilt from scratch, 600 steps (about 5.5 minutes on 2 cores): it learns as the shipped run
# did, and on the recording CPU's kernels it is the shipped weights bit for bit. CI runs it after `make test`; `make
# test` checks the rebuild's first 50 steps against the shipped loss curve (tests/system/test_models.py).
test-rebuild: setup
	$(PY) -m pytest -m rebuild tests/system/test_models.py $(TEST_ARGS)

# The tests that compare numbers, and every chapter, under the second kernel setting alone.
test-perturbed: setup
	env $(PERTURBED) $(PY) -m dppo_core build
	env $(PERTURBED) $(PY) -m pytest $(XDIST) -m numerics tests notebooks $(NBVAL) $(TEST_ARGS)

# The tiers of tests/ (each a folder; tests/conftest.py and tests/helpers/ serve them all):
#   tests/unit    pure functions and small tensors: no model run, no engine, no training subprocess
#   tests/system  runs: models, engines, trainer steps, crash/resume, integrations (TRL, torchrun), CLI runs, benches
#   tests/course  the chapters: their checks, the solutions, the course tools, the browser test
#   tests/repo    the repository itself: packaging, README and docs, committed results, commit subjects, setup script
# `make test` runs them all but the `rebuild` tests (`make test-rebuild`), and the chapters under nbval under the
# second setting; `make test-fast`, the inner loop while developing, runs unit and repo (about a minute on 2 cores,
# no model built). (An `-m` in TEST_ARGS replaces `make test`'s own: pytest keeps the last one.)
test-fast: setup
	$(PY) -m pytest $(XDIST) tests/unit tests/repo $(TEST_ARGS)

# The course install as Colab or a workshop laptop gets it: the wheel with the course extra only, into a fresh
# environment that already has another torch (2.12), then every chapter top to bottom outside the clone, network
# closed (scripts/colab_check.py; its summary, with the install's time and size, is committed). Not in `make test`:
# the CUDA build of torch it installs first is several GB.
COLAB_TORCH ?= 2.12.0
test-colab: setup
	$(PY) scripts/colab_check.py --torch $(COLAB_TORCH) --output benchmarks/results/colab/torch-$(COLAB_TORCH).json

# dppo_core.integrations.verl against verl's real functions (tests_verl/, which `make test` does not collect), in an
# environment of its own (.venv-verl): verl 0.9.1 with its pins (transformers below ours), the CPU build of torch, and
# dppo_core installed without its dependencies; every version pinned by tests_verl/constraints.txt. From scratch
# about 3 minutes (a warm pip cache) and 2 GB; the tests about 75 seconds.
VERL_PY := .venv-verl/bin/python
TORCH_CPU_INDEX := $(shell sed -n 's/^TORCH_CPU_INDEX=//p' scripts/setup.sh)
test-verl:
	test -x $(VERL_PY) || $$(command -v python3.11 || command -v python3.12 || echo python3) -m venv .venv-verl
	$(VERL_PY) -m pip install -q torch==2.13.0+cpu 2>/dev/null || \
		$(VERL_PY) -m pip install -q torch==2.13.0+cpu --index-url $(TORCH_CPU_INDEX)
	$(VERL_PY) -m pip install -q -c tests_verl/constraints.txt -r tests_verl/requirements.txt
	$(VERL_PY) -m pip install -q --no-deps -e .
	DPPO_REQUIRE_VERL_TRAINER=1 $(VERL_PY) -m pytest tests_verl -p no:cacheprovider

# The wheel and sdist (dist/): what `pip install "dist/dppo_core-<version>-py3-none-any.whl[course]"` installs.
dist: setup
	$(PY) -m build --outdir dist

# Re-execute every chapter and store its outputs (what nbval compares), with the timing table in notebooks/README.md.
notebooks: setup
	$(PY) -m dppo_core build
	$(PY) scripts/time_notebooks.py --write-outputs

# ruff, then mypy on the library as pyproject.toml's [tool.mypy] says (strict on the core modules; the cache in
# .mypy_cache makes a second run take seconds), then the commit subjects (at most 72 characters).
lint: setup
	$(PY) -m ruff check dppo_core tests tests_verl scripts benchmarks examples
	$(PY) -m mypy
	$(PY) scripts/check_commit_subjects.py

# A commit-msg hook that refuses a subject over 72 characters before the commit is made.
hooks:
	git config core.hooksPath .githooks

clean:
	rm -rf .venv .cache .pytest_cache .mypy_cache build *.egg-info
