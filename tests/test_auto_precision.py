"""What `auto` precision means on each platform (models.precision.choose_auto, models.auto_precision).

The platform is passed in, so the TPU and GPU decisions are checked without the hardware: on an
accelerator `auto` is the checkpoint's own numbers, never int8; on a CPU it is the fastest, and
a checkpoint folder's int8 comes with one line naming the flag for its own precision.
"""

import json
import struct

import pytest

import models
from models import precision
from models.precision import choose_auto

ACCELERATORS = ("gpu", "tpu")


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize(
    "stored, expected", [("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32")]
)
def test_an_accelerator_runs_a_folder_at_the_precision_that_holds_its_stored_dtype(
    platform, stored, expected
):
    choice = choose_auto(platform, "folder", stored)
    assert choice == precision.AutoPrecision(expected, ""), "the checkpoint's own numbers need no note"


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_runs_a_folder_of_unknown_dtype_at_bfloat16_and_says_so(platform):
    choice = choose_auto(platform, "folder", None, flag="--target_dtype")
    assert choice.precision == "bfloat16"
    assert "not known" in choice.note and "\n" not in choice.note


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_runs_a_gguf_at_bfloat16_stating_why_and_the_flags_for_blocks_and_int8(platform):
    """No Pallas GGUF block product: the blocks would be dequantized by XLA in every step."""
    assert platform not in precision.FAST_BLOCK_PLATFORMS
    choice = choose_auto(platform, "gguf", gguf_kernel=True, flag="--target_dtype")
    assert choice.precision == "bfloat16"
    assert "--target_dtype=gguf" in choice.note and "--target_dtype=int8" in choice.note
    assert platform.upper() in choice.note and "\n" not in choice.note


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("kind", precision.SOURCE_KINDS)
@pytest.mark.parametrize("batch, devices", [(1, 1), (8, 1), (1, 8)])
def test_auto_is_never_int8_on_an_accelerator(platform, kind, batch, devices):
    stored = "bfloat16" if kind == "folder" else None
    choice = choose_auto(platform, kind, stored, batch=batch, devices=devices, gguf_kernel=True)
    assert choice.precision not in ("int8", "gguf_q8")


def test_a_cpu_runs_a_folder_at_int8_with_one_line_naming_the_flag_for_its_own_precision():
    choice = choose_auto("cpu", "folder", "bfloat16", flag="--draft_dtype")
    assert choice.precision == "int8"
    assert "--draft_dtype=bfloat16" in choice.note and "\n" not in choice.note
    assert "--draft_dtype=float32" in choose_auto("cpu", "folder", "float32", flag="--draft_dtype").note


@pytest.mark.parametrize(
    "kernel, multirow, batch, devices, expected",
    [
        (True, False, 1, 1, "gguf_q8"),
        (True, True, 4, 1, "gguf_q8"),
        (True, False, 4, 1, "int8"),  # one ggml product per row: int8's kernel reads each weight once
        (True, True, 1, 8, "int8"),  # a mesh: XLA's products
        (False, False, 1, 1, "int8"),  # no GGUF kernel: the blocks would dequantize in XLA
    ],
)
def test_a_cpu_runs_a_gguf_at_its_blocks_where_the_kernel_is_fastest(
    kernel, multirow, batch, devices, expected
):
    choice = choose_auto(
        "cpu", "gguf", batch=batch, devices=devices, gguf_kernel=kernel, gguf_multirow=multirow
    )
    assert choice == precision.AutoPrecision(expected, "")


def test_a_random_preset_is_int8_on_a_cpu_and_bfloat16_on_an_accelerator():
    assert choose_auto("cpu", "random").precision == "int8"
    assert choose_auto("gpu", "random") == precision.AutoPrecision("bfloat16", "")


def test_a_bad_platform_or_kind_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"platform must be one of \('cpu', 'gpu', 'tpu'\), got 'cuda'"):
        choose_auto("cuda", "folder")
    with pytest.raises(ValueError, match=r"kind must be one of .*'folder'.*, got 'hf'"):
        choose_auto("gpu", "hf")


def _folder(tmp_path, config: dict, tensor_dtype: str | None = None):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    if tensor_dtype is not None:
        header = json.dumps({"w": {"dtype": tensor_dtype, "shape": [1], "data_offsets": [0, 4]}}).encode()
        (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return str(tmp_path)


def test_auto_precision_reads_a_folders_stored_dtype_from_its_config_or_its_first_tensor(tmp_path):
    assert (
        models.auto_precision(_folder(tmp_path, {"torch_dtype": "bfloat16"}), platform="gpu").precision
        == "bfloat16"
    )
    assert (
        models.auto_precision(_folder(tmp_path, {"dtype": "float32"}), platform="tpu").precision == "float32"
    )
    folder = _folder(tmp_path, {}, tensor_dtype="F32")  # no dtype in config.json: the header's
    assert models.auto_precision(folder, platform="gpu") == precision.AutoPrecision("float32", "")
    cpu = models.auto_precision(folder, platform="cpu", flag="--target_dtype")
    assert cpu.precision == "int8" and "--target_dtype=float32" in cpu.note


def test_auto_precision_of_a_registry_gguf_on_an_accelerator_is_bfloat16_and_fastest_precision_agrees():
    choice = models.auto_precision("qwen2.5-coder-1.5b", platform="gpu")
    assert choice.precision == "bfloat16" and choice.note
    assert models.fastest_precision("qwen2.5-coder-1.5b", platform="tpu") == "bfloat16"
    assert models.fastest_precision("random", platform="gpu") == "bfloat16"
