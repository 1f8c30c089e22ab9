"""Attention behind one contract, with a dispatcher over implementations.

`attention(q[B,T,H,D], k[B,S,KVH,D], v[B,S,KVH,D], q_positions[B,T], kv_lengths[B], *, window=None)`:
query at position p = q_positions[b,t] attends keys at positions s <= p and s < kv_lengths[b],
and, with a window, p - s < window (Hugging Face's sliding-window mask: Mistral, Gemma 3's local
layers; the query's own key counts, so window=1 sees only itself); H is a multiple of KVH (query
head h reads kv head h // (H // KVH)); float32 or bfloat16 in, same dtype out, accumulation in
float32; a query that sees no key returns zeros.

window: None (no limit; the programs are then exactly those without the argument) or an int32
scalar: a Python int, checked to lie in [1, MAX_WINDOW] (ValueError naming `window` otherwise), or
a traced jax integer scalar, e.g. jnp.where(is_local[layer], W, MAX_WINDOW) inside a scan over
layers, whose value cannot be checked while tracing: a traced window <= 0 hides every key (zeros).
A window at least the number of keys is the same as None (the reference gives the same bits).

tree: None, or int32 [B, T] (T <= MAX_TREE_QUERIES): the queries are the nodes of a token tree
(spec_jax.tree) whose keys sit in the call's last T slots, kv_lengths[b] - T + j for query j.
Query t then sees the keys below those slots (the committed text) by the rule above, and the key
of query j exactly when bit j of tree[b, t] is set: itself and its ancestors. The window does not
apply to the tree's own keys (the caller folds it into the bits: models.transformer). A chain,
whose positions are its slots and whose bits are 0..t, is the causal contract itself.

Implementations (`impl`):
  "xla"         the dense reference (reference.py); any backend.
  "cpu"         this project's CPU kernel (cpu_rowwise.cc, in the CPU kernel library of
                cpu_matmul.py): each query computed alone in one fixed order, so a query's result
                does not depend on how many queries share the call (XLA's fusions of the reference
                do, in the last bits). A model whose products run in the CPU kernels calls it
                where its program is lowered for a CPU (models.transformer.attention_impl); "auto"
                here never resolves to it.
  "pallas_tpu"  Mosaic kernels; "pallas_gpu" Triton kernels. Both route on T (static):
                T <= DECODE_MAX_QUERIES -> flash_decoding (split-K over the cache, the T * H/KVH
                query rows of a kv head folded into one tile), otherwise flash_attention (query x
                key blocks, causal and ragged block skipping).
  "auto"        for the device being traced for (target.current(): the abstract mesh's device,
                jax.default_device, else the default backend): pallas_tpu on a TPU, pallas_gpu on a
                GPU that XLA compiles Triton kernels for (compute capability >= 8.0), otherwise xla
                (CPU; pre-Ampere GPUs such as T4 and V100).
`interpret=True` runs the Pallas kernels in interpret mode (CPU tests); the TPU kernels then use
the TPU interpreter (pltpu.InterpretParams()). The kernels tile for the same device: TPU VMEM and
generation, GPU shared memory per block (see target.py). See docs/kernels.md.
"""

from models.kernels import cpu_matmul, flash_attention, flash_decoding
from models.kernels import target as target_lib
from models.kernels.reference import (
    DEFAULT_MASK_VALUE,
    MAX_TREE_QUERIES,
    MAX_WINDOW,
    attention_mask,
    attention_reference,
    check_tree,
    check_window,
    tree_window_bits,
)

IMPLS = ("auto", "xla", "cpu", "pallas_tpu", "pallas_gpu")

# Largest T sent to flash_decoding. Decode (T=1) and verification (T=gamma+1 <= 9) fold T * G query
# rows into one tile and get their parallelism from splitting the cache; from 17 queries on
# (prefill buckets, chunked prefill) the query blocks of flash_attention give enough parallel work
# and the folded tile (T * G rows) would outgrow one MXU / tensor-core tile.
DECODE_MAX_QUERIES = 16


def resolve_impl(impl: str, device=None) -> str:
    """The implementation `impl` means for `device`; ValueError on an unknown name.

    device: a jax Device (real or compile-only), a jax.sharding.AbstractDevice or a target.Target;
      None means the device in effect while tracing (target.current()). Only "auto" depends on it.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if device is None:
        target = target_lib.current()
    elif isinstance(device, target_lib.Target):
        target = device
    else:
        target = target_lib.for_device(device)
    if target.platform == "tpu":
        return "pallas_tpu"
    if target.platform == "gpu" and target.triton_supported:
        return "pallas_gpu"
    return "xla"


def attention(
    q,
    k,
    v,
    q_positions,
    kv_lengths,
    *,
    window=None,
    tree=None,
    impl: str = "auto",
    interpret=False,
    cpu_isa=None,
    layer=None,
):
    """Returns [B, T, H, D] in q's dtype; see the module docstring for the masking contract,
    `window` and `tree`. cpu_isa: the CPU kernel library's build that impl "cpu" calls
    (cpu_matmul.ISAS; a model passes its ModelConfig.cpu_isa); required for "cpu", unused otherwise.
    layer: None, or an int32 scalar (Python or traced) with k and v a model's stacked cache
    [L, B, S, KVH, D]: the keys and values are that layer's (impl "cpu" reads them in place,
    the others take the layer's slice)."""
    impl = resolve_impl(impl)
    if layer is not None and impl != "cpu":
        k, v, layer = k[layer], v[layer], None
    check_window(window)
    check_tree(tree, q.shape)
    if q.shape[2] % k.shape[-2]:
        raise ValueError(f"num query heads {q.shape[2]} is not a multiple of kv heads {k.shape[-2]}")
    if impl == "xla":
        return attention_reference(q, k, v, q_positions, kv_lengths, window, tree)
    if impl == "cpu":
        if cpu_isa is None:
            raise ValueError("attention impl cpu: name the CPU kernel library's build (cpu_isa)")
        if not cpu_matmul.available(cpu_isa):
            raise ValueError(
                "attention impl cpu: the CPU kernel library is unavailable here (see the warning)"
            )
        return cpu_matmul.attention(q, k, v, q_positions, kv_lengths, cpu_isa, window, tree, layer)
    backend = "tpu" if impl == "pallas_tpu" else "gpu"
    # A folded decode tile that cannot fit the GPU's shared memory (many query rows x a wide head)
    # goes to flash_attention, which tiles the queries.
    if q.shape[1] <= DECODE_MAX_QUERIES and flash_decoding.fits(
        q.shape, k.shape, q.dtype, backend, target_lib.current()
    ):
        kernel = flash_decoding.flash_decoding
    else:
        kernel = flash_attention.flash_attention
    return kernel(
        q, k, v, q_positions, kv_lengths, window=window, tree=tree, backend=backend, interpret=interpret
    )


__all__ = [
    "DECODE_MAX_QUERIES",
    "DEFAULT_MASK_VALUE",
    "IMPLS",
    "MAX_TREE_QUERIES",
    "MAX_WINDOW",
    "attention",
    "attention_mask",
    "attention_reference",
    "check_tree",
    "check_window",
    "resolve_impl",
    "tree_window_bits",
]
