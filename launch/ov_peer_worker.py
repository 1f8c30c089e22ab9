"""The OpenVINO GenAI side of `launch.bench --suite=peer`: loads once, then serves JSON lines.

Runs in the reference interpreter (`.venv-ref` with openvino-genai, gguf, numpy; no jax),
started by experiments/bench_peer.py as a subprocess; the protocol, the common flags and the
`--fake` backend are launch/peer_protocol.py's:

    .venv-ref/bin/python -m launch.ov_peer_worker --target=T.gguf --draft=D.gguf --threads=2 \\
        --num_assistant_tokens=4

OpenVINO GenAI reads the target's GGUF file itself (`openvino_genai.LLMPipeline(path.gguf,
"CPU")`: it builds the model graph, keeps the quantized weights compressed, and makes the
tokenizer from the GGUF vocabulary). The draft needs two detours, taken once and cached beside
the draft's GGUF (`draft_for_openvino`, written atomically): `openvino_genai.draft_model` reads
only OpenVINO IR folders, and the GGUF reader rejects the draft's Q5_0 tensors; so the worker
writes a copy of the draft GGUF with those tensors requantized to Q8_0 (the gguf library), has
OpenVINO GenAI build its model from that copy and serialize it as IR (`enable_save_ov_model`),
and loads the draft from there. Two pipelines share the process: the target alone (plain), and
the target with the draft (speculative, `num_assistant_tokens` drafts per round, fixed: the
continuous-batching pipeline a scheduler config selects does not adapt it). Both get a
SchedulerConfig with enable_prefix_caching = False, so that a repeated prompt is recomputed,
not served from the prefix cache, and INFERENCE_NUM_THREADS = --threads.
Greedy (do_sample=False), ignore_eos=True so every run generates exactly max_new_tokens.
Requests are token ids (the same ids every system gets), fed as an input_ids tensor.
"""

import fcntl
import importlib.metadata
import os
import pathlib
import shutil
import sys
import tempfile

import gguf
import numpy as np
from gguf import GGMLQuantizationType, quants

from launch import peer_protocol

# GGUF tensor types OpenVINO GenAI 2026.4's GGUF reader loads (as they are: F32, F16; unpacked:
# Q4_0, Q4_1, Q4_K, Q6_K, Q8_0). Tensors of any other type are requantized to Q8_0.
OPENVINO_GGUF_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"})


def draft_folder(path: str | os.PathLike) -> pathlib.Path:
    """Where draft_for_openvino caches its work for the GGUF `path`: the folder `NAME.openvino`
    beside it."""
    path = pathlib.Path(path)
    return path.with_name(path.name.removesuffix(".gguf") + ".openvino")


def requantize_gguf(src, dst, keep=OPENVINO_GGUF_TYPES) -> int:
    """Writes `dst`: the GGUF `src` with every tensor whose type is not in `keep` dequantized
    and requantized to Q8_0; other tensors, every metadata key (tokenizer included) and the
    tensor order unchanged. Returns how many tensors were requantized."""
    q8 = GGMLQuantizationType.Q8_0
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # GGUF.* are the reader's virtual fields; the writer adds the architecture itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field.contents()))
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)

    def element_shape(tensor):  # numpy order; the reader gives quantized rows as uint8 bytes
        if tensor.data.dtype == np.uint8:
            return quants.quant_shape_from_byte_shape(tensor.data.shape, tensor.tensor_type)
        return tensor.data.shape

    requantized = [t.tensor_type.name not in keep for t in reader.tensors]
    for tensor, convert in zip(reader.tensors, requantized, strict=True):
        if convert:
            shape = quants.quant_shape_to_byte_shape(element_shape(tensor), q8)
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.uint8), int(np.prod(shape)), q8)
        else:
            data = tensor.data
            writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, convert in zip(reader.tensors, requantized, strict=True):
        if convert:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
            writer.write_tensor_data(quants.quantize(values, q8))
        else:
            writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return sum(requantized)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def draft_for_openvino(path: str | os.PathLike, export) -> pathlib.Path:
    """A folder `openvino_genai.draft_model` can load, holding the draft GGUF `path`'s weights.

    draft_model() reads only OpenVINO IR folders, not GGUF files, and the GGUF reader rejects
    some tensor types; so, once, in a temporary folder beside `path`: write NAME.q8_0.gguf
    (`path` with those tensors requantized to Q8_0, requantize_gguf), then `export(that gguf)`
    (OpenVINOBackend's: an LLMPipeline with enable_save_ov_model, which serializes the model it
    builds from the GGUF, tokenizer included, into the GGUF's folder), then rename the folder into
    place (draft_folder(path)), so a folder at the final path is whole. Returns that folder."""
    path = pathlib.Path(path)
    final = draft_folder(path)
    if (final / "openvino_model.xml").exists():
        return final
    # One exporter at a time (an flock beside the folder, as models.registry.file_lock: this
    # worker runs in the peers' environment, without spec-jax's packages); leftovers of a killed
    # export (their pid in the name, as models.registry.tmp_prefix) are removed under it.
    with open(final.parent / f".lock-{final.name}", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "openvino_model.xml").exists():
            return final
        for old in final.parent.glob(f".tmp-{final.name}-*"):
            pid = old.name.removeprefix(f".tmp-{final.name}-").split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-{os.getpid()}-", dir=final.parent))
        try:
            converted = tmp / (path.name.removesuffix(".gguf") + ".q8_0.gguf")
            count = requantize_gguf(path, converted)
            export(converted)
            if not (tmp / "openvino_model.xml").exists():
                raise RuntimeError(f"exporting {converted.name} wrote no openvino_model.xml")
            tmp.chmod(0o755)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"ov_peer_worker: {path.name} ({count} tensors requantized to Q8_0) exported to {final}",
        file=sys.stderr,
    )
    return final


