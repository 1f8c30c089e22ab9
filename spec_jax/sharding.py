"""Meshes, logical axes and placement: the same loop on one device, 8 CPU devices or a pod.

Every parameter and cache array carries logical axis names; one rule table (RULES) maps them
to the two mesh axes, `data` (the batch's rows) and `model` (tensor parallelism, Megatron
style: two all-reduces a layer, the logits vocab-sharded until sampling). A dimension its mesh
axis does not divide is REPLICATED along that axis, never an error (what serving engines do
for GQA models with fewer kv heads than the tensor-parallel degree); `describe(config, mesh)`
lists what is. docs/pods.md has the table and what it gives the Qwen pair.

Multi-host: arrays are built with `jax.make_array_from_callback` from host values that every
process holds identically (same seed, same prompts), so `place` and `put` work the same in one
process and in many; `fetch` gathers results onto every host.
"""

import functools
import weakref

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import weights
from models.cache import KVCache

DATA = "data"
MODEL = "model"
MESH_AXES = (DATA, MODEL)

# Logical axis -> mesh axis (None: replicated).
RULES = {
    "batch": DATA,
    "heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
    "embed": None,
    "head_dim": None,
    "layers": None,
    "seq": None,
    "blocks": None,  # a GGUF BlockWeight's bytes per row: its input axes, never split
}

CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")  # KVCache.k / .v [L, B, S, KVH, Dh]


def make_mesh(spec: str | None, devices=None) -> Mesh:
    """A Mesh with axes ("data", "model") from a flag string.

    spec: "data:2,model:4" (a missing axis has size 1; the order of the entries does not
    matter), "auto" (every device on `model`), or None / "" (one device). Uses the first
    data*model of `devices` (default jax.devices(), global over all processes). ValueError on a
    malformed spec or one that needs more devices than exist.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {DATA: 1, MODEL: 1}
    spec = (spec or "").strip()
    if spec == "auto":
        sizes[MODEL] = len(devices)
    elif spec:
        seen = set()
        for part in spec.split(","):
            name, sep, size = part.strip().partition(":")
            name = name.strip()
            if not sep or name not in sizes or not size.strip().isdigit() or int(size) < 1:
                raise ValueError(
                    f"malformed mesh {spec!r}: expected comma-separated AXIS:SIZE entries with AXIS in "
                    f"{MESH_AXES} and SIZE a positive integer, e.g. 'data:2,model:4', or 'auto'"
                )
            if name in seen:
                raise ValueError(f"malformed mesh {spec!r}: axis {name!r} given twice")
            seen.add(name)
            sizes[name] = int(size)
    needed = sizes[DATA] * sizes[MODEL]
    if needed > len(devices):
        raise ValueError(f"mesh {spec!r} needs {needed} devices but only {len(devices)} exist")
    if jax.process_count() > 1 and needed != len(devices):
        raise ValueError(
            f"mesh {spec!r} uses {needed} of {len(devices)} devices; with {jax.process_count()} "
            "processes the mesh must cover every device"
        )
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((sizes[DATA], sizes[MODEL]), MESH_AXES, axis_types=auto, devices=devices[:needed])


@functools.cache
def default_mesh() -> Mesh:
    """The 1x1 mesh on this process's first device: what "no mesh" means."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1), MESH_AXES, axis_types=auto)


def check_mesh(mesh: Mesh) -> None:
    """ValueError unless mesh has exactly the axes ("data", "model")."""
    if not isinstance(mesh, Mesh) or set(mesh.axis_names) != set(MESH_AXES):
        names = getattr(mesh, "axis_names", None)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {MESH_AXES}, got axes {names}")


def for_mesh(config, mesh: Mesh):
    """The model config as run on this mesh. The CPU kernels (matmul and attention) are XLA
    custom calls the partitioner cannot split, and Mosaic refuses to partition the Pallas
    attention kernels on a multi-device TPU mesh ("Mosaic kernels cannot be automatically
    partitioned"; experiments/pod_pairs.py compiles the loop for pod slices): off one device,
    "auto" means XLA's and asking for a CPU kernel is a ValueError naming the setting."""
    n = mesh.devices.size
    if n == 1:
        return config
    for name, forced in (("attention_impl", "cpu"), ("matmul_impl", "cpu_kernel")):
        if getattr(config, name) == forced:
            raise ValueError(f"{name}: {forced} runs on one device, not a {n}-device mesh; use auto or xla")
    attention = "xla" if config.attention_impl == "auto" else config.attention_impl
    return config.replace(attention_impl=attention, matmul_impl="xla")


def param_logical_axes(params):
    """The logical axis names of every parameter leaf (models.weights.logical_axes): a pytree of
    tuples matching params, in either layer layout. KeyError on a leaf the table does not know."""
    return weights.logical_axes(params)


def partition_spec(logical_axes: tuple, shape: tuple, mesh: Mesh) -> P:
    """The PartitionSpec of an array with these logical axes under RULES and the divisibility rule."""
    spec = []
    for name, size in zip(logical_axes, shape, strict=True):
        axis = RULES[name]
        if axis is None or mesh.shape[axis] == 1 or size % mesh.shape[axis]:
            spec.append(None)
        else:
            spec.append(axis)
    return P(*spec)


