"""Generate text with speculative decoding (or plain decoding with --draft=none).

Examples:
  python -m launch.generate --target=random --draft=random-draft --prompt="def f(x):"
  python -m launch.generate --prompts_file=prompts.jsonl --temperature=0 --compare_autoregressive
  python -m launch.generate --chat --prompt="Reverse a string in Python."  # the target's chat template
  python -m launch.generate --stream --prompts_file=prompts.jsonl --batch_size=4  # text as it comes (spec_jax.engine)
  python -m launch.generate --drafter=hybrid --max_ngram=3 --draft_threshold=0.3 ...  # lookup, then the model
  python -m launch.generate --drafter=suffix --draft_threshold=0.4 ...   # no model: text seen before
  python -m launch.generate --mesh=data:2,model:4 ...             # tensor + data parallel
  python -m launch.generate --mesh=auto --distributed ...           # every host of a Cloud TPU pod
  python -m launch.generate --mesh=data:2,model:4 --coordinator_address=10.0.0.2:8476 \
      --num_processes=2 --process_id=0 ...                          # one process per host

Multi-host: every process runs the same command (only --process_id differs, or nothing on a
Cloud TPU VM, where jax.distributed.initialize() finds its peers); only process 0 prints and
writes --output_json.

Compiled programs are kept in $SPEC_JAX_CACHE/compilation/ and loaded by later runs instead of
compiled again; --nocompilation_cache (see --helpfull) or SPEC_JAX_COMPILATION_CACHE=0 turns
that off.

Bad flags and bad input exit with code 2 and one line on stderr; the flags (model names, the
warp, --gamma against the context, the prompts file, --output_json) are checked before any model
is loaded or downloaded, --gamma's bound once the target's context is known. A prompt whose target
logits become NaN or infinite stops there: one warning line on stderr names it, and its entry in
--output_json says "nonfinite_logits": true (the other prompts' outputs are unaffected).
"""

import builtins
import contextlib
import dataclasses
import functools
import json
import os
import socket
import sys
import threading
import time

import jax
from absl import flags

import models
import spec_jax
from launch import common, runtime
from models import config as model_config
from models import kernels, precision, registry
from models.precision import PRECISIONS
from models.tokenizer import check_pair, validate_messages
from spec_jax import drafting, metrics, sampling, sharding
from spec_jax import engine as engine_lib
from spec_jax.drafting.build import DRAFTERS
from spec_jax.drafting.lookup import MAX_NGRAM_LIMIT
from spec_jax.request import MAX_TREE_NODES, Request, speculation_bound, validate
from spec_jax.rows import stream_context

# Every import is at the top: the flags' own choices (DRAFTERS, MAX_NGRAM_LIMIT, PRECISIONS) are
# the library's, and importing them imports jax, so importing the rest late would save nothing
# (--help: a median of 1.9 s wall, 1.2 s CPU, on the 2-core EPYC with these imports at the top or
# inside the functions, measured).
FLAGS = flags.FLAGS

