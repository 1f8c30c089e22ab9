# The two commands of the README. Each one creates .venv and installs the pinned stack first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: demo test test-slow lint
.PHONY: compile-sweep

$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,hf,serve]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m launch.generate --compare_autoregressive $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The whole suite except tests marked slow (the Qwen-size downloads and logit checks).
test: lint
	$(VENV)/bin/python -m pytest -q -n 2 --durations=15 -m "not slow"

# The slow tests alone: downloads the Qwen pair (1.6 GB) once, then checks it (about 3 minutes).
test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow --durations=15

# Compile-only TPU and CUDA devices for tests/test_compile_targets.py and the sweep below
# (docs/kernels.md): pinned, installed beside the venv, not in it. On the venv's path the CUDA
# plugin logs three lines at every jax start-up; tests/conftest.py adds this folder to the test
# process's path only.
COMPILE_DEPS := .venv-compile
COMPILE_STAMP := $(COMPILE_DEPS)/.installed-stamp
$(COMPILE_STAMP): $(STAMP) constraints.txt
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt --no-deps --upgrade \
		--target $(COMPILE_DEPS) libtpu jax-cuda12-pjrt nvidia-cuda-nvcc-cu12
	touch $(COMPILE_STAMP)
test: $(COMPILE_STAMP)

# Every kernel call and model step of the registered models compiled for every TPU / GPU target,
# as a table (scripts/compile_sweep.py --help). The default grid is about 3,000 compiles, some two
# hours with ARGS="--jobs=2" on 2 cores; docs/kernels.md gives a 47-minute grid. Then the big pairs
# on pod slices (experiments/pod_pairs.py, docs/pods.md: about 19 more minutes; ARGS="--kinds=pods" alone).
compile-sweep: $(COMPILE_STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python scripts/compile_sweep.py $(ARGS)
