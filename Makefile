# Two commands run everything: `make demo` (kvtier's main job) and `make test`.
# Each creates .venv and installs what it needs. TORCH pins a CPU build where one is
# available locally; the package itself only needs torch>=2.4.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,demo]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtier demo --plot kvtier-demo.png

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/kvtier bench transfer

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