class OpenVINOBackend:
    """Two LLMPipelines on the CPU: the target alone, and the target with the draft model."""

    def __init__(self, target_gguf: str, draft_gguf: str, threads: int, num_assistant_tokens: int):
        # Optional dependency, imported late: OpenVINO is this peer's own environment's alone and
        # may be missing where the bench runs the worker with --fake (or tests read its GGUF steps).
        import openvino
        import openvino_genai

        self.ov, self.ov_genai, self.threads = openvino, openvino_genai, threads
        self.num_assistant_tokens = num_assistant_tokens
        self.draft_path = draft_for_openvino(draft_gguf, export=self.export_ir)
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False  # a repeated prompt must cost what a new one does
        properties = {"INFERENCE_NUM_THREADS": threads}
        self.plain = openvino_genai.LLMPipeline(
            str(target_gguf), "CPU", scheduler_config=scheduler, **properties
        )
        draft = openvino_genai.draft_model(str(self.draft_path), "CPU", **properties)
        self.speculative = openvino_genai.LLMPipeline(
            str(target_gguf), "CPU", draft_model=draft, scheduler_config=scheduler, **properties
        )

    def export_ir(self, gguf_path: pathlib.Path) -> None:
        """draft_for_openvino's export: OpenVINO GenAI builds the model from `gguf_path` and
        serializes it as IR into its folder."""
        self.ov_genai.LLMPipeline(str(gguf_path), "CPU", enable_save_ov_model=True)

    def info(self) -> dict:
        core = self.ov.Core()
        return {
            "versions": {
                "python": sys.version.split()[0],
                "openvino": self.ov.get_version(),
                "openvino_genai": importlib.metadata.version("openvino-genai"),
                "gguf": importlib.metadata.version("gguf"),
            },
            "threads": self.threads,
            "num_assistant_tokens": self.num_assistant_tokens,
            "prefix_caching": False,
            "draft_model": self.draft_path.name,
            # Weights stay as quantized in the GGUF files; the CPU plugin's defaults on this machine
            # say what it computes activations in and what the KV cache holds.
            "precision": f"GGUF weights, {core.get_property('CPU', 'INFERENCE_PRECISION_HINT').to_string()} compute",
            "kv_cache_precision": core.get_property("CPU", "KV_CACHE_PRECISION").to_string(),
        }

    def generate(self, request: peer_protocol.Request) -> dict:
        config = self.ov_genai.GenerationConfig()
        config.max_new_tokens = request.max_new_tokens
        config.do_sample = False
        config.ignore_eos = True  # never stop early: exactly max_new_tokens
        config.apply_chat_template = False
        pipe = self.plain
        if request.speculative:  # --num_assistant_tokens; request.draft_max is not used
            config.num_assistant_tokens = self.num_assistant_tokens
            pipe = self.speculative
        ids = np.asarray([request.prompt], dtype=np.int64)
        inputs = self.ov_genai.TokenizedInputs(self.ov.Tensor(ids), self.ov.Tensor(np.ones_like(ids)))
        return {"tokens": list(pipe.generate(inputs, config).tokens[0])}


def add_arguments(parser) -> None:
    parser.add_argument("--num_assistant_tokens", type=int, default=4, help="drafts per round (gamma)")


def make_backend(args) -> OpenVINOBackend:
    return OpenVINOBackend(args.target, args.draft, args.threads, args.num_assistant_tokens)


if __name__ == "__main__":
    sys.exit(peer_protocol.main(__doc__, make_backend, add_arguments))
