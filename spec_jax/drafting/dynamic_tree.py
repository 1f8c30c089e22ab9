"""EAGLE-2's dynamic token tree (Li et al. 2024) for a drafter whose draft call reads a token tree
through the tree mask (ModelDrafter, HeadDrafter): DynamicTree (the settings, the spine, the tree
built depth by depth) and the ranking and selection of its candidates."""

import jax
import jax.numpy as jnp
import numpy as np

from models.kernels import MAX_TREE_QUERIES
from models.settings import is_int
from spec_jax import tree as tree_lib
from spec_jax.sampling import draw_rows, split_rows, warp


def node_q(tokens_bn, parent_q_bnv):
    """float32 [B, N, V]: each tree node's proposal, a point mass at its token (a top-k candidate
    is deterministic given the text). parent_q_bnv: the draft's warped q at each node's parent,
    the distribution a sampled node would carry instead (tests break the rule with it)."""
    return jax.nn.one_hot(tokens_bn, parent_q_bnv.shape[-1], dtype=jnp.float32)


SPINE_RANK = 1e6  # above any candidate's score (>= -87 per depth): the spine ranks first


class DynamicTree:
    """EAGLE-2's dynamic tree (Li et al. 2024) for a drafter whose draft call can read a token
    tree through the tree mask (ModelDrafter, spec_jax.drafting.head.HeadDrafter): its settings
    tree_depth (D) and tree_width (K), declared by the drafter's dataclass, checked here.

    The spine (the rows at temperature > 0, S = spine_nodes(N) > 0): the root's first candidate
    is drawn from the draft's warped q (keys_b: spine_keys[0]), and so is the first child of each
    spine node of depth d < S (spine_keys[d]), the others being q's K - 1 best other tokens. A
    greedy row has no spine: its tree is the best-scored candidates alone.
    Spine candidates rank above all others (tree_rank), so the spine node of each depth is
    expanded first and is in the tree whatever it drew; it carries the q it was drawn from.

    The tree is the spine, then the N - S best-scored other candidates, ties toward
    shallower ones: a child's score is at most its parent's, so the set is ancestor-closed
    and its rank order is topological. Siblings are distinct and every node off the spine
    is a point mass at its token (node_q): deterministic given the spine's draws, which
    keeps the rule exact (spec_jax.tree)."""

    tree_depth: int
    tree_width: int

    def __post_init__(self):
        d, k = self.tree_depth, self.tree_width
        if not is_int(d) or d < 1:
            raise ValueError(f"tree_depth must be an integer >= 1, got {d!r}")
        if not is_int(k) or k < 0 or k * (d - 1) > MAX_TREE_QUERIES:
            raise ValueError(
                f"tree_width must be 0 (the chain) or an integer >= 1 with tree_width * "
                f"(tree_depth - 1) <= {MAX_TREE_QUERIES} (the widest tree call's queries), got {k!r} "
                f"at tree_depth {d}"
            )

    @property
    def tree_queries(self) -> int:
        """The widest tree call's queries: K expanded nodes at each depth below D."""
        return self.tree_width * (self.tree_depth - 1)

    def spine_nodes(self, nodes: int) -> int:
        """The spine's length S of the rows at temperature > 0 (ModelDrafter's docstring): the tree's main path is a chain drawn from q over its first S depths. With
        the rest of N in point masses, S = 4, 6 and 8 at N = 8 (all spine: the chain) made
        4.33, 4.61 and 4.22 tokens per verify call for the Qwen pair at temperature 1 on the 8
        bench prompts (means of two seeds, 32 new tokens; one seed's spread was 0.4)."""
        if not self.tree_width:
            return 0
        return min(self.tree_depth, nodes, -(-3 * nodes // 4))

    def tree_calls(self, nodes: int) -> int:
        """One draft call per depth of the tree (min(D, N)); the chain's N without a tree."""
        return min(self.tree_depth, nodes) if self.tree_width else nodes

    def dynamic_tree(self, root_logits_b1v, expand, carry, nodes: int, sampling, to_vocab, keys_b):
        """(Tree of `nodes` (N) slots, expanded [B, N], carry): EAGLE-2's dynamic tree, every row
        alike.

        A candidate's score is its path's cumulative log draft probability (tree_scores; to_vocab
        puts the draft's probabilities on the target's vocabulary). The root's K best tokens
        (root_logits [B, 1, V']: the draft's logits of the token after the committed text) are
        the depth-1 candidates. At each depth d < D' =
        min(D, N) the K best-scored candidates of depth d are expanded: expand(carry, tokens
        [B, E], parents [B, E] (each expanded node's parent's expanded index; ROOT: the root),
        depths [E] (1 for the root's children), ancestor bits [B, E] (spec_jax.tree's, over the
        E), newest [B, K] (the indices of depth d's)) -> (logits [B, K, V'] after each of the
        newest K, carry) is one draft call over every node expanded so far (K per depth, depth
        by depth, reading each other through the tree mask; a call masks only its own keys, so
        each depth's call recomputes the depths above it), and each newest node's K most
        probable tokens are its children. Cost: D' calls (the last over K(D' - 1) nodes),
        K * D'(D' - 1) / 2 node queries.

        The spine and the choice of the tree: see the class docstring."""

        b = root_logits_b1v.shape[0]
        sampling = sampling.for_rows(b)
        k, depth = min(self.tree_width, root_logits_b1v.shape[-1]), min(self.tree_depth, nodes)
        spine = self.spine_nodes(nodes)
        spine_keys = split_rows(keys_b, max(spine, 1))  # [S, B]: spine node d's draw

        def children(logits, d):  # q [B, P, V] and the candidates (tree_children) of P parents
            q = to_vocab(warp(logits, sampling))
            key = spine_keys[d] if d < spine else None  # the spine's node (row 0) draws with it
            return q, *tree_children(tree_scores(logits, sampling, to_vocab), q, k, key, ~sampling.greedy)

        q, token, score, sampled = children(root_logits_b1v, 0)
        # Candidates by depth (the newest last): token, score, spine flag, parent (an expanded
        # node's index, tree_lib.ROOT for the root). Expanded: each expanded node's candidate
        # index, token, parent and ancestor bits.
        cands = [(token[:, 0], score[:, 0], sampled[:, 0], jnp.full((b, k), tree_lib.ROOT, jnp.int32))]
        expanded = tuple(jnp.zeros((b, 0), jnp.int32) for _ in range(4))
        dists_all = [q]  # q at the root, then at each expanded node
        for d in range(1, depth):
            first = sum(c[1].shape[1] for c in cands[:-1])  # the newest depth's first candidate
            expanded, best = expand_depth(expanded, cands[-1], d, k, first)
            newest = jnp.broadcast_to((d - 1) * k + jnp.arange(k), (b, k))
            node_depths = jnp.arange(d * k, dtype=jnp.int32) // k + 1
            exp_cand, exp_token, exp_parent, bits = expanded
            logits, carry = expand(carry, exp_token, exp_parent, node_depths, bits, newest)
            # The spine's node of depth d (expanded first) draws its child's token.
            q, child_token, child_score, child_spine = children(logits, d)
            dists_all.append(q)
            child = (child_token, best[:, :, None] + child_score, child_spine)
            cands.append((*(x.reshape(b, k * k) for x in child), jnp.repeat(newest, k, axis=1)))
        tokens, scores_c, spine_c, parents = (jnp.concatenate(c, axis=1) for c in zip(*cands, strict=True))
        cand_depth = jnp.concatenate([jnp.full(c[1].shape[1], i + 1) for i, c in enumerate(cands)])
        rank = tree_rank(scores_c, spine_c, cand_depth[None, :])
        tree, slots = best_nodes(
            tokens, rank, parents, expanded[0], jnp.concatenate(dists_all, 1), nodes, spine_c
        )
        return tree, slots, carry


def tree_children(child_scores, q, k: int, key, spine_b):
    """(tokens, scores, sampled) [B, P, K] of P parents' candidates (child_scores [B, P, V]:
    tree_scores): the K best-scored tokens of each; with a key (the spine's draw), in the rows of
    spine_b (bool [B]: the sampled rows), the first child of parent 0, the spine's node, is drawn
    from its q (q [B, P, V]: each parent's) and the rest are its K - 1 best others (sampled marks
    the drawn one)."""
    score, token = jax.lax.top_k(child_scores, k)
    sampled = jnp.zeros(token.shape, bool)
    if key is None:
        return token, score, sampled
    b = child_scores.shape[0]
    x = draw_rows(key, q[:, 0])  # [B]
    own = jnp.take_along_axis(child_scores[:, 0], x[:, None], axis=1)  # [B, 1]
    others = child_scores[:, 0].at[jnp.arange(b), x].set(-jnp.inf)
    rest_score, rest_token = jax.lax.top_k(others, k - 1)
    spine = spine_b[:, None]
    token = token.at[:, 0].set(
        jnp.where(spine, jnp.concatenate([x[:, None], rest_token], axis=1), token[:, 0])
    )
    score = score.at[:, 0].set(jnp.where(spine, jnp.concatenate([own, rest_score], axis=1), score[:, 0]))
    return token, score, sampled.at[:, 0, 0].set(spine_b)


def expand_depth(expanded, newest_cands, d: int, k: int, first: int):
    """The K best-ranked (tree_rank) of depth d's candidates expanded. expanded: (candidate index,
    token, parent, ancestor bits) [B, E] of the nodes expanded so far; newest_cands: depth d's
    (token, score, spine, parent) [B, C]; first: the candidate index of its first. Returns
    (expanded with the K appended [B, E + K], their scores [B, K])."""
    exp_cand, exp_token, exp_parent, bits = expanded
    token, score, spine, parents = newest_cands
    _, pick = jax.lax.top_k(tree_rank(score, spine, d), k)  # [B, K]
    best = jnp.take_along_axis(score, pick, axis=1)
    parent = jnp.take_along_axis(parents, pick, axis=1)
    parent_bits = jnp.take_along_axis(bits, jnp.maximum(parent, 0), axis=1) if d > 1 else 0
    own = jnp.left_shift(1, (d - 1) * k + jnp.arange(k, dtype=jnp.int32))[None, :]
    return (
        jnp.concatenate([exp_cand, first + pick], axis=1),
        jnp.concatenate([exp_token, jnp.take_along_axis(token, pick, axis=1)], axis=1),
        jnp.concatenate([exp_parent, parent], axis=1),
        jnp.concatenate([bits, jnp.where(parent >= 0, parent_bits, 0) | own], axis=1),
    ), best


def tree_rank(score, spine, depth):
    """What orders a dynamic tree's candidates: the spine first, in depth order (whatever it
    drew: its nodes are in every tree), then the rest by score (ties in depth order)."""
    return jnp.where(spine, SPINE_RANK - depth, score)


def tree_scores(logits_btv, sampling, to_vocab):
    """float32 [B, T, V]: the log draft probabilities that rank tree candidates, of the warped
    q at temperature > 0 and of softmax(logits) at temperature 0 (where the warped q is
    one-hot), in [log of float32's smallest normal number (~ -87), 0]: a path's sum stays
    finite and a child never outscores its parent (a renormalised warp may round above 1).
    to_vocab: the draft's probabilities onto the target's vocabulary (zeros off its own)."""
    sampling = sampling.for_rows(logits_btv.shape[0])
    greedy = jnp.reshape(sampling.greedy, (-1,) + (1,) * (logits_btv.ndim - 1))
    probs = jnp.where(greedy, jax.nn.softmax(logits_btv, axis=-1), warp(logits_btv, sampling))
    probs = to_vocab(probs.astype(jnp.float32))
    return jnp.log(jnp.clip(probs, np.finfo(np.float32).tiny, 1.0))


def best_nodes(tokens_bc, scores_bc, parents_bc, exp_cand_be, q_b1ev, nodes: int, sampled_bc):
    """(Tree of `nodes` slots, expanded [B, N]): the best-scored of C candidates in rank order.

    tokens, scores, parents: [B, C] the candidates in depth order (scores: their tree_rank),
    each parent an expanded node's index e (ROOT: the root); exp_cand: [B, E] each expanded
    node's candidate index; q: [B, 1 + E, V] the draft's q at the root and at each expanded
    node, the q of a candidate drawn from it (sampled [B, C]: the spine); every other node is a
    point mass (node_q, which is handed the parent's q too). A stable sort keeps ties in depth order, so a
    child (whose score is at most its parent's) ranks after its parent: the first N are
    ancestor-closed and in a topological order. expanded: each slot's expanded index (-1: not
    expanded). Slots past C are empty (q = 0)."""
    b, num = tokens_bc.shape
    order = jnp.argsort(-scores_bc, axis=1, stable=True)
    rank = jnp.argsort(order, axis=1)  # each candidate's slot
    taken = order[:, :nodes]  # [B, min(N, C)]
    parent = jnp.take_along_axis(parents_bc, taken, axis=1)
    parent_cand = jnp.take_along_axis(exp_cand_be, jnp.maximum(parent, 0), axis=1)
    parent_slot = jnp.take_along_axis(rank, parent_cand, axis=1)
    node_tokens = jnp.take_along_axis(tokens_bc, taken, axis=1).astype(jnp.int32)
    parent_q = jnp.take_along_axis(q_b1ev, (1 + parent)[:, :, None], axis=1)
    sampled = jnp.take_along_axis(sampled_bc, taken, axis=1)
    q = jnp.where(sampled[:, :, None], parent_q, node_q(node_tokens, parent_q))
    rows = jnp.arange(b)[:, None]
    expanded = jnp.full((b, num), -1, jnp.int32).at[rows, exp_cand_be].set(jnp.arange(exp_cand_be.shape[1]))
    expanded = jnp.take_along_axis(expanded, taken, axis=1)
    parents = jnp.where(parent >= 0, parent_slot, tree_lib.ROOT).astype(jnp.int32)
    pad = ((0, 0), (0, max(nodes - num, 0)))
    tree = tree_lib.Tree(
        tokens=jnp.pad(node_tokens, pad),
        parents=jnp.pad(parents, pad, constant_values=tree_lib.ROOT),
        q=jnp.pad(q, pad + ((0, 0),)),
    )
    return tree, jnp.pad(expanded, pad, constant_values=-1)
