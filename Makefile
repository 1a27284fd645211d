# The README's two set-up commands are `make train` and `make test`; each
# installs what it needs first. (A Makefile rather than a pip-only recipe: the
# torch choice below must happen before pip resolves anything, so it cannot
# live inside the package it installs.)
PYTHON ?= python3
TORCH_VERSION := 2.13.0

# The install is remembered by a stamp per Python environment (sys.prefix, so
# each venv has its own) under build/, which git ignores: it is redone when
# pyproject.toml, the native sources, this file or the interpreter changes, or
# when the native library is gone; a fresh clone has no stamp and installs.
ENV := $(shell $(PYTHON) -c "import hashlib, os, sys, sysconfig; \
	print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12], os.path.realpath(sys.executable), \
	sysconfig.get_config_var('EXT_SUFFIX'))" 2>/dev/null)
ifeq ($(ENV),)
$(error $(PYTHON) does not run; set PYTHON to a Python >= 3.10, e.g. make test PYTHON=python3.11)
endif
STAMP := build/install-$(word 1,$(ENV)).stamp
HF_STAMP := build/hf-$(word 1,$(ENV)).stamp
NATIVE_LIB := offload/_native_lib$(word 3,$(ENV))

.PHONY: install train test FORCE

install: $(STAMP)

# Reuse an importable torch (a CUDA build on a GPU machine must not be
# replaced); install torch==$(TORCH_VERSION) only when there is none (on the
# project's CPU machines pip takes a CPU build of it from local disk).
$(STAMP): pyproject.toml Makefile $(wildcard native/*) $(word 2,$(ENV)) $(if $(wildcard $(NATIVE_LIB)),,FORCE)
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "offload: using the installed torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(PYTHON) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
	$(PYTHON) -m pip install -e ".[test]"
	@mkdir -p $(@D) && touch $@

# The main job: the bundled GPT on the bundled text, optimizer state on NVMe in
# a temporary directory (1-1.5 minutes on 2 cores); results under runs/.
train: install
	$(PYTHON) -m offload train

# The tests also use the optional extra [hf] (transformers: Hugging Face models
# built from their configs), installed from the installed package's own list
# (its metadata: Python 3.10 has no tomllib to read pyproject.toml) without
# building the package again. It comes from the network; where there is none
# the install says so and those tests skip.
HF_EXTRA = $(shell $(PYTHON) -c "import shlex; from importlib.metadata import requires; \
	print(shlex.join(r.split(';')[0].strip() for r in requires('offload') if r.endswith('extra == \"hf\"')))")
$(HF_STAMP): $(STAMP)
	@$(PYTHON) -m pip install $(HF_EXTRA) || echo "offload: the extra [hf] could not be installed; the Hugging Face tests will skip"
	@mkdir -p $(@D) && touch $@

# The native library was just built: its absence fails the run instead of skipping tests.
# Then the equivalence tests again, with the CPU playing an asynchronous device
# (Note [transfer protocol] in offload/zero/transfer.py): a copy read before it
# landed fails them. There a bf16 master is the weights' staging copy, not the
# flat buffer (Note [master in the weights]), so its tests run there too.
SIMULATED_TESTS = tests/zero/test_equivalence.py tests/zero/test_stage3.py tests/zero/test_overlap.py \
	tests/zero/test_in_place_changes.py \
	tests/zero/test_state_dtype.py::test_resuming_is_bitwise_and_checkpoints_move_between_formats \
	tests/zero/test_state_dtype.py::test_a_bf16_master_trains_like_adamw_within_bf16_noise
# The slowest tests are listed at the end, where CI's time goes.
test: install $(HF_STAMP)
	OFFLOAD_REQUIRE_NATIVE=1 $(PYTHON) -m pytest --durations=15
	OFFLOAD_REQUIRE_NATIVE=1 OFFLOAD_SIMULATED_DEVICE=1 $(PYTHON) -m pytest $(SIMULATED_TESTS)
