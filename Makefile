# The two commands a newcomer needs (each does its own setup):
#   make demo   run the main job on the embedded tiny model and task
#   make test   run the whole test suite, notebooks included
PY := .venv/bin/python
# Models built by the demo, the tests and the notebooks are cached here (shared, so each is built once).
export DPPO_CACHE_DIR ?= $(CURDIR)/.cache/dppo
export VLLM_LOGGING_LEVEL ?= WARNING
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test test-fast lint notebooks clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m dppo_core.cli demo

# The warm-started tiny model is built first (about 5 minutes once, then cached): notebooks use it.
# (setup with DPPO_SETUP_BROWSER=1 also makes sure Chromium is there for tests/test_browser.py.)
test:
	DPPO_SETUP_BROWSER=1 bash scripts/setup.sh
	$(PY) -m dppo_core.cli build
	$(PY) -m pytest tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg

# Unit tests only (no notebooks, no slow tests): the inner loop while developing.
test-fast: setup
	$(PY) -m pytest tests -m "not slow"

lint: setup
	$(PY) -m ruff check dppo_core tests scripts benchmarks notebooks/solutions

clean:
	rm -rf .venv .cache .pytest_cache build *.egg-info
