# The README's two set-up commands are `make train` and `make test`; each
# installs what it needs first. (A Makefile rather than a pip-only recipe: the
# torch choice below must happen before pip resolves anything, so it cannot
# live inside the package it installs.)
PYTHON ?= python3
TORCH_VERSION := 2.13.0

.PHONY: install train test

# Reuse an importable torch (a CUDA build on a GPU machine must not be
# replaced); install the CPU build $(TORCH_VERSION) only when there is none.
install:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "offload: using the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PYTHON) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
	$(PYTHON) -m pip install -e ".[test]"

# The main job. Until `offload train` exists it is the CPU Adam benchmark.
train: install
	$(PYTHON) -m offload bench adam

test: install
	$(PYTHON) -m pytest
