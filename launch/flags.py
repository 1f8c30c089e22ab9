"""The flags launch.generate and launch.serve share, defined once: the models (--target, --draft,
--drafter and the drafters' settings), gamma and the tree, sampling, precision and kernels, the
mesh; and their parsing: each as the value the library takes (gamma_from_flag, stop_ids_from_flag,
build_draft, ...), UsageError naming the flag on a bad value, check_flags before anything is
loaded, and load_pair, the flags' models through launch.loading.load_pair."""

import dataclasses
from collections.abc import Callable

from absl import flags

import models
from launch import loading
from launch.runtime import check_model_flag
from launch.usage import UsageError
from models import config as model_config
from models import kernels, precision, registry
from models.precision import PRECISIONS
from spec_jax import drafting, sampling, sharding
from spec_jax.bounds import MAX_TREE_NODES, speculation_bound
from spec_jax.drafting.build import DRAFTERS
from spec_jax.drafting.lookup import MAX_NGRAM_LIMIT

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
flags.DEFINE_string(
    "stop_ids",
    "auto",
    "Token ids that end a row: 'auto' (the target tokenizer's end-of-generation set: eos, eot and "
    "the family's end tokens such as <|endoftext|> and <|im_end|>), 'none', or comma-separated ids.",
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

flags.register_validator("top_p", lambda v: 0.0 < v <= 1.0, message="--top_p must be in (0, 1]")
flags.register_validator(
    "draft_threshold", lambda v: 0.0 <= v < 1.0, message="--draft_threshold must be in [0, 1)"
)
flags.register_validator("target", lambda v: v != "none", message="--target cannot be 'none'")


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
        raise UsageError(
            f"--stop_ids must be 'auto', 'none' or comma-separated integers, got {FLAGS.stop_ids!r}"
        ) from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"--stop_ids: each id must be in [0, {vocab_size}), got {bad[0]}")
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
        raise UsageError(f"--draft_vocab must be 'auto', 0 or a positive token count, got {text!r}")
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
        raise UsageError(f"--{where}{e}") from None


def check_model_names() -> None:
    """--target and --draft name models models.load takes (models.check_source: a name, a GGUF
    file, a checkpoint folder or a hub id; before anything is loaded or downloaded)."""
    for flag, name in (("--target", FLAGS.target), ("--draft", FLAGS.draft)):
        if not (flag == "--draft" and name == "none"):
            check_model_flag(flag, name)


def check_sampling_flags() -> None:
    """--temperature, --top_k and --top_p by the warp's own rule (spec_jax.sampling), before
    anything is loaded: the flags' bounds let nan and inf through."""
    try:
        sampling.validate_sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    except ValueError as e:
        raise UsageError(f"--{e}") from None


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
        raise UsageError(f"--{flag} must be {allowed}, got {FLAGS[flag].value!r}")
    return value


def gamma_from_flag():
    """--gamma as an int >= 1 or "auto"; UsageError naming the flag otherwise."""
    return int_or_auto("gamma", 1, 2**31 - 1, "an integer >= 1 or 'auto'")


def tree_from_flag():
    """--tree as an int in [0, MAX_TREE_NODES] or "auto"; UsageError naming the flag otherwise."""
    return int_or_auto(
        "tree", 0, MAX_TREE_NODES, f"0 (chains), a node count in [1, {MAX_TREE_NODES}] or 'auto'"
    )


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
        raise UsageError(str(e)) from None


def draft_model_name() -> str | None:
    """The draft model to load: --draft where --drafter drafts with a model (model, hybrid) and
    --draft is not 'none', else None."""
    if FLAGS.draft == "none" or FLAGS.drafter not in ("model", "hybrid"):
        return None
    return FLAGS.draft


def check_flags(between: Callable[[], object] | None = None):
    """(mesh or None, what `between()` returns): every shared flag checked before anything is
    loaded or downloaded; `between` (an entry point's own checks: its prompts, its output file)
    runs after the flags' syntax and before the model names, the sampling warp, the cache folder
    and the CPU kernel's build are checked."""
    kernels.resolve_impl(FLAGS.attention_impl)  # fail fast on a bad name
    gamma_from_flag()
    tree = tree_from_flag()
    draft_vocab_from_flag(2**31 - 1)  # the syntax, before anything is loaded
    if FLAGS.acceptance_head and FLAGS.drafter != "head":
        raise UsageError("--acceptance_head needs --drafter=head")
    if tree and FLAGS.draft == "none" and FLAGS.drafter == "model":
        raise UsageError("--tree needs a drafter: --draft cannot be 'none' with --drafter=model")
    if FLAGS.drafter == "hybrid" and FLAGS.draft == "none":
        raise UsageError("--drafter=hybrid needs a draft model: --draft cannot be 'none'")
    mesh = sharding.make_mesh(FLAGS.mesh) if FLAGS.mesh else None
    own = None if between is None else between()
    check_model_names()
    check_sampling_flags()
    if any(name not in models.RANDOM_PRESETS for name in (FLAGS.target, FLAGS.draft) if name != "none"):
        # A real model is converted into the cache: an unwritable one is reported (exit 1, one
        # line) before the kernel build below, not after it.
        registry.ensure_writable(registry.cache_root())
    # Last, being the costly one (a cold build compiles the C++ kernel: seconds): a CPU kernel
    # that cannot be built, for the build a config made here names.
    precision.has_cpu_kernels(FLAGS.matmul_impl, model_config.this_cpu_isa())
    return mesh, own


def load_pair(
    batch: int, mesh=None, check_target=None, check_draft=None, prefetch_draft=False
) -> loading.Pair:
    """--target and the draft model (draft_model_name) at --target_dtype / --draft_dtype with
    --attention_impl and --matmul_impl, for `batch` rows on `mesh`: launch.loading.load_pair
    (check_target, check_draft and prefetch_draft: see there)."""
    return loading.load_pair(
        FLAGS.target,
        draft_model_name(),
        target_dtype=FLAGS.target_dtype,
        draft_dtype=FLAGS.draft_dtype,
        batch=batch,
        mesh=mesh,
        attention_impl=FLAGS.attention_impl,
        matmul_impl=FLAGS.matmul_impl,
        check_target=check_target,
        check_draft=check_draft,
        prefetch_draft=prefetch_draft,
    )


@dataclasses.dataclass(frozen=True)
class Drafting:
    """What the drafter flags make of a loaded pair (drafting_of)."""

    stop_ids: list[int]  # --stop_ids as token ids
    draft_dtype: str  # the draft model's precision as resolved (--draft_dtype where none)
    draft_vocab: int  # --draft_vocab as a token count (0: the full vocabulary, or no draft model)
    draft: object  # generate's and the Engine's `draft` for --drafter (None: plain decoding)


def drafting_of(pair: loading.Pair) -> Drafting:
    """The stop ids, the draft's precision and vocabulary, and --drafter's drafter
    (build_draft) for a loaded pair."""
    target, draft = pair.target, pair.draft
    stop_ids = stop_ids_from_flag(target.tokenizer, target.config.vocab_size)
    draft_dtype = draft.config.dtype if draft is not None else FLAGS.draft_dtype  # auto resolved
    draft_vocab = draft_vocab_from_flag(draft.config.vocab_size) if draft is not None else 0
    return Drafting(stop_ids, draft_dtype, draft_vocab, build_draft(target, draft, stop_ids, draft_vocab))
