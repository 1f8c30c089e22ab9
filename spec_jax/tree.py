"""Token trees: many candidate continuations per row, verified exactly in one pass.

A tree per row has N node slots (static N). Node n holds a token, its parent (-1: the root,
i.e. the last committed token; otherwise a node with a smaller index, so the slots are in a
topological order) and q[n], the distribution its token was drawn from: a draft model's warped
distribution for a sampled node, a point mass for a deterministic candidate (a lookup or suffix
match, a top-k expansion), all zeros for an empty slot. Its depth is its parent's plus one.
A chain of G drafts is the tree whose node n has parent n - 1.

The rule (SpecInfer's multi-candidate speculative sampling, Miao et al. 2024, generalised to a
proposal distribution per child). At the current node (the root first) with target
distribution r = p[node], its children c_1, c_2, ... are tried in slot order: c_j is accepted
with probability min(1, r(c_j) / q_j(c_j)); on acceptance the walk moves to c_j with r = p[c_j];
on rejection r <- norm(max(r - q_j, 0)) and the next child is tried. When the children are
exhausted the next token is drawn from r.

Why it is exact: if each c_j is drawn from q_j given everything drawn before it (the committed
text, the earlier siblings and their subtrees), the token this step emits is distributed as r.
By induction from the last child: step j emits x with probability min(r_j(x), q_j(x)) by
acceptance plus (1 - sum min(r_j, q_j)) r_{j+1}(x) after a rejection, and with r_{j+1} =
norm(max(r_j - q_j, 0)) (whose mass is exactly 1 - sum min(r_j, q_j)) the sum is r_j(x). The
accepted child then continues with its own subtree, drawn given its token, so each committed
token is a sample of the target given the tokens before it. The proof also needs that whether
slot j holds a node does not depend on c_j's own draw. Children drawn i.i.d. from the same q
qualify; so do point masses (deterministic given what came before, earlier siblings' draws
included), for which the rule reads: accept c with probability r(c), else zero c out of r and
renormalise; and so does a mix, such as a child drawn from q followed by point masses at q's
most probable other tokens (the draft model's trees at temperature > 0). Children drawn
WITHOUT replacement from one q but labelled with q do not qualify (c_j's distribution is q
conditioned on the earlier siblings), nor does a drawn child kept only where its token scores
well (tests/test_tree.py keeps both as broken variants). A drafter that wants distinct
children proposes them as point masses (e.g. the top-k of its distribution), which is exact.

At temperature 0, p is a point mass at the argmax (ties broken by sampling.warp) and the rule
accepts a child exactly when its token is that argmax: the longest path of argmax tokens, then
the target's own argmax, the output of plain greedy decoding.

For a chain the rule is Leviathan et al.'s (spec_jax.verify): `verify_tree` on a chain draws
the same uniforms and the same final token from the same keys.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from models.kernels.reference import MAX_TREE_QUERIES, mask_bits
from spec_jax.sampling import draw_rows, split_rows

ROOT = -1


@flax.struct.dataclass
class Tree:
    """Candidates per row: N node slots in topological order (a parent before its children)."""

    tokens: jax.Array  # int32 [B, N]
    parents: jax.Array  # int32 [B, N]: ROOT or a smaller slot index
    q: jax.Array  # float32 [B, N, V]: each node's proposal distribution; all zeros: no node

    @property
    def present(self) -> jax.Array:
        """bool [B, N]: which slots hold a node."""
        return jnp.sum(self.q, axis=-1) > 0


def chain(tokens_bg, q_bgv) -> Tree:
    """The tree of a chain of drafts: node n's parent is n - 1."""
    b, g = tokens_bg.shape
    parents = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32) - 1, (b, g))
    return Tree(tokens=tokens_bg.astype(jnp.int32), parents=parents, q=q_bgv)


def depths(parents_bn) -> jax.Array:
    """int32 [B, N]: each slot's depth (a root child has depth 1), from its parent's."""
    n = parents_bn.shape[1]

    def step(depth, i):
        parent = parents_bn[:, i]
        own = jnp.where(
            parent == ROOT, 1, jnp.take_along_axis(depth, jnp.maximum(parent, 0)[:, None], 1)[:, 0] + 1
        )
        return depth.at[:, i].set(own), None

    depth, _ = jax.lax.scan(step, jnp.zeros(parents_bn.shape, jnp.int32), jnp.arange(n))
    return depth


