from setuptools import find_packages, setup

setup(
    name="spec-jax",
    version="0.1.0",
    description="Speculative decoding in JAX: exact, batched, compiled, sharded.",
    python_requires=">=3.11",
    packages=find_packages(include=["spec_jax*", "models*", "training*", "experiments*", "launch*"]),
    install_requires=[
        "jax",
        "flax",
        "optax",
        "orbax-checkpoint",
        "numpy",
        "chex",
        "absl-py",
        "ml_collections",
        "gguf",
        "jinja2>=3.1.6",  # chat templates (models.tokenizer); older versions have sandbox escapes
        "tokenizers",
        "safetensors",  # Hugging Face checkpoint folders (models.hf_checkpoint)
        "tqdm",
        "matplotlib",
        "scipy",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "ruff"],
        # tests/test_hf_sources.py and test_gguf_families.py build tiny transformers models to check the families
        # against (skipped without them). Never a runtime dependency: models.load reads a
        # checkpoint folder with safetensors and tokenizers alone. The exact torch pin: see
        # constraints.txt.
        "hf": ["torch==2.13.0", "transformers", "safetensors", "accelerate"],
        # Compile-only TPU and CUDA devices (docs/kernels.md). `make test` installs the same
        # packages into .venv-compile instead: in an environment they log at every jax start-up.
        "compile": ["libtpu", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"],
        # launch.serve (the OpenAI-compatible server) and its tests and bench (experiments/bench_serve.py:
        # the `openai` client, which brings httpx2). `make test` installs it.
        "serve": ["starlette", "uvicorn", "pydantic", "prometheus-client", "openai"],
        # Only for recording reference fixtures (scripts/record_fixtures.py); never for tests.
        "reference": ["torch==2.13.0", "transformers", "accelerate"],
    },
)
