# The two commands of the README. Each one creates .venv and installs the pinned stack first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: demo test test-slow lint

$(STAMP): setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
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
