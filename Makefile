# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# torch is pinned for the dev environment only (a CPU wheel on this machine's disk);
# pyproject.toml states the supported range for users.
TORCH_DEV := torch==2.13.0

.PHONY: demo test lint typecheck bench notebooks clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_DEV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/wsi-loader demo --out demo

lint: $(STAMP)
	$(BIN)/ruff check wsi_loader tests benchmarks notebooks

typecheck: $(STAMP)
	$(BIN)/mypy wsi_loader

test: lint typecheck
	$(BIN)/python -m pytest

notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_index.py

clean:
	rm -rf $(VENV) demo .pytest_cache .mypy_cache .ruff_cache
