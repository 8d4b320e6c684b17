# loraplex: `make run` sets up and serves the embedded default; `make test` sets up and runs every test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# the venv's tools (ninja for the CPU LoRA kernel's first build) come first on PATH
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup run demo test test-fast lint bench system-deps clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so that nothing installed after it pulls in another (multi-GB) build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/loraplex model fetch smollm2-135m
	$(VENV)/bin/loraplex serve

demo: setup
	$(VENV)/bin/loraplex model fetch smollm2-135m
	$(VENV)/bin/loraplex generate --model smollm2-135m --chat "Write one sentence about the sea."

system-deps:
	bash scripts/install-system-deps.sh

test: setup system-deps
	$(VENV)/bin/pytest -q

test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow and not integration and not browser"

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) bench/bench_engine.py
	$(PY) bench/bench_lora.py
	$(PY) bench/bench_gateway.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
