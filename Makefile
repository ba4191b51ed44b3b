# Quick start: `make run` (the control plane on SQLite) and `make test` (the whole suite).
# Both create and reuse a virtual environment in .venv: `run` installs the server extra only,
# `test` (and lint, demo, bench) the dev extra, the test toolchain and torch included.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SERVER_STAMP := $(VENV)/.server-stamp
DEV_STAMP := $(VENV)/.dev-stamp

.PHONY: venv run test lint bench demo openapi clean

$(BIN)/pip:
	$(PYTHON) -m venv $(VENV)

$(SERVER_STAMP): pyproject.toml | $(BIN)/pip
	@echo "installing hyperpod-sim[server] into $(VENV) (about 510 MB, 30 s to a minute from a nearby index)"
	$(BIN)/pip install --progress-bar on -e '.[server]'
	touch $(SERVER_STAMP)

$(DEV_STAMP): pyproject.toml | $(BIN)/pip
	@echo "installing hyperpod-sim[dev] into $(VENV) (about 1.8 GB, 50 s from a nearby index: torch, awscli, the linters)"
	$(BIN)/pip install --progress-bar on -e '.[dev]'
	touch $(SERVER_STAMP) $(DEV_STAMP)

venv: $(DEV_STAMP)

run: $(SERVER_STAMP)
	$(BIN)/hyperpod-sim serve

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Workers: most tests wait on agent processes and servers, so 3 keep CI's 2 cores busy; with 4,
# clean-clone runs here failed 1-5 tests that wait on agents' heartbeats (3 s timeouts) under the
# load. worksteal hands a long module's tests to idle workers. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 3

test: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

demo: $(DEV_STAMP)
	$(BIN)/hyperpod-sim demo

bench: $(DEV_STAMP)
	$(BIN)/python bench/control_plane.py

# docs/openapi.json pins the document the control plane serves (tests/test_openapi.py compares
# them): write it anew after a deliberate change of the wire.
openapi: $(SERVER_STAMP)
	$(BIN)/python -m hyperpod_sim.api.openapi_file docs/openapi.json

clean:
	rm -rf $(VENV) .hyperpod-sim .pytest_cache .mypy_cache .ruff_cache
