"""The table's row operations on device memory (spec_jax.table.Table's methods call them; nothing
else does): which axis of each leaf of a loop state holds its rows (batch_axes), and, along those
axes, a state of another row count (resize), a row copied (move_row) or taken alone (take_row),
rows written from another state (write_rows: an admission's prefilled rows), rows marked done
(mark_done) and a row's budget set (set_budget), each compiled once; and the table's scalar
counters read to the host (table_counters).
"""

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sharding
from spec_jax.speculative import SpecState


def batch_axes(shapes_a, shapes_b) -> tuple[int, ...]:
    """The axis that indexes the rows of each leaf (in tree_flatten order; -1: a leaf the rows
    share), from the shapes of one tree built at two batch sizes (jax.eval_shape of one
    program): the axis where they differ. No leaf is taken for a row by the coincidence of a
    size (a [G] metric with G == B, a leading axis of 1)."""
    axes = []
    for a, b in zip(jax.tree.leaves(shapes_a), jax.tree.leaves(shapes_b), strict=True):
        differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        axes.append(differ[0] if differ else -1)
    return tuple(axes)


def _by_leaf(fn, axes: tuple[int, ...], table, *others):
    """table with fn(leaf, axis, *the others' leaves) for each leaf that has rows (axes:
    batch_axes); the leaves the rows share keep the table's."""
    leaves, treedef = jax.tree.flatten(table)
    other_leaves = [jax.tree.leaves(o) for o in others]
    out = [
        t if axis < 0 else fn(t, axis, *(o[i] for o in other_leaves))
        for i, (t, axis) in enumerate(zip(leaves, axes, strict=True))
    ]
    return treedef.unflatten(out)


def resize(table, blank, axes: tuple[int, ...], n: int):
    """table (a loop state or its drafter's state) with n rows: its first n, or all of its rows
    followed by copies of blank's one row (a free row: done) up to n."""

    def one(t, axis, r):
        have = t.shape[axis]
        if n <= have:
            return jax.lax.slice_in_dim(t, 0, n, axis=axis)
        return jnp.concatenate([t] + [r] * (n - have), axis=axis)

    return _by_leaf(one, axes, table, blank)


def move_row(table, axes: tuple[int, ...], src, dst):
    """table with row src copied into row dst (int32 scalars); row src is left as it was."""

    def one(t, axis):
        return jax.lax.dynamic_update_slice_in_dim(
            t, jax.lax.dynamic_slice_in_dim(t, src, 1, axis), dst, axis
        )

    return _by_leaf(one, axes, table)


def take_row(table, axes: tuple[int, ...], i):
    """table's row i (an int32 scalar) as a table of one row; the shared leaves are table's."""
    return _by_leaf(lambda t, axis: jax.lax.dynamic_slice_in_dim(t, i, 1, axis), axes, table)


def write_rows(table, block, axes: tuple[int, ...], slots):
    """table with row slots[i] replaced by block's row i (block: the same tree at another batch,
    e.g. a prefill's; slots: int32 [block's rows], a slot past the table's rows drops that
    row), along each leaf's row axis; the leaves the rows share keep the table's. Nothing of a
    row's previous occupant survives."""

    def one(t, axis, r):
        return t.at[(slice(None),) * axis + (slots,)].set(r, mode="drop")

    return _by_leaf(one, axes, table, block)


def mark_done(state: SpecState, rows_b) -> SpecState:
    """state with the rows of rows_b (bool [B]) done: the loop commits nothing more for them."""
    return state.replace(out=state.out.replace(done=state.out.done | rows_b))


resize_jit = jax.jit(resize, static_argnums=(2, 3))
move_row_jit = jax.jit(move_row, static_argnums=1, donate_argnums=0)
take_row_jit = jax.jit(take_row, static_argnums=1)
write_rows_jit = jax.jit(write_rows, static_argnums=2, donate_argnums=0)
mark_done_jit = jax.jit(mark_done, donate_argnums=0)


def table_counters(state: SpecState) -> np.ndarray:
    """The table's scalar counters on the host, int [3]: target calls (rounds), draft tokens,
    accepted tokens (no admission writes them, so their differences count a chunk's work)."""
    m = state.metrics
    return np.asarray(sharding.fetch((m.target_calls, m.num_draft_tokens, m.num_accepted_tokens)))


def set_budget(state: SpecState, slot, budget) -> SpecState:
    """state with row slot's budget (Output.budget) set to budget (int32 scalars)."""
    return state.replace(out=state.out.replace(budget=state.out.budget.at[slot].set(budget)))


set_budget_jit = jax.jit(set_budget, donate_argnums=0)
