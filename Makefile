# The two commands of the README. Each one creates .venv and installs the pinned stack first.
PYTHON ?= python3
VENV := .venv
ARGS ?=
# The machine's accelerator: cpu (default), cuda (an NVIDIA GPU: the jax CUDA 12 plugin) or tpu
# (libtpu): `make demo PLATFORM=cuda`, `make test PLATFORM=tpu` install setup.py's extra of that
# name beside the rest (docs/usage.md, "On a GPU or a TPU").
PLATFORM ?= cpu
PLATFORMS := cpu cuda tpu
ifeq ($(filter $(PLATFORM),$(PLATFORMS)),)
$(error PLATFORM must be one of: $(PLATFORMS); got '$(PLATFORM)')
endif
comma := ,
EXTRAS := test,hf,experiments,hub,serve$(if $(filter-out cpu,$(PLATFORM)),$(comma)$(PLATFORM))
STAMP := $(VENV)/.installed-$(PLATFORM)
# The demo needs the package alone (no torch, plots or test tools): a fresh clone's `make demo`
# installs that much (issue 39: about a minute less); `make test` adds the rest. --no-compile:
# pip byte-compiles every module it installs (5,000 files, 19 s on the busy 2-core EPYC) where the
# demo imports a fraction of them, which Python compiles (and caches) as it first imports them.
DEMO_EXTRAS := $(if $(filter-out cpu,$(PLATFORM)),$(PLATFORM))
DEMO_STAMP := $(VENV)/.installed-demo-$(PLATFORM)
# Each install ends by starting the build of the CPU kernels (ggml from llama.cpp's source and the
# GGUF kernel: `auto` precision's gguf_q8) in a process of its own, so that it runs while the demo
# downloads the weights or the suite's set-up installs the compile-only plugins; a run that needs
# a kernel before its build is done waits for it (issue 53: no short run falls back to int8).
# Nothing where it is built already or cannot be (no cmake or C/C++ compiler: the run says so once).
BUILD_KERNELS := $(VENV)/bin/python -m models.kernels.build --background

.PHONY: demo serve test test-slow lint
.PHONY: compile-sweep device-check

$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[$(EXTRAS)]'
	$(BUILD_KERNELS)
	touch $(STAMP)

$(DEMO_STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.$(if $(DEMO_EXTRAS),[$(DEMO_EXTRAS)])'
	$(BUILD_KERNELS)
	touch $(DEMO_STAMP)

demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(VENV)/bin/python -m launch.generate --compare_autoregressive $(ARGS)

# The OpenAI-compatible server (launch.serve) on the Qwen pair: the package with its serve extra,
# then the server on http://127.0.0.1:8000/v1 (`make serve ARGS="--port=8001 --max_batch=4"`).
SERVE_STAMP := $(VENV)/.installed-serve-$(PLATFORM)
$(SERVE_STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.[serve$(if $(DEMO_EXTRAS),$(comma)$(DEMO_EXTRAS))]'
	$(BUILD_KERNELS)
	touch $(SERVE_STAMP)

serve: $(if $(wildcard $(STAMP)),$(STAMP),$(SERVE_STAMP))
	$(VENV)/bin/python -m launch.serve $(ARGS)

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

# The device check (scripts/device_check.py, docs/benchmarks.md "Measured on an H100/H200") on
# this machine's accelerator; `make test` runs it before the suite on PLATFORM=cuda or tpu (the
# suite itself runs on the CPU backend: tests/conftest.py).
DEVICE_OUT ?= experiments/results/device/$(PLATFORM)
device-check: $(STAMP)
	$(VENV)/bin/python scripts/device_check.py --out=$(DEVICE_OUT) $(ARGS)
ifneq ($(PLATFORM),cpu)
test: device-check
endif

# Every kernel call and model step of the registered models compiled for every TPU / GPU target,
# as a table (scripts/compile_sweep.py --help). The default grid is about 3,000 compiles, some two
# hours with ARGS="--jobs=2" on 2 cores; docs/kernels.md gives a 47-minute grid. Then the big pairs
# on pod slices (experiments/pod_pairs.py, docs/pods.md: about 19 more minutes; ARGS="--kinds=pods" alone).
compile-sweep: $(COMPILE_STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python scripts/compile_sweep.py $(ARGS)
