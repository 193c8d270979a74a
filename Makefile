# Two commands for a newcomer: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint install install-dev system-deps

# The stamp is written only once pip works, so an interrupted first run starts over cleanly.
$(VENV)/.created:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ferry needs Python 3.11 or newer")'
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@touch $@

$(VENV)/.installed: pyproject.toml | $(VENV)/.created
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(VENV)/.created
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Debian packages the tests use: skopeo (a real registry client peer) and OpenBLAS (the runner's
# float32 compute path). Installed with apt-get when missing; elsewhere the tests say what is absent.
system-deps:
	@missing=""; \
	command -v skopeo >/dev/null 2>&1 || missing="$$missing skopeo"; \
	[ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] || [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ] || missing="$$missing libopenblas0-pthread"; \
	command -v cc >/dev/null 2>&1 || missing="$$missing gcc"; \
	if [ -n "$$missing" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing with apt-get"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) || \
		echo "WARNING: could not install$$missing"; \
	fi

run: install
	@echo "model server on http://127.0.0.1:11434, registry on http://127.0.0.1:5000 (Ctrl-C stops both)"
	@# Reset the trap first: `kill 0` signals this shell too, and re-entering the trap recursed
	@# until dash segfaulted.
	@trap 'trap - INT TERM EXIT; kill 0' INT TERM EXIT; \
	$(BIN)/ferry serve & \
	if $(BIN)/ferry registry --help >/dev/null 2>&1; then $(BIN)/ferry registry serve & fi; \
	wait

test: install-dev system-deps
	$(BIN)/python -m pytest -q

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/mypy ferry registry workflows server runner
