# The README's two set-up commands are `make train` and `make test`; each
# installs what it needs first. (A Makefile rather than a pip-only recipe: the
# torch choice below must happen before pip resolves anything, so it cannot
# live inside the package it installs.)
PYTHON ?= python3
TORCH_VERSION := 2.13.0

.PHONY: install train test

# Reuse an importable torch (a CUDA build on a GPU machine must not be
# replaced); install torch==$(TORCH_VERSION) only when there is none (on the
# project's CPU machines pip takes a CPU build of it from local disk).
install:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "offload: using the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PYTHON) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
	$(PYTHON) -m pip install -e ".[test]"

# The main job: the bundled GPT on the bundled text, optimizer state on NVMe in
# a temporary directory (about a minute on 2 cores); results under runs/.
train: install
	$(PYTHON) -m offload train

# The native library was just built: its absence fails the run instead of skipping tests.
test: install
	OFFLOAD_REQUIRE_NATIVE=1 $(PYTHON) -m pytest
