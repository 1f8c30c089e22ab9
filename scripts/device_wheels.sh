#!/usr/bin/env bash
# The pure-Python wheels scripts/device_check.py needs on a GPU machine without network, into
# .devwheels/ (ignored by git; carried to the machine beside the repository). That machine has
# its own Python 3.12 with jax, flax, optax, orbax-checkpoint, chex, transformers (hence tqdm and
# pyyaml), tokenizers, jinja2 and safetensors; it lacks gguf and ml_collections. The versions are
# constraints.txt's; --no-deps: their own dependencies (numpy, absl-py, pyyaml) are there.
# device_check.py puts each wheel on sys.path (Python imports a pure-Python wheel as a zip).
# Run here, with network: bash scripts/device_wheels.sh   (about 1 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p .devwheels
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation py --abi none --platform any \
    -c constraints.txt -d .devwheels gguf ml_collections tqdm
du -sh .devwheels
ls .devwheels