def ancestors(parents_bn) -> jax.Array:
    """bool [B, N, N]: [b, i, j] whether slot j is slot i or one of its ancestors (the tree
    attention mask among the candidates: node i reads the committed prefix and these)."""
    n = parents_bn.shape[1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), (parents_bn.shape[0], n, n))

    def step(anc, i):
        parent = parents_bn[:, i]
        inherited = jnp.take_along_axis(anc, jnp.maximum(parent, 0)[:, None, None], 1)[:, 0]  # [B, N]
        row = anc[:, i] | (inherited & (parent != ROOT)[:, None])
        return anc.at[:, i].set(row), None

    anc, _ = jax.lax.scan(step, eye, jnp.arange(n))
    return anc


def query_bits(parents_bn) -> jax.Array:
    """int32 [B, N + 1]: the tree attention mask of a target call over [root, node 0 .. N-1] as
    bits (models.kernels' `tree`): bit j of query i set where the call's query j is query i
    itself or one of its ancestors; the root (query 0) is every node's ancestor."""
    n = parents_bn.shape[1]
    if n + 1 > MAX_TREE_QUERIES:
        raise ValueError(f"a tree has at most {MAX_TREE_QUERIES - 1} nodes, got {n}")
    b = parents_bn.shape[0]
    root = jnp.ones((b, n, 1), bool)  # query 0, everyone's ancestor; node j is query 1 + j
    nodes = jnp.concatenate([root, ancestors(parents_bn)], axis=2)  # [B, N, N + 1]
    return jnp.concatenate([jnp.ones((b, 1), jnp.int32), mask_bits(nodes)], axis=1)