flags.DEFINE_string(
    "target",
    "qwen2.5-coder-1.5b",
    "Target model: a name (models.known_models()), a local .gguf file, a Hugging Face checkpoint "
    "folder or a hub id (org/name).",
)
flags.DEFINE_string(
    "draft",
    "qwen2.5-coder-0.5b",
    "Draft model (the forms --target takes), or 'none' for plain autoregressive decoding.",
)
flags.DEFINE_enum(
    "drafter",
    "model",
    list(DRAFTERS),
    "What drafts: model (--draft), head (a draft head trained on the target's features with "
    "python -m launch.train, from --head_dir; one decoder layer, EAGLE-style), prompt_lookup (copies the continuation of the last --max_ngram "
    "tokens' latest earlier occurrence in the prompt + output; no model), suffix (samples the "
    "continuation of the longest suffix seen before, in the prompt + output or in the code and news "
    "training corpora, from its counts; no model), hybrid (prompt lookup, "
    "and --draft where it finds nothing, per row and round), unigram / bigram (tables fitted on "
    "the training split of the code and news corpora).",
)
flags.DEFINE_string(
    "head_dir",
    None,
    "--drafter=head: the training workdir of the head (default $SPEC_JAX_CACHE/heads/TARGET/); its "
    "best checkpoint is used, at --draft_dtype.",
)
flags.DEFINE_bool(
    "acceptance_head",
    False,
    "--drafter=head: also its acceptance head (trained with launch/configs/acceptance_head.py), which "
    "stops each row's draft where a rejection becomes likely; --gamma is then the most it drafts.",
)
flags.DEFINE_integer(
    "max_ngram",
    3,
    "prompt_lookup / suffix / hybrid: the longest suffix matched (then shorter, down to 1).",
    lower_bound=1,
    upper_bound=MAX_NGRAM_LIMIT,
)
flags.DEFINE_float(
    "draft_threshold",
    0.0,
    "model / head / hybrid / suffix: a row stops drafting at the first position where the draft's top "
    "probability (suffix: the top successor's frequency) is below this (per-row adaptive draft "
    "length; 0 = always gamma), in [0, 1).",
)
flags.DEFINE_string(
    "gamma",
    "auto",
    "Draft tokens per round: an integer >= 1, or 'auto' (chosen per chunk of rounds, 0..8, from the "
    "measured time of whole rounds and each row's running acceptance; 0 = plain decoding where "
    "drafting does not pay, tried again later; the draft and verify calls are measured once per "
    "machine and pair, and cached).",
)
flags.DEFINE_string(
    "tree",
    "0",
    "Verify a token tree of up to this many candidate tokens per round, in one target call with a "
    "tree mask (spec_jax.tree), instead of a chain of --gamma drafts: 0 = chains (the default), "
    "1..31 nodes, or 'auto' (chosen per chunk of rounds among plain decoding, chains of 1..8 drafts "
    "and trees of 4, 8 and 16 nodes, by expected tokens per second from the measured costs and the "
    "running acceptance; --gamma is then auto too, whatever it says). Each drafter proposes its own "
    "kind of tree (by default its chain of that many drafts); the output is exactly the target's "
    "either way.",
)
flags.DEFINE_float(
    "temperature",
    0.0,
    "Sampling temperature; 0 is greedy, any positive value samples (values below float32's smallest "
    "normal number, 1.2e-38, act as that number: the same distribution).",
    lower_bound=0.0,
)
flags.DEFINE_integer("top_k", 0, "Keep the k most probable tokens (0 = off).", lower_bound=0)
flags.DEFINE_float("top_p", 1.0, "Keep the smallest set of tokens reaching this mass, in (0, 1].")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.", lower_bound=1)
flags.DEFINE_integer(
    "seed",
    0,
    "Random seed: prompt i of the file draws from (seed, i) alone, whatever --batch_size is.",
    lower_bound=-(2**63),
    upper_bound=2**63 - 1,  # jax.random.key takes a 64-bit seed
)
flags.DEFINE_string("prompt", None, "A prompt text.")
flags.DEFINE_string(
    "prompts_file",
    None,
    'JSON Lines file, one object per line: {"prompt": TEXT}, or {"messages": [{"role": ROLE, '
    '"content": TEXT}, ...]}, a conversation always rendered with the target\'s chat template.',
)
flags.DEFINE_bool(
    "chat",
    False,
    "Each --prompt / prompts-file prompt is one user message, rendered with the target's chat "
    "template (a GGUF's tokenizer.chat_template) with the assistant's turn opened, as transformers' "
    "apply_chat_template renders it; the text is tokenized without adding a BOS (the template "
    "writes the one the model expects). A model without a template is refused.",
)
flags.DEFINE_integer("batch_size", 1, "Prompts decoded together in one batch.", lower_bound=1)
flags.DEFINE_bool(
    "compare_autoregressive",
    False,
    "Also run plain decoding of the target; report the speedup and whether outputs match (both "
    "modes are run once on the first batch first, untimed, so neither pays the first execution).",
)
flags.DEFINE_bool(
    "stream",
    False,
    "Print each prompt's text as it comes (the prompts run on spec_jax.engine.Engine, --batch_size "
    "rows at a time, a finished row's slot taken by the next prompt at once); the output is the "
    "same as without --stream.",
)
flags.DEFINE_string("output_json", None, "Write tokens, text and stats here.")
flags.DEFINE_string(
    "stop_ids",
    "auto",
    "Token ids that end a row: 'auto' (the target tokenizer's end-of-generation set: eos, eot and "
    "the family's end tokens such as <|endoftext|> and <|im_end|>), 'none', or comma-separated ids.",
)
flags.DEFINE_bool(
    "skip_special_tokens", True, "Print and write text without special tokens (the token ids keep them)."
)
flags.DEFINE_enum(
    "target_dtype",
    "auto",
    ["auto", *PRECISIONS],
    "Target weight precision (models.precision): float32; bfloat16 weights and activations; int8 "
    "weights with a float32 scale per output unit; gguf: the GGUF file's own blocks (Q4_K, Q6_K, "
    "...) with float32 activations (the file's numbers); gguf_q8: the same blocks with 8-bit "
    "activations and integer dot products (as llama.cpp runs them). auto (models.auto_precision): "
    "on a TPU or GPU the checkpoint's own precision (a folder's stored dtype; bfloat16 for a GGUF, "
    "which has no fast block product there); on a CPU the fastest: gguf_q8 for a registry model "
    "or GGUF file on one CPU whose GGUF kernel builds (at batch > 1 only with its AVX-512 VNNI "
    "multi-row build), else int8 (said in one line for a checkpoint folder). Output is exact for "
    "the target at this precision.",
)
flags.DEFINE_enum(
    "draft_dtype",
    "auto",
    ["auto", *PRECISIONS],
    "Draft weight precision (as --target_dtype; auto: int8 for a trained head); it changes speed "
    "and acceptance, never the output.",
)
AUTO_DRAFT_VOCAB = 32768
flags.DEFINE_string(
    "draft_vocab",
    "auto",
    "VocabTrim: the draft proposes only this many tokens (the most frequent of the code and news "
    "training corpora, plus the stop tokens; counted once and cached), so its output head costs "
    "that share of the full one. Exact for any value; 0 = the full vocabulary; 'auto' = "
    f"{AUTO_DRAFT_VOCAB} where the draft's vocabulary is larger (the measured default), else 0.",
)
flags.DEFINE_enum(
    "matmul_impl",
    "auto",
    ["auto", "xla", "cpu_kernel"],
    "Matrix products: auto (this project's CPU kernel on an x86-64 AVX2 CPU in programs for a CPU, "
    "else XLA), xla, cpu_kernel.",
)
flags.DEFINE_string("attention_impl", "auto", "Attention implementation (see models.kernels.IMPLS).")

