from setuptools import find_packages, setup

setup(
    name="spec-jax",
    version="0.1.0",
    description="Speculative decoding in JAX: exact, batched, compiled, sharded.",
    python_requires=">=3.11",
    packages=find_packages(include=["spec_jax*", "models*", "training*", "experiments*", "launch*"]),
    # Files the code opens beside itself (grep __file__): the kernels' C++ sources, compiled on
    # first use (models/kernels/cpu_matmul.py, gguf_matmul.py). tests/test_install.py checks the
    # wheel holds every one.
    package_data={
        "models.kernels": ["*.cc", "*.h"],
        "experiments": ["prompts/*.jsonl", "prompts/*.txt", "prompts/workloads/*.jsonl"],
    },
    # Builds this machine's CPU kernels now rather than in the first run (ggml from llama.cpp's
    # source in the registry's sdist with cmake, the GGUF kernel, the int8 kernel): what `make
    # demo` / `make test` start after installing. Not a step of `pip install` itself: the build
    # is native to the CPU and cached per user (models/kernels/build.py says why).
    entry_points={"console_scripts": ["spec-jax-build-kernels = models.kernels.build:cli"]},
    # What the main job (launch.generate, launch.train, models, spec_jax) imports.
    install_requires=[
        "jax",
        "flax",
        "optax",
        "orbax-checkpoint",
        "numpy",
        "absl-py",
        "ml_collections",
        "gguf",
        "jinja2>=3.1.6",  # chat templates (models.tokenizer); older versions have sandbox escapes
        "tokenizers",
        "safetensors",  # Hugging Face checkpoint folders (models.hf_checkpoint)
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "ruff", "chex", "lm-eval[api]"],  # tests/test_lm_eval.py
        # The experiments' plots and statistics (launch.experiment, launch.bench).
        "experiments": ["matplotlib", "scipy"],
        # A Hugging Face hub id as --target / --draft (models.sources.fetch_hub).
        "hub": ["huggingface_hub"],
        # tests/test_hf_sources.py and test_gguf_families.py build tiny transformers models to check the families
        # against (skipped without them). Never a runtime dependency: models.load reads a
        # checkpoint folder with safetensors and tokenizers alone. The exact torch pin: see
        # constraints.txt.
        "hf": ["torch==2.13.0", "transformers", "safetensors", "accelerate"],
        # Compile-only TPU and CUDA devices (docs/kernels.md). `make test` installs the same
        # packages into .venv-compile instead: in an environment they log at every jax start-up.
        "compile": ["libtpu", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"],
        # Accelerators (docs/usage.md, "On a GPU or a TPU"): `make test PLATFORM=cuda` / `PLATFORM=tpu`
        # install one of these beside the rest. cuda: the jax CUDA 12 plugin at the pinned jax's
        # version, with NVIDIA's CUDA libraries as wheels; tpu: jax's own tpu extra (libtpu).
        "cuda": ["jax[cuda12]", "jax-cuda12-plugin", "jax-cuda12-pjrt"],
        "tpu": ["jax[tpu]", "libtpu"],
        # launch.serve (the OpenAI-compatible server) and its tests and bench (experiments/bench_serve.py:
        # the `openai` client, which brings httpx2). `make test` installs it.
        "serve": ["starlette", "uvicorn", "pydantic", "prometheus-client", "openai"],
        # Only for recording reference fixtures (scripts/record_fixtures.py); never for tests.
        "reference": ["torch==2.13.0", "transformers", "accelerate"],
    },
)
