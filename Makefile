# Two commands for a newcomer: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint install install-dev system-deps

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ferry needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Debian packages the tests use as real peers (skopeo) and the runner's BLAS; skipped off Debian.
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && ! command -v skopeo >/dev/null 2>&1; then \
		echo "installing skopeo with apt-get"; \
		(apt-get update -qq && apt-get install -y -qq skopeo >/dev/null) || \
		echo "WARNING: could not install skopeo; interop tests will report it"; \
	fi

run: install
	@echo "model server on http://127.0.0.1:11434, registry on http://127.0.0.1:5000 (Ctrl-C stops both)"
	@trap 'kill 0' INT TERM EXIT; \
	$(BIN)/ferry serve & \
	if $(BIN)/ferry registry --help >/dev/null 2>&1; then $(BIN)/ferry registry serve & fi; \
	wait

test: install-dev system-deps
	$(BIN)/python -m pytest -q

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/mypy registry workflows