flags.DEFINE_string(
    "mesh", None, "Device mesh, e.g. 'data:2,model:4' or 'auto' (all devices on model); unset: one device."
)
flags.DEFINE_bool(
    "distributed",
    False,
    "Call jax.distributed.initialize() (auto-detects peers on Cloud TPU VMs); implied by the next three flags.",
)
flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0's coordinator.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes (one per host).", lower_bound=1)
flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index in [0, num_processes).", lower_bound=0
)
flags.DEFINE_integer(
    "initialization_timeout", 300, "Seconds to wait for the coordinator and every process.", lower_bound=1
)

DEFAULT_PROMPT = "def fibonacci(n):\n    "

flags.register_validator("top_p", lambda v: 0.0 < v <= 1.0, message="--top_p must be in (0, 1]")
flags.register_validator(
    "draft_threshold", lambda v: 0.0 <= v < 1.0, message="--draft_threshold must be in [0, 1)"
)
flags.register_validator("target", lambda v: v != "none", message="--target cannot be 'none'")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: a text, or a conversation (`messages`) that the target's chat template renders."""

    text: str | None = None
    messages: tuple | None = None  # validated {"role", "content"} dicts
    where: str = "--prompt"  # what names it in an error: "--prompt", "--prompts_file line 3"

    @property
    def shown(self) -> str:
        """What the output names it by: the text, or the conversation's last message."""
        return self.text if self.messages is None else self.messages[-1]["content"]


def _as_chat(prompt: Prompt) -> Prompt:
    """--chat: a text prompt as one user message."""
    if prompt.messages is not None:
        return prompt
    return Prompt(messages=({"role": "user", "content": prompt.text},), where=prompt.where)


def read_prompts() -> list[Prompt]:
    """--prompt or --prompts_file as Prompts (with --chat, each text a user message); UsageError
    naming the flag (and the file's line) on bad input."""
    if FLAGS.prompt is not None and FLAGS.prompts_file is not None:
        raise common.UsageError("give --prompt or --prompts_file, not both")
    if FLAGS.prompts_file is not None:
        prompts = _read_prompts_file()
    else:
        prompts = [Prompt(text=DEFAULT_PROMPT if FLAGS.prompt is None else FLAGS.prompt)]
    return [_as_chat(p) for p in prompts] if FLAGS.chat else prompts


