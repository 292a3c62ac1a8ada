# Two commands run everything: `make demo` (kvtier's main job) and `make test`.
# Each creates .venv and installs what it needs. TORCH pins a CPU build where one is
# available locally; the package itself only needs torch>=2.4.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test test-vllm test-sglang bench gpu-check install clean

$(STAMP): pyproject.toml Makefile setup.py src/kvtier/transfer/_native.c src/kvtier/cache/_tokens.c src/kvtier/pools/_indices.c src/kvtier/storage/_pageio.c src/kvtier/storage/_pageio_read.c src/kvtier/storage/_pageio_shape.c src/kvtier/storage/_pageio_write.c src/kvtier/storage/_pageio.h src/kvtier/_lines.h
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,demo]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtier demo --plot kvtier-demo.png

test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm
	$(MAKE) test-sglang

# vLLM's CPU build needs transformers<5.20: its tests run in their own venv (about 8
# minutes and 3.4 GB on first use; scripts/vllm-env.sh is idempotent).
test-vllm:
	bash scripts/vllm-env.sh
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/integrations/vllm

# sglang 0.5.23 (HiCache storage backend tests) pins its own transformers and torch: its
# own venv too (about 7.5 minutes and 2.5 GB on first use; scripts/sglang-env.sh is idempotent).
test-sglang:
	bash scripts/sglang-env.sh
	.venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/integrations/sglang

# kvtier's CUDA checks in one command, on a machine with an NVIDIA GPU whose python3 holds a
# CUDA torch and Triton (nothing installed; logs and JSON in gpu-check/, or $$OUT)
gpu-check:
	bash scripts/gpu-check.sh

bench: $(STAMP)
	$(BIN)/kvtier bench transfer

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang .pytest_cache .hypothesis
