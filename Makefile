# Quick start: `make run` (the control plane on SQLite) and `make test` (the whole suite).
# Both create and reuse a virtual environment in .venv.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv run test lint bench demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/hyperpod-sim serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/hyperpod-sim demo

bench: $(STAMP)
	$(BIN)/python bench/control_plane.py

clean:
	rm -rf $(VENV) .hyperpod-sim .pytest_cache .mypy_cache .ruff_cache