def _read_prompts_file() -> list[Prompt]:
    if not os.path.exists(FLAGS.prompts_file) or os.path.isdir(FLAGS.prompts_file):
        raise common.UsageError(f"--prompts_file: no such file: {FLAGS.prompts_file}")
    prompts = []
    with open(FLAGS.prompts_file, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise common.UsageError(
                    f"--prompts_file {FLAGS.prompts_file} line {number}: not UTF-8 "
                    f"(byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise common.UsageError(f"--prompts_file line {number}: not JSON ({e.msg})") from None
            where = f"--prompts_file line {number}"
            if isinstance(record, dict) and "prompt" in record and "messages" in record:
                raise common.UsageError(f'{where}: has both "prompt" and "messages"; give one')
            if isinstance(record, dict) and "messages" in record:
                try:
                    messages = validate_messages(record["messages"])
                except ValueError as e:
                    raise common.UsageError(f"{where}: {e}") from None
                prompts.append(Prompt(messages=tuple(messages), where=where))
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                prompts.append(Prompt(text=record["prompt"], where=where))
            else:
                raise common.UsageError(f'{where}: needs a string "prompt" field or a "messages" list')
    if not prompts:
        raise common.UsageError(f"--prompts_file: {FLAGS.prompts_file} has no prompts")
    return prompts


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise common.UsageError(f"--coordinator_address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _wait_for_coordinator(host: str, port: int, timeout: float) -> None:
    """Polls the coordinator's port until it accepts a connection; UsageError after timeout.

    jax.distributed.initialize aborts the process (no exception) when the coordinator never
    answers, so a non-zero process checks reachability itself first, within the same timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(
                (host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))
            ):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise common.UsageError(
                    f"coordinator {host}:{port} unreachable after {timeout} s ({e.strerror or e}); "
                    "is process 0 running, and is --coordinator_address its address?"
                ) from None
            time.sleep(0.2)


def init_distributed() -> None:
    """jax.distributed.initialize from the flags (a no-op without any of them)."""
    explicit = [FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id]
    if not FLAGS.distributed and all(v is None for v in explicit):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; other backends ignore it
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise common.UsageError("--coordinator_address, --num_processes and --process_id go together")
        if FLAGS.process_id >= FLAGS.num_processes:
            raise common.UsageError(
                f"--process_id={FLAGS.process_id} must be below --num_processes={FLAGS.num_processes}"
            )
        host, port = _parse_address(FLAGS.coordinator_address)
        if FLAGS.process_id != 0:
            _wait_for_coordinator(host, port, FLAGS.initialization_timeout)
    jax.distributed.initialize(
        coordinator_address=FLAGS.coordinator_address,
        num_processes=FLAGS.num_processes,
        process_id=FLAGS.process_id,
        initialization_timeout=FLAGS.initialization_timeout,
    )


def load_model(name: str, dtype: str, batch: int = 1, mesh=None, flag: str = "--target_dtype"):
    """models.load at dtype (auto: models.auto_precision for this batch and device count; its
    note, where it has one, is one line on stderr naming `flag`), with the --attention_impl and
    --matmul_impl flags; placed on `mesh` as it is read (each process reads only its own shards)."""
    devices = 1 if mesh is None else mesh.devices.size

    if dtype == "auto":
        if name in registry.MODELS:  # the weights first: their download's error is reported
            registry.fetch_gguf(name)
        auto = models.auto_precision(name, batch, devices, flag=flag)
        if auto.note and jax.process_index() == 0:
            print(auto.note, file=sys.stderr)
        dtype = auto.precision
    place = None if mesh is None else (lambda params: sharding.place_params(params, mesh))
    model = models.load(name, dtype=dtype, place=place)
    config = dataclasses.replace(
        model.config, attention_impl=FLAGS.attention_impl, matmul_impl=FLAGS.matmul_impl
    )
    return model.replace(config=config)


def stop_ids_from_flag(tokenizer, vocab_size: int) -> list[int]:
    """--stop_ids as a list of token ids; UsageError naming the flag on bad values."""
    text = FLAGS.stop_ids.strip()
    if text == "auto":
        return list(getattr(tokenizer, "stop_ids", ()))
    if text == "none":
        return []
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise common.UsageError(
            f"--stop_ids must be 'auto', 'none' or comma-separated integers, got {FLAGS.stop_ids!r}"
        ) from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise common.UsageError(f"--stop_ids: each id must be in [0, {vocab_size}), got {bad[0]}")
    return ids


def draft_vocab_from_flag(vocab: int) -> int:
    """--draft_vocab as a token count (0: the full vocabulary) for a draft of `vocab` tokens."""
    text = FLAGS.draft_vocab.strip()
    if text == "auto":
        return AUTO_DRAFT_VOCAB if vocab > AUTO_DRAFT_VOCAB else 0
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise common.UsageError(f"--draft_vocab must be 'auto', 0 or a positive token count, got {text!r}")
    return count


def build_draft(target, draft, stop_ids, draft_vocab: int):
    """What generate's `draft` gets for --drafter (spec_jax.drafting.build; None: plain decoding,
    --drafter=model --draft=none); UsageError naming the flag on a bad value."""
    if FLAGS.drafter == "model" and draft is None:
        return None
    settings = drafting.Settings(
        draft=draft,
        draft_vocab=draft_vocab,
        stop_ids=stop_ids,
        max_ngram=FLAGS.max_ngram,
        threshold=FLAGS.draft_threshold,
        corpus=True,
        head_dir=FLAGS.head_dir,
        head_dtype="int8" if FLAGS.draft_dtype == "auto" else FLAGS.draft_dtype,
        acceptance=FLAGS.acceptance_head,
    )
    try:
        return drafting.build(FLAGS.drafter, target, settings)
    except ValueError as e:  # a setting's own flag, or the drafter's data (a trained head)
        where = "" if str(e).startswith("draft_vocab") else f"drafter={FLAGS.drafter}: "
        raise common.UsageError(f"--{where}{e}") from None


def check_model_names() -> None:
    """--target and --draft name models models.load takes (models.check_source: a name, a GGUF
    file, a checkpoint folder or a hub id; before anything is loaded or downloaded)."""
    for flag, name in (("--target", FLAGS.target), ("--draft", FLAGS.draft)):
        if not (flag == "--draft" and name == "none"):
            runtime.check_model_flag(flag, name)


def check_sampling_flags() -> None:
    """--temperature, --top_k and --top_p by the warp's own rule (spec_jax.sampling), before
    anything is loaded: the flags' bounds let nan and inf through."""
    try:
        sampling.validate_sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    except ValueError as e:
        raise common.UsageError(f"--{e}") from None


def check_gamma_fits(token_prompts, contexts: dict[str, int]) -> None:
    """--gamma within the one bound every drafter has (spec_jax.drafting.check_gamma): prompt +
    --max_new_tokens + gamma within each context of `contexts` (the target's, and a draft
    model's once loaded), checked before the draft model and the drafters' tables are loaded.
    How far a round may write (--gamma, --tree) is spec_jax.request.speculation_bound's rule."""
    gamma, shown, name = speculation_bound(
        gamma_from_flag(), tree_from_flag(), gamma_name="--gamma", tree_name="--tree"
    )
    longest = max(len(p) for p in token_prompts)
    try:
        drafting.check_gamma(gamma, longest, FLAGS.max_new_tokens, contexts, name=name, shown=shown)
    except ValueError as e:
        raise common.UsageError(str(e)) from None


def report_nonfinite(stats, prompts) -> str | None:
    """The one-line warning naming the prompts whose target logits became NaN or infinite (each
    stopped there: its output is cut short), or None when there are none."""
    rows = metrics.nonfinite_rows(stats)
    if not rows:
        return None
    shown = ", ".join(f"{i} ({prompts[i][:30]!r})" for i in rows[:5]) + (", ..." if len(rows) > 5 else "")
    return (
        f"warning: the target's logits became NaN or infinite for {len(rows)} of {len(prompts)} "
        f"prompts (by index from 0: {shown}); each stopped there and its output is cut short "
        f"(check the --target weights and --target_dtype)"
    )


def int_or_auto(flag: str, low: int, high: int, allowed: str):
    """--FLAG as "auto" or an int in [low, high]; UsageError naming the flag and `allowed` otherwise."""
    text = FLAGS[flag].value.strip()
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise common.UsageError(f"--{flag} must be {allowed}, got {FLAGS[flag].value!r}")
    return value


def gamma_from_flag():
    """--gamma as an int >= 1 or "auto"; UsageError naming the flag otherwise."""
    return int_or_auto("gamma", 1, 2**31 - 1, "an integer >= 1 or 'auto'")


def tree_from_flag():
    """--tree as an int in [0, MAX_TREE_NODES] or "auto"; UsageError naming the flag otherwise."""
    return int_or_auto(
        "tree", 0, MAX_TREE_NODES, f"0 (chains), a node count in [1, {MAX_TREE_NODES}] or 'auto'"
    )


def run_batches(target, draft, token_prompts, stop_ids, mesh=None):
    """Decodes in batches of --batch_size (a smaller last batch compiles its own loop). Prompt i
    of the list draws from (--seed, i) alone, so outputs do not depend on the batch size."""
    outputs, stats = [], []
    size = FLAGS.batch_size
    for start in range(0, len(token_prompts), size):
        batch = token_prompts[start : start + size]
        gen = spec_jax.generate(
            target,
            batch,
            draft=draft,
            gamma=gamma_from_flag(),
            tree=tree_from_flag(),
            max_new_tokens=FLAGS.max_new_tokens,
            temperature=FLAGS.temperature,
            top_k=FLAGS.top_k,
            top_p=FLAGS.top_p,
            seed=FLAGS.seed,
            row_ids=range(start, start + len(batch)),
            eos_id=stop_ids,
            mesh=mesh,
        )
        outputs.extend(gen.tokens)
        stats.append(gen.stats)
    pooled = metrics.pool(stats)
    if "gamma_schedule" in stats[0]:  # --gamma=auto: [gamma or "treeN", rounds] chunks of each batch
        pooled["gamma_schedules"] = [s["gamma_schedule"] for s in stats]
    return outputs, pooled


def check_flags():
    """(mesh or None, prompt texts): every flag checked before anything is loaded or downloaded."""
    kernels.resolve_impl(FLAGS.attention_impl)  # fail fast on a bad name
    gamma_from_flag()
    tree = tree_from_flag()
    draft_vocab_from_flag(2**31 - 1)  # the syntax, before anything is loaded
    if FLAGS.stream and FLAGS.compare_autoregressive:
        raise common.UsageError("--stream and --compare_autoregressive cannot be combined")
    if FLAGS.acceptance_head and FLAGS.drafter != "head":
        raise common.UsageError("--acceptance_head needs --drafter=head")
    if tree and FLAGS.draft == "none" and FLAGS.drafter == "model":
        raise common.UsageError("--tree needs a drafter: --draft cannot be 'none' with --drafter=model")
    if FLAGS.drafter == "hybrid" and FLAGS.draft == "none":
        raise common.UsageError("--drafter=hybrid needs a draft model: --draft cannot be 'none'")
    mesh = sharding.make_mesh(FLAGS.mesh) if FLAGS.mesh else None
    prompts = read_prompts()
    if FLAGS.output_json is not None:
        common.check_output_json(FLAGS.output_json)
    check_model_names()
    check_sampling_flags()
    if any(name not in models.RANDOM_PRESETS for name in (FLAGS.target, FLAGS.draft) if name != "none"):
        # A real model is converted into the cache: an unwritable one is reported (exit 1, one
        # line) before the kernel build below, not after it.
        registry.ensure_writable(registry.cache_root())
    # Last, being the costly one (a cold build compiles the C++ kernel: seconds): a CPU kernel
    # that cannot be built, for the build a config made here names.
    precision.has_cpu_kernels(FLAGS.matmul_impl, model_config.this_cpu_isa())
    return mesh, prompts


def encode_prompts(tokenizer, prompts: list[Prompt]) -> tuple[list[list[int]], list[str]]:
    """(token ids, the text the model reads) of each prompt: a text as given (tokenizer.encode),
    a conversation rendered with the target's chat template and encoded with no BOS added
    (tokenizer.encode_chat: the template writes it). UsageError naming --target where it has
    no template, and the prompt where its template refuses the conversation."""
    token_prompts, texts = [], []
    for p in prompts:
        if p.messages is None:
            token_prompts.append(tokenizer.encode(p.text))
            texts.append(p.text)
            continue
        try:
            texts.append(tokenizer.apply_chat_template(list(p.messages)))
            token_prompts.append(tokenizer.encode_chat(list(p.messages)))
        except ValueError as e:
            if tokenizer.chat_template is None:
                needs = "--chat" if FLAGS.chat else f'the "messages" of {p.where}'
                raise common.UsageError(f"{needs}: --target={FLAGS.target}: {e}") from None
            raise common.UsageError(f"{p.where}: {e}") from None
    return token_prompts, texts


def prefetch_draft() -> threading.Thread | None:
    """Starts fetching --draft's GGUF in a background thread where it is a registry model whose
    file is not in the cache yet (announced in one line), so that its download overlaps the
    target's download and conversion. Returns the thread (None: nothing to fetch). load_model's
    own fetch then waits for it (the file's lock) and finds the file, or, where the background
    fetch failed, fetches it again and reports what goes wrong."""
    name = FLAGS.draft
    if FLAGS.drafter not in ("model", "hybrid") or name not in registry.MODELS:
        return None
    if registry.gguf_path(name).exists():
        return None
    size = registry.get_spec(name).size / 1e6
    print(
        f"fetching the draft {name} ({size:.0f} MB) in the background while the target is prepared",
        file=sys.stderr,
    )
    thread = threading.Thread(target=_fetch_quietly, args=(name,), daemon=True, name=f"prefetch {name}")
    thread.start()
    return thread


def _fetch_quietly(name: str) -> None:
    """registry.fetch_gguf without progress bars; an error is left to the fetch that follows."""
    with contextlib.suppress(Exception):  # load_model's fetch of the same file reports it
        registry.fetch_gguf(name, progress=False)


def load_models(prompts, mesh):
    """(target, draft model or None, token prompts, the prompts' texts as the model reads them
    (encode_prompts)): the prompts checked against the target (and --gamma against its context)
    before a draft model or a drafter's tables are loaded; both models placed on the mesh once;
    the draft's tokenizer checked against the target's."""
    batch = min(FLAGS.batch_size, len(prompts))
    prefetch_draft()
    target = load_model(FLAGS.target, FLAGS.target_dtype, batch, mesh)
    token_prompts, texts = encode_prompts(target.tokenizer, prompts)
    validate(target, token_prompts, None, None, FLAGS.max_new_tokens, None)
    contexts = {"the target's": target.config.max_seq_len}
    if FLAGS.drafter != "model" or FLAGS.draft != "none":
        check_gamma_fits(token_prompts, contexts)
    draft = None
    if FLAGS.draft != "none" and FLAGS.drafter in ("model", "hybrid"):
        draft = load_model(FLAGS.draft, FLAGS.draft_dtype, batch, mesh, flag="--draft_dtype")
        check_gamma_fits(token_prompts, {**contexts, "the draft's": draft.config.max_seq_len})
    if mesh is not None:  # placed once here; generate then uses the arrays as they are
        target = sharding.place(target, mesh)
        draft = None if draft is None else sharding.place(draft, mesh)
    if draft is not None and draft.tokenizer is not None and target.tokenizer is not None:
        try:  # a draft whose vocabulary is a prefix of the target's drafts with q padded (ModelDrafter)
            check_pair(target.tokenizer, draft.tokenizer, target.config.vocab_size, draft.config.vocab_size)
        except ValueError as e:
            raise common.UsageError(f"--draft={FLAGS.draft} and --target={FLAGS.target}: {e}") from None
    return target, draft, token_prompts, texts


def decode_all(target, draft, token_prompts, stop_ids, mesh):
    """(tokens, stats, (autoregressive tokens, stats) or None): --compare_autoregressive runs
    both modes once on the first batch, untimed, before either is timed (the first execution in
    a process pays start-up costs a later one does not); the compile seconds reported are the
    warm-up's plus any later batch's."""
    compare = FLAGS.compare_autoregressive and draft is not None
    warm_compile = {}
    for mode, d in (("speculative", draft), ("autoregressive", None)) if compare else ():
        first = token_prompts[: FLAGS.batch_size]
        warm_compile[mode] = run_batches(target, d, first, stop_ids, mesh)[1]["compile_seconds"]
    tokens, stats = run_batches(target, draft, token_prompts, stop_ids, mesh)
    stats["compile_seconds"] += warm_compile.get("speculative", 0.0)
    if not compare:
        return tokens, stats, None
    ar_tokens, ar_stats = run_batches(target, None, token_prompts, stop_ids, mesh)
    ar_stats["compile_seconds"] += warm_compile["autoregressive"]
    return tokens, stats, (ar_tokens, ar_stats)


def stream_all(
    target, draft, token_prompts, stop_ids, mesh, headers, print_fn
) -> tuple[list[list[int]], dict]:
    """--stream: the prompts as Requests on one Engine, each prompt's header then its text
    printed as it comes (prompt by prompt, in order: a later prompt's pieces wait until the
    ones before it are done). Returns (each prompt's tokens, the engine's stats)."""
    engine = engine_lib.Engine(
        target,
        draft,
        max_batch=FLAGS.batch_size,
        max_queue=len(token_prompts),
        gamma=gamma_from_flag(),
        tree=tree_from_flag(),
        mesh=mesh,
        max_context=stream_context(target.config, token_prompts, FLAGS.max_new_tokens),
        max_new_tokens=FLAGS.max_new_tokens,
        prefix_cache_mb=0,  # generate's prefill program (a run after `make demo` finds it compiled)
    )
    settings = dict(max_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k)
    settings.update(top_p=FLAGS.top_p, stop_ids=tuple(stop_ids))
    handles = [
        engine.submit(Request(prompt_ids=tuple(p), seed=FLAGS.seed, **settings), row_id=i)
        for i, p in enumerate(token_prompts)
    ]
    index = {h.id: i for i, h in enumerate(handles)}
    tokens, pending, done, shown = [[] for _ in handles], [[] for _ in handles], set(), 0
    print_fn(headers[0])
    for update in engine.drain():
        i = index[update.handle.id]
        tokens[i] += update.token_ids
        pending[i].append(update.text)
        done |= {i} if update.finished else set()
        while shown < len(handles) and (pending[shown] or shown in done):
            print_fn("".join(pending[shown]), end="\n\n" if shown in done else "", flush=True)
            pending[shown] = []
            if shown in done:
                shown += 1
                if shown < len(handles):
                    print_fn(headers[shown])
    return tokens, engine.stats()


def summary_line(label: str, s: dict) -> str:
    """One line of a run's stats: tokens, speed, timings, acceptance, sources, gamma=auto chunks."""
    line = (
        f"{label}: {s['num_new_tokens']} tokens, {s['tokens_per_second']:.2f} tokens/s "
        f"(compile {s['compile_seconds']:.1f} s, prefill {s['prefill_seconds']:.3f} s, "
        f"decode {s['decode_seconds']:.3f} s)"
    )
    if s.get("num_draft_tokens"):
        line += (
            f", acceptance rate {s['acceptance_rate']:.3f}, mean accepted length "
            f"{s['mean_accepted_length']:.2f}, alpha_hat {s['alpha_hat']:.3f}"
        )
    if "fraction_of_rounds_by_drafter" in s and len(s["fraction_of_rounds_by_drafter"]) > 1:
        line += ", rounds served / acceptance rate: " + ", ".join(
            f"{name} {share:.2f} / {s['acceptance_rate_by_drafter'][name]:.3f}"
            for name, share in s["fraction_of_rounds_by_drafter"].items()
        )
    if "gamma_schedules" in s:
        chunks = [
            f"{g}x{r}" if r < 2**31 - 1 else f"{g} to the end" for b in s["gamma_schedules"] for g, r in b
        ]
        line += f", gamma=auto chunks (gamma x rounds): {' '.join(chunks)}"
    return line


def make_report(target, draft_dtype, draft_vocab, stop_ids, stats) -> dict:
    """--output_json's settings and stats (outputs and the comparison are added after)."""
    return {
        "target": FLAGS.target,
        "draft": FLAGS.draft,
        "drafter": FLAGS.drafter,
        "max_ngram": FLAGS.max_ngram,
        "draft_threshold": FLAGS.draft_threshold,
        "target_dtype": target.config.dtype,
        "draft_dtype": draft_dtype,
        "draft_vocab": draft_vocab,
        "matmul_impl": FLAGS.matmul_impl,
        "gamma": gamma_from_flag(),
        "tree": tree_from_flag(),
        "temperature": FLAGS.temperature,
        "stop_ids": stop_ids,
        "mesh": FLAGS.mesh,
        "stats": stats,
        "outputs": [],
    }


def main(argv):
    if len(argv) > 1:
        raise common.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    init_distributed()  # before anything touches a jax backend
    mesh, prompts = check_flags()
    target, draft, token_prompts, texts = load_models(prompts, mesh)
    main_process = jax.process_index() == 0

    def print(*args, **kwargs):  # noqa: A001 - only process 0 prints
        if main_process:
            builtins.print(*args, **kwargs)

    stop_ids = stop_ids_from_flag(target.tokenizer, target.config.vocab_size)
    draft_dtype = draft.config.dtype if draft is not None else FLAGS.draft_dtype  # auto resolved
    draft_vocab = draft_vocab_from_flag(draft.config.vocab_size) if draft is not None else 0
    draft = build_draft(target, draft, stop_ids, draft_vocab)
    common.note_default_prompt(FLAGS.prompt is None and FLAGS.prompts_file is None, DEFAULT_PROMPT)
    if FLAGS.stream:
        return main_stream(target, draft, prompts, texts, token_prompts, stop_ids, mesh, print, main_process)
    tokens, stats, compared = decode_all(target, draft, token_prompts, stop_ids, mesh)
    report = make_report(target, draft_dtype, draft_vocab, stop_ids, stats)
    for prompt, read, new, nonfinite in zip(prompts, texts, tokens, stats[metrics.NONFINITE], strict=True):
        text = target.tokenizer.decode(new, skip_special_tokens=FLAGS.skip_special_tokens)
        output = {"prompt": read, "tokens": new, "text": text, "nonfinite_logits": nonfinite}
        if prompt.messages is not None:  # "prompt" is the conversation as the template rendered it
            output["messages"] = list(prompt.messages)
        report["outputs"].append(output)
        print(
            f"--- {'chat' if prompt.messages is not None else 'prompt'}: {prompt.shown!r}\n{common.terminal_text(text)}\n"
        )
    print(summary_line(f"speculative ({FLAGS.drafter})" if draft is not None else "autoregressive", stats))
    warning = report_nonfinite(stats, [p.shown for p in prompts])
    if warning:
        print(warning, file=sys.stderr)
    if compared is not None:
        ar_tokens, ar_stats = compared
        speedup = stats["tokens_per_second"] / ar_stats["tokens_per_second"]
        identical = ar_tokens == tokens
        print(summary_line("autoregressive", ar_stats))
        print(
            f"speedup {speedup:.2f}x; outputs identical to autoregressive: {identical}"
            + ("" if FLAGS.temperature == 0 else " (expected only at temperature 0)")
        )
        report.update(autoregressive_stats=ar_stats, speedup=speedup, identical_to_autoregressive=identical)
    if FLAGS.output_json and main_process:
        runtime.write_json_atomic(FLAGS.output_json, report)


def main_stream(target, draft, prompts, texts, token_prompts, stop_ids, mesh, print_fn, main_process) -> None:
    """--stream's output: each prompt's header, then its text as it comes; a summary line;
    --output_json with each prompt's tokens and text and the engine's stats."""
    start = time.perf_counter()
    headers = [f"--- {'chat' if p.messages is not None else 'prompt'}: {p.shown!r}" for p in prompts]
    tokens, stats = stream_all(target, draft, token_prompts, stop_ids, mesh, headers, print_fn)
    seconds = time.perf_counter() - start
    total = sum(len(t) for t in tokens)
    mode = f"speculative ({FLAGS.drafter})" if draft is not None else "autoregressive"
    line = f"streamed {mode}: {total} tokens in {seconds:.2f} s ({total / seconds:.2f} tokens/s)"
    if stats.get("draft_tokens_total"):
        line += f", acceptance rate {stats['accepted_tokens_total'] / stats['draft_tokens_total']:.3f}"
    print_fn(line)
    if FLAGS.output_json and main_process:
        decode = functools.partial(target.tokenizer.decode, skip_special_tokens=FLAGS.skip_special_tokens)
        outputs = [
            {"prompt": read, "tokens": new, "text": decode(new)}
            for read, new in zip(texts, tokens, strict=True)
        ]
        runtime.write_json_atomic(
            FLAGS.output_json, {"target": FLAGS.target, "stats": stats, "outputs": outputs}
        )


def cli():
    """The command line: main under launch.common.run (bad input: one line, exit 2)."""
    common.run(main)


if __name__ == "__main__":
    cli()