def param_shardings(params, mesh: Mesh):
    """A pytree of NamedSharding matching params (leaves may be arrays or ShapeDtypeStructs)."""
    return jax.tree.map(
        lambda names, leaf: NamedSharding(mesh, partition_spec(names, np.shape(leaf), mesh)),
        param_logical_axes(params),
        params,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def weight_shardings(path: tuple[str, ...], weight, mesh: Mesh):
    """The shardings of one weight of the table (models.weights, by its path in a model's params,
    e.g. ("embed", "embedding")) in whatever form it is stored (an array, Int8Weight, a GGUF
    BlockWeight): as the rule table places it in the model's own params."""
    tree = weight
    for key in reversed(path):
        tree = {key: tree}
    out = param_shardings(tree, mesh)
    for key in path:
        out = out[key]
    return out


def cache_sharding(shape, mesh: Mesh) -> NamedSharding:
    """Sharding of a KV cache array [L, B, S, KVH, Dh]: batch on data, kv heads on model if divisible."""
    return NamedSharding(mesh, partition_spec(CACHE_AXES, tuple(shape), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis on data, the rest replicated."""
    return NamedSharding(mesh, P(DATA, *([None] * (ndim - 1))))


def state_shardings(state, mesh: Mesh, batch: int):
    """Shardings for a loop state / input pytree (leaves arrays or ShapeDtypeStructs).

    KV caches (any KVCache node) follow CACHE_AXES; under a `metrics` field, and for scalars,
    replicated; any other array whose leading dimension is the batch is split over `data` (the
    loop's per-row arrays: tokens, lengths, done flags, the rows' PRNG keys); the rest replicated.
    """

    def one(path, leaf):
        if isinstance(leaf, KVCache):
            return KVCache(k=cache_sharding(leaf.k.shape, mesh), v=cache_sharding(leaf.v.shape, mesh))
        keys = weights.path_keys(path)
        if "metrics" in keys or batch_axis(path, np.shape(leaf), batch) is None or batch % mesh.shape[DATA]:
            return replicated(mesh)
        return batch_sharding(mesh, len(np.shape(leaf)))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, KVCache))


def batch_axis(path, shape: tuple, batch: int) -> int | None:
    """The axis of a loop state's leaf (at `path`, of `shape`) that indexes its rows, or None
    (scalars, a leaf shared by the rows): axis 1 of a KV cache's k and v ([L, B, S, K, E]),
    else axis 0 where the leading dimension is the batch."""
    keys = weights.path_keys(path)
    if len(keys) >= 1 and keys[-1] in ("k", "v") and len(shape) == 5:
        return 1 if shape[1] == batch else None
    return 0 if shape and shape[0] == batch else None


def put(tree, shardings):
    """Places host (or single-device) values with the given shardings, in one process or many.

    Every process must pass the same global values; each one fills only its own shards. A
    leaf that already has its target sharding (or an equivalent one: a single-device array
    for a 1x1 mesh on that device) is returned as it is (no copy). A NumPy leaf may be shared
    (on a CPU, where its alignment allows): one changed later goes through
    rows.put_snapshot."""

    def one(x, sharding):
        if isinstance(x, jax.Array) and (
            x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)
        ):
            return x
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


# Placed copies of parameter trees, per id of the tree's first leaf (dropped with that leaf).
_PLACED: dict[int, dict] = {}


def place_params(params, mesh: Mesh):
    """params placed by the rule table (a no-op for leaves already placed that way)."""
    return put(params, param_shardings(params, mesh))


def _has_sharding(x, sharding) -> bool:
    return isinstance(x, jax.Array) and (
        x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)
    )


def is_placed(params, mesh: Mesh) -> bool:
    """True when every leaf already has the sharding the rule table gives it on mesh."""
    wanted = jax.tree.leaves(param_shardings(params, mesh))
    return all(_has_sharding(x, s) for x, s in zip(jax.tree.leaves(params), wanted, strict=True))


def put_once(tree, shardings):
    """tree put with shardings (a pytree of them matching it): as it is when every leaf already
    has its sharding, else placed once and the placed copy kept for as long as the tree's
    first leaf lives (twice the memory meanwhile), so that a later call reuses it."""
    leaves, wanted = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    if all(_has_sharding(x, s) for x, s in zip(leaves, wanted, strict=True)):
        return tree
    first = leaves[0]
    if id(first) not in _PLACED:
        try:
            weakref.finalize(first, _PLACED.pop, id(first), None)
        except TypeError:  # a leaf that cannot be referenced weakly: placed every time
            return put(tree, shardings)
        _PLACED[id(first)] = {}
    per_tree = _PLACED[id(first)]
    key = (jax.tree.structure(tree), tuple(map(id, leaves)), tuple(wanted))
    if key not in per_tree:
        per_tree[key] = put(tree, shardings)
    return per_tree[key]


def place(model, mesh: Mesh):
    """A copy of a models.Model with its parameters sharded over mesh; do this once per model.

    `spec_jax.generate(placed, ..., mesh=mesh)` then uses the arrays as they are. Passing an
    unplaced model also works: generate places it once and keeps the placed copy for as long
    as the Model's arrays live (twice the parameter memory meanwhile).
    """
    check_mesh(mesh)
    return model.replace(params=place_params(model.params, mesh))


def placed_params(model, mesh: Mesh):
    """model.params on mesh: as they are when already placed, else placed once and cached."""
    return put_once(model.params, param_shardings(model.params, mesh))


def fetch(tree):
    """Host NumPy copies of a pytree of (possibly multi-host) arrays, the same on every process."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def describe(config, mesh: Mesh) -> dict[str, str]:
    """Parameter path -> PartitionSpec string for one model on mesh (what is sharded, what replicated)."""
    shapes = weights.param_shapes(config)
    specs = jax.tree.map(lambda s: str(s.spec), param_shardings(shapes, mesh))
    flat, _ = jax.tree_util.tree_flatten_with_path(specs)
    return {"/".join(weights.path_keys(path)): spec for path, spec in flat}