def _residual(r, q):
    """norm(max(r - q, 0)); r itself where no mass is left (the rejection had probability ~0,
    and any distribution keeps the rule exact up to that rounding), as spec_jax.verify."""
    residual = jnp.maximum(r - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    return jnp.where(mass > 1e-12, residual / jnp.maximum(mass, 1e-30), r)


def verify_tree(tree: Tree, p_bnv, keys_b):
    """The rule of the module docstring on each row.

    Args:
      tree: the candidates, N slots.
      p_bnv: [B, N + 1, V] warped target distributions: p[:, 0] after the root (the last
        committed token), p[:, 1 + n] after node n (its continuation).
      keys_b: [B] PRNG keys; row b draws from keys_b[b] only.

    Returns:
      (path [B, N] int32: the accepted nodes' slots by depth, ROOT-padded; length [B] int32 in
      [0, N]; next_token [B] int32): the row commits tree.tokens[path[:length]], then next_token.
    """
    b, n = tree.tokens.shape
    q = tree.q.astype(jnp.float32)
    p = p_bnv.astype(jnp.float32)
    uniform_keys, residual_keys = split_rows(keys_b, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(uniform_keys)  # [B, N]
    rows = jnp.arange(b)

    def step(carry, i):
        node, r, fresh, path, length = carry
        tok = tree.tokens[:, i]
        q_i = q[:, i]
        q_x = q_i[rows, tok]
        r_x = r[rows, tok]
        candidate = (tree.parents[:, i] == node) & (q_x > 0)  # a child of the current node
        accept = candidate & (u[:, i] * q_x < r_x)  # u < r/q without dividing
        reject = candidate & ~accept
        r = jnp.where(accept[:, None], p[:, 1 + i], jnp.where(reject[:, None], _residual(r, q_i), r))
        path = path.at[rows, length].set(jnp.where(accept, i, path[rows, length]))
        length = length + accept.astype(jnp.int32)
        node = jnp.where(accept, i, node)
        fresh = jnp.where(accept, True, jnp.where(reject, False, fresh))
        return (node, r, fresh, path, length), None

    init = (
        jnp.full((b,), ROOT, jnp.int32),
        p[:, 0],
        jnp.ones((b,), bool),  # r is a row of p, not yet a residual
        jnp.full((b, n + 1), ROOT, jnp.int32),
        jnp.zeros((b,), jnp.int32),
    )
    if n:  # a scan traces its body even over nothing, and no slot can be indexed then
        init, _ = jax.lax.scan(step, init, jnp.arange(n))
    _, r, fresh, path, length = init
    # A row of p is normalised as spec_jax.verify's residual after a zero q (its last draft).
    r = jnp.where(fresh[:, None], _residual(r, jnp.zeros_like(r)), r)
    next_token = draw_rows(residual_keys, r)
    return path[:, :n], length, next_token


def call_inputs(last_token_b, tree: Tree, length_b):
    """(tokens [B, N + 1], positions [B, N + 1], bits [B, N + 1]) of the target call that scores
    a tree: the root (the last committed token, at position length - 1) then the N slots, each at
    the root's position plus its depth; models.forward(tree=bits) writes them at the contiguous
    slots length - 1 .. length - 1 + N."""
    depth = jnp.concatenate([jnp.zeros_like(tree.parents[:, :1]), depths(tree.parents)], axis=1)
    tokens = jnp.concatenate([last_token_b[:, None], tree.tokens], axis=1).astype(jnp.int32)
    return tokens, (length_b - 1)[:, None] + depth, query_bits(tree.parents)


def path_tokens(tree: Tree, path_bn, count_b, next_token_b):
    """int32 [B, N + 1]: what a row commits after verify_tree, the accepted nodes' tokens by
    depth then next_token (repeated past it)."""
    n = tree.tokens.shape[1]
    taken = jnp.take_along_axis(tree.tokens, jnp.maximum(path_bn, 0), axis=1)  # [B, N]
    idx = jnp.arange(n + 1)[None, :]
    padded = jnp.concatenate([taken, next_token_b[:, None]], axis=1)
    return jnp.where(idx < count_b[:, None], padded, next_token_b[:, None]).astype(jnp.int32)


def path_rows(values_bn1, path_bn, count_b):
    """[B, N + 1, ...]: a tree call's per-query values (query 0 the root, 1 + n node n) along
    each row's accepted path: the root's, then those of path[0], path[1], ...; the last one's
    repeated past the path. What the chain's rule reads at position i is this row i."""
    n = path_bn.shape[1]
    idx = jnp.arange(n)[None, :]
    last = jnp.take_along_axis(
        jnp.concatenate([jnp.zeros_like(path_bn[:, :1]), 1 + path_bn], 1), count_b[:, None], 1
    )
    query = jnp.concatenate(
        [jnp.zeros_like(path_bn[:, :1]), jnp.where(idx < count_b[:, None], 1 + path_bn, last)], 1
    )
    expand = query.reshape(query.shape + (1,) * (values_bn1.ndim - 2))
    return jnp.take_along_axis(values_bn1, expand, axis=1)


def compact(cache, root_slot_b, path_bn, count_b):
    """The KV cache (models.cache.KVCache, [L, B, S, K, E]) after a tree round: the keys and
    values of each row's accepted nodes moved from their slots (root + 1 + node) to the slots
    of their depths (root + 1 + d), where a chain's would be, so that the next round and plain
    decoding read the same cache. Slots past the path keep what they hold: garbage the next
    call overwrites before anything reads it (models.cache). A node at depth d + 1 sits in slot
    >= d (topological order), so every move reads a slot at or after the one it writes, and all
    sources are read before any write."""
    n = path_bn.shape[1]
    d = jnp.arange(n)[None, :]
    dest = root_slot_b[:, None] + 1 + d  # [B, N]
    src = jnp.where(d < count_b[:, None], root_slot_b[:, None] + 1 + jnp.maximum(path_bn, 0), dest)
    rows = jnp.arange(path_bn.shape[0])[:, None]

    def move(x):  # [L, B, S, K, E]
        moved = x[:, rows, jnp.clip(src, 0, x.shape[2] - 1)]  # [L, B, N, K, E]
        return x.at[:, rows, dest].set(moved, mode="drop")

    return cache.replace(k=move(cache.k), v=move(cache.v))


def taken_q(tree: Tree, path_bn, count_b):
    """(q [B, N, V], scored [B]): the proposal of the node taken at each depth of a row's round,
    for the metrics' alpha: the accepted path[d] for d < count; at d = count the first present
    child of the last accepted node (the first candidate the rule rejected there), if any; zeros
    past. scored: the depths scored, count plus one where a candidate was rejected."""
    n = tree.tokens.shape[1]
    d = jnp.arange(n)[None, :]
    last = jnp.take_along_axis(path_bn, jnp.maximum(count_b - 1, 0)[:, None], axis=1)[:, 0]
    last = jnp.where(count_b > 0, last, ROOT)
    children = (tree.parents == last[:, None]) & tree.present  # [B, N]
    first = jnp.where(jnp.any(children, axis=1), jnp.argmax(children, axis=1), ROOT)
    take = jnp.where(d < count_b[:, None], path_bn, jnp.where(d == count_b[:, None], first[:, None], ROOT))
    q = jnp.take_along_axis(tree.q, jnp.maximum(take, 0)[:, :, None], axis=1)
    return jnp.where((take >= 0)[:, :, None], q, 0.0), count_b + ((first >= 0) & (count_b < n)).astype(
        jnp.int32
    )
