"""Token trees from the model-free drafters (spec_jax.drafting.lookup, spec_jax.drafting.suffix):
the trie of a hand-made buffer, against a by-hand reference on random ragged batches, its shape
(distinct siblings, topological slots, at most `nodes`, empty without a match), the chain as a
special case, `accepted` writing the path, and greedy verification taking the text's branch."""

import collections
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.drafting import lookup, suffix, suffix_table
from spec_jax.sampling import SamplingParams
from spec_jax.tree import ROOT, Tree, chain, verify_tree

V = 10
GREEDY = SamplingParams(0.0)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _propose_tree(drafter, params, buffer, context, length, nodes, keys):
    return drafter.propose_tree(params, buffer, context, length, nodes, GREEDY, keys)


def propose_tree(drafter, rows, lengths, nodes, params=(), width=None):
    """(Tree as NumPy arrays, the state) of drafter.propose_tree on token rows padded with 0;
    the context is each row's tokens at length - 2, length - 1."""
    width = width or max(len(r) for r in rows) + nodes
    buffer = jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32)
    length = jnp.asarray(lengths, jnp.int32)
    context = jnp.asarray([r[n - 2 : n] for r, n in zip(rows, lengths, strict=True)], jnp.int32)
    keys = jax.random.split(jax.random.key(0), len(rows))
    tree, state = _propose_tree(drafter, params, buffer, context, length, nodes, keys)
    return jax.tree.map(np.asarray, tree), state


def present(tree):
    return np.asarray(tree.q).sum(-1) > 0


def distinct_siblings(tree) -> bool:
    """Whether no two present nodes of a row share both parent and token."""
    for b in range(tree.tokens.shape[0]):
        pairs = [
            (int(p), int(t))
            for p, t, h in zip(tree.parents[b], tree.tokens[b], present(tree)[b], strict=True)
            if h
        ]
        if len(pairs) != len(set(pairs)):
            return False
    return True


def check_shape(tree, nodes):
    """At most `nodes` slots, a parent before its child and present, siblings distinct, q the
    one-hot of its token, and empty slots (q = 0) only after the nodes."""
    assert tree.tokens.shape[1] == tree.parents.shape[1] == tree.q.shape[1] == nodes
    here = present(tree)
    for b in range(tree.tokens.shape[0]):
        for i in range(nodes):
            if here[b, i]:
                parent = int(tree.parents[b, i])
                assert parent == ROOT or (0 <= parent < i and here[b, parent]), (b, i, parent)
                np.testing.assert_array_equal(tree.q[b, i], np.eye(V)[tree.tokens[b, i]])
        assert not np.any(here[b, np.argmin(here[b]) :]) or here[b].all(), "empty slots come last"
    assert distinct_siblings(tree)


def node_paths(tree, b):
    """{slot: the tokens from the root to it} of row b's present nodes."""
    paths = {}
    for i in range(tree.tokens.shape[1]):
        if present(tree)[b, i]:
            parent = int(tree.parents[b, i])
            paths[i] = (paths[parent] if parent != ROOT else ()) + (int(tree.tokens[b, i]),)
    return paths


def leaf_paths(tree, b):
    paths = node_paths(tree, b)
    parents = {int(tree.parents[b, i]) for i in paths}
    return {p for i, p in paths.items() if i not in parents}


# --- prompt lookup ------------------------------------------------------------------------------

# Positions 0..14; the last 2-gram "1 2" also ends at 1, 5 and 9: three continuations.
ROW = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 9, 1, 2]


def test_the_lookup_trie_of_a_hand_made_buffer():
    tree, _ = propose_tree(lookup.PromptLookupDrafter(V, max_ngram=2), [ROW], [15], nodes=6)
    # Candidates (the most recent first), 6 tokens each: ending at 9 -> 3 7 9 1 2 3 (the text
    # repeats with period 5 past its end), at 5 -> 5 6 1 2 3 7, at 1 -> 3 4 1 2 5 6. "3" has
    # support 2 + 2; every other node 2: then by depth, then by candidate.
    #        root
    #      /      \
    #    3 (0)    5 (1)
    #    /   \       \
    #  7 (2)  4 (4)  6 (3)
    #   |
    #  9 (5)
    assert tree.tokens[0].tolist() == [3, 5, 7, 6, 4, 9]
    assert tree.parents[0].tolist() == [ROOT, ROOT, 0, 1, 0, 2]
    check_shape(tree, 6)


def test_one_candidate_gives_the_chain_of_propose():
    drafter = lookup.PromptLookupDrafter(V, max_ngram=3)
    row = [4, 5, 6, 8, 9, 1, 7, 4, 5, 6]  # "4 5 6" once before: ends at 2
    tree, state = propose_tree(drafter, [row], [10], nodes=5)
    buffer = jnp.asarray([row + [0] * 5], jnp.int32)
    context, length = buffer[:, 8:10], jnp.asarray([10])
    tokens, q, _ = drafter.propose(None, buffer, context, length, 5, GREEDY, None)
    expected = chain(tokens, q)
    assert tokens[0].tolist() == [8, 9, 1, 7, 4]
    np.testing.assert_array_equal(tree.tokens, expected.tokens)
    np.testing.assert_array_equal(tree.parents, expected.parents)
    np.testing.assert_array_equal(tree.q, expected.q)


def by_hand_lookup_tree(row, length, max_ngram, nodes):
    """(tokens, parents) of the lookup trie, written out: every earlier end j with its longest
    match m_j, the `nodes` best by (m_j, j), their continuations, a node per distinct prefix,
    the nodes by (support desc, depth, candidate)."""
    t = row[:length]
    found = []
    for j in range(length - 1):
        m = max(
            (n for n in range(1, max_ngram + 1) if n <= j + 1 and t[j - n + 1 : j + 1] == t[length - n :]),
            default=0,
        )
        if m:
            found.append((m, j))
    found = sorted(found, reverse=True)[:nodes]
    prefixes = {}  # prefix -> [support, depth, first candidate]
    for c, (m, j) in enumerate(found):
        period = length - 1 - j
        cont = tuple(t[j + 1 + i % period] for i in range(nodes))
        for i in range(nodes):
            entry = prefixes.setdefault(cont[: i + 1], [0, i, c])
            entry[0] += m
    order = sorted(prefixes, key=lambda p: (-prefixes[p][0], prefixes[p][1], prefixes[p][2]))[:nodes]
    slot = {p: i for i, p in enumerate(order)}
    tokens = [p[-1] for p in order] + [0] * (nodes - len(order))
    parents = [slot[p[:-1]] if len(p) > 1 else ROOT for p in order] + [ROOT] * (nodes - len(order))
    return tokens, parents


def test_the_lookup_trie_equals_the_by_hand_trie_on_a_ragged_batch():
    """Random rows of a 4-token vocabulary (many matches of every length, repeats near the end)
    at different lengths, rows without a match among them; each row alone as in the batch."""
    rng = np.random.default_rng(0)
    drafter, nodes = lookup.PromptLookupDrafter(V, max_ngram=3), 7
    rows = [rng.integers(0, 4, 24).tolist() for _ in range(6)] + [[1, 2, 3, 4, 5, 6, 7, 8]]
    lengths = [24, 20, 13, 7, 3, 2, 8]
    tree, _ = propose_tree(drafter, rows, lengths, nodes, width=32)
    check_shape(tree, nodes)
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        tokens, parents = by_hand_lookup_tree(row, n, 3, nodes)
        assert tree.tokens[b].tolist() == tokens, b
        assert tree.parents[b].tolist() == parents, b
        alone, _ = propose_tree(drafter, [row], [n], nodes, width=32)
        np.testing.assert_array_equal(alone.tokens[0], tree.tokens[b])
    assert not present(tree)[-1].any(), "no earlier occurrence of '8': an empty tree"
    buffer = jnp.asarray([r + [0] * (32 - len(r)) for r in rows], jnp.int32)
    end, _ = lookup.candidates(buffer, jnp.asarray(lengths), 3, nodes)
    found, chain_end, _ = lookup.find_match(buffer, jnp.asarray(lengths), 3)
    np.testing.assert_array_equal(chain_end, end[:, 0])  # the chain's match: the first candidate
    assert np.asarray(found).tolist() == [True] * 4 + [False] * 3
    assert present(tree).sum(1).tolist() == [nodes] * 4 + [0] * 3  # "3 2": no "2" before it
    assert len({tuple(p) for p in tree.parents[:4].tolist()}) == 4, "four rows, four tree shapes"


def test_the_trie_paths_are_exactly_the_continuations_merged():
    """With room for every node, the root-to-leaf paths of lookup.trie are the candidates'
    continuations, duplicates and shared prefixes merged; a zero weight is no candidate."""
    continuations = [[3, 7, 9], [5, 6, 1], [3, 4, 1], [3, 7, 2], [3, 7, 9], [8, 8, 8]]
    weights = [2, 2, 2, 1, 1, 0]
    tree = lookup.trie(jnp.asarray([continuations]), jnp.asarray([weights]), 12, V)
    tree = jax.tree.map(np.asarray, tree)
    check_shape(tree, 12)
    assert leaf_paths(tree, 0) == {tuple(c) for c, w in zip(continuations, weights, strict=True) if w}
    assert int(present(tree).sum()) == 9  # 3, 3 7, 3 7 9, 3 7 2, 3 4, 3 4 1, 5, 5 6, 5 6 1
    assert tree.tokens[0, 0] == 3 and tree.parents[0, 0] == ROOT  # support 6: first
    assert node_paths(tree, 0)[1] == (3, 7)  # support 4, then the rest by support and depth


def test_the_sibling_check_catches_unmerged_prefixes():
    """The broken variant: the chains of two candidates that share their first token, side by
    side without merging, have two root children with one token; the check says so."""
    tokens = np.asarray([[3, 7, 3, 4]])
    parents = np.asarray([[ROOT, 0, ROOT, 2]])
    q = np.eye(V, dtype=np.float32)[tokens]
    assert not distinct_siblings(Tree(tokens, parents, q))
    merged = lookup.trie(jnp.asarray([[[3, 7], [3, 4]]]), jnp.asarray([[1, 1]]), 3, V)
    assert distinct_siblings(jax.tree.map(np.asarray, merged))


def greedy_target(tree, texts):
    """p for verify_tree from a target that greedily continues row b with texts[b]: the point
    mass at text[d] after the root (d = 0) or a node of depth d on text's path, at 0 elsewhere."""
    b, n = tree.tokens.shape
    p = np.zeros((b, n + 1, V), np.float32)
    for row, text in enumerate(texts):
        p[row, 0, text[0]] = 1.0
        for i, path in node_paths(tree, row).items():
            on_text = tuple(text[: len(path)]) == path
            p[row, 1 + i, text[len(path)] if on_text and len(path) < len(text) else 0] = 1.0
    return jnp.asarray(p)


def longest_path_on(tree, row, text):
    """How many of text's first tokens are a root-to-node path of the tree."""
    paths = set(node_paths(tree, row).values())
    return max((d for d in range(1, len(text)) if tuple(text[:d]) in paths), default=0)


@pytest.mark.parametrize(
    "drafter", [lookup.PromptLookupDrafter(V, max_ngram=3), suffix.SuffixDrafter(V, max_ngram=3)], ids=type
)
def test_greedy_verification_accepts_the_longest_path_of_the_targets_tokens(drafter):
    """verify_tree with point masses at temperature 0 on the drafters' trees of a ragged batch:
    each row accepts exactly the longest path of the target's greedy text (a branch of the
    tree changed at a random depth), then the target's next token."""
    rng = np.random.default_rng(2)
    nodes = 7
    rows = [rng.integers(0, 3, 20).tolist() for _ in range(5)] + [[4, 5, 6, 7]]
    lengths = [20, 18, 12, 7, 5, 4]
    tree, _ = propose_tree(drafter, rows, lengths, nodes, width=32)
    texts = []
    for b in range(len(rows)):
        paths = sorted(node_paths(tree, b).values(), key=len)
        text = list(paths[rng.integers(len(paths))] if paths else ()) + rng.integers(0, V, nodes + 1).tolist()
        cut = int(rng.integers(0, len(text)))
        text[cut] = (text[cut] + 1 + int(rng.integers(V - 1))) % V  # leaves the branch here (or past it)
        texts.append(text)
    keys = jax.random.split(jax.random.key(0), len(rows))
    path, count, nxt = verify_tree(jax.tree.map(jnp.asarray, tree), greedy_target(tree, texts), keys)
    expected = [longest_path_on(tree, b, t) for b, t in enumerate(texts)]
    assert np.asarray(count).tolist() == expected
    assert np.asarray(nxt).tolist() == [t[d] for t, d in zip(texts, expected, strict=True)]
    for b, d in enumerate(expected):
        assert tuple(int(tree.tokens[b, i]) for i in np.asarray(path)[b, :d]) == tuple(texts[b][:d])
    assert len(set(expected)) > 2, "rows accept paths of different depths"


def test_greedy_verification_takes_the_branch_the_text_takes_and_accepted_writes_it():
    drafter = lookup.PromptLookupDrafter(V, max_ngram=2)
    tree, state = propose_tree(drafter, [ROW], [15], nodes=6)
    np.testing.assert_array_equal(np.asarray(state)[0], ROW + [0] * 6)  # as it was: no nodes written
    # The target goes on as the occurrence ending at 1 did: 3 4 (node 0, then node 4), then 8.
    text = [3, 4, 8]
    path, count, nxt = verify_tree(
        jax.tree.map(jnp.asarray, tree), greedy_target(tree, [text]), jax.random.split(jax.random.key(0), 1)
    )
    assert int(count[0]) == 2 and np.asarray(path)[0, :2].tolist() == [0, 4] and int(nxt[0]) == 8
    after = drafter.accepted(None, state, jax.tree.map(jnp.asarray, tree), path, count, jnp.asarray([15]))
    np.testing.assert_array_equal(np.asarray(after)[0, :17], ROW + [3, 4])
    np.testing.assert_array_equal(
        np.asarray(after)[0, 17:], np.asarray(state)[0, 17:]
    )  # past the path: as it was


def test_accepted_writes_each_rows_path_at_its_length():
    tree = Tree(
        tokens=jnp.asarray([[5, 6, 7], [8, 9, 4]], jnp.int32),
        parents=jnp.asarray([[ROOT, ROOT, 1], [ROOT, 0, 1]], jnp.int32),
        q=jnp.ones((2, 3, V)),
    )
    buffer = jnp.zeros((2, 8), jnp.int32)
    path = jnp.asarray([[1, 2, ROOT], [0, 1, 2]], jnp.int32)
    for drafter in (lookup.PromptLookupDrafter(V), suffix.SuffixDrafter(V)):
        after = drafter.accepted((), buffer, tree, path, jnp.asarray([2, 3]), jnp.asarray([3, 5]))
        assert np.asarray(after).tolist() == [[0, 0, 0, 6, 7, 0, 0, 0], [0, 0, 0, 0, 0, 8, 9, 4]]


# --- suffix -------------------------------------------------------------------------------------


def test_the_suffix_tree_of_a_hand_made_buffer():
    tree, state = propose_tree(suffix.SuffixDrafter(V, max_ngram=2), [ROW], [15], nodes=6)
    # After "1 2": 3 (2 of 3), 5 (1 of 3). After "2 3": 4, 7 (1 of 2 each): scores 1/3; after
    # "2 5": 6 (1 of 1): 1/3. Equal scores: the earlier node's children first, the lower id.
    # After "3 4": 1 (1/3 * 1), before 7's and 6's children (also 1/3, later nodes).
    assert tree.tokens[0].tolist() == [3, 5, 4, 7, 6, 1]
    assert tree.parents[0].tolist() == [ROOT, ROOT, 0, 0, 1, 2]
    check_shape(tree, 6)
    np.testing.assert_array_equal(np.asarray(state)[0, :15], ROW)
    # threshold: a child whose count fraction is below it never joins (the root's 5, 1/3; 3's 4
    # and 7, 1/2 each); then 3's only child would be below it too: a one-node tree
    tree, _ = propose_tree(suffix.SuffixDrafter(V, max_ngram=2, threshold=0.6), [ROW], [15], nodes=6)
    assert present(tree)[0].tolist() == [True] + [False] * 5 and tree.tokens[0, 0] == 3


def by_hand_counts(text, max_ngram):
    """Counter of what followed the earlier occurrences of text's longest matching suffix."""
    for n in range(min(max_ngram, len(text) - 1), 0, -1):
        after = collections.Counter(
            text[j + 1] for j in range(n - 1, len(text) - 1) if text[j - n + 1 : j + 1] == text[-n:]
        )
        if after:
            return after
    return collections.Counter()


def test_the_suffix_tree_is_the_best_first_tree_of_the_counts_on_a_ragged_batch():
    """Every node is a successor of the text through its parent, with its count fraction as
    counted by hand; the scores (products of fractions) never rise from slot to slot, and no
    child left out of the tree scores more than the last one in it (best first: the top
    `nodes`); rows without a match are empty."""
    rng = np.random.default_rng(1)
    drafter, nodes = suffix.SuffixDrafter(V, max_ngram=3), 8
    rows = [rng.integers(0, 3, 20).tolist() for _ in range(4)] + [[4, 5, 6, 7]]
    lengths = [20, 16, 9, 5, 4]
    tree, _ = propose_tree(drafter, rows, lengths, nodes, width=32)
    check_shape(tree, nodes)
    assert not present(tree)[-1].any()
    for b in range(4):
        text = rows[b][: lengths[b]]
        paths = node_paths(tree, b)
        score = {(): 1.0}
        for i in sorted(paths):
            path = paths[i]
            counts = by_hand_counts(text + list(path[:-1]), 3)
            assert counts[path[-1]] > 0, (b, path)
            score[path] = score[path[:-1]] * counts[path[-1]] / sum(counts.values())
        chosen = [score[paths[i]] for i in sorted(paths)]
        assert all(a >= c - 1e-6 for a, c in zip(chosen, chosen[1:], strict=False)), chosen
        left_out = [
            score[p] * count / sum(counts.values())
            for p in score
            for counts in [by_hand_counts(text + list(p), 3)]
            for token, count in counts.items()
            if p + (token,) not in score
        ]
        if len(paths) == nodes:
            assert max(left_out, default=0.0) <= chosen[-1] + 1e-6
        else:
            assert not left_out, "room left, yet a child is missing"


def test_with_one_successor_everywhere_the_suffix_tree_is_the_greedy_chain():
    drafter = suffix.SuffixDrafter(V, max_ngram=2, match_factor=math.inf)  # the chain: gamma long
    row = [1, 2, 3, 4, 5, 6, 1, 2]  # every context has one successor: 3 4 5 6 1 2 ...
    tree, _ = propose_tree(drafter, [row], [8], nodes=5)
    buffer = jnp.asarray([row + [0] * 5], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 1)
    tokens, q, _ = drafter.propose((), buffer, buffer[:, 6:8], jnp.asarray([8]), 5, GREEDY, keys)
    expected = chain(tokens, q)
    assert tokens[0].tolist() == [3, 4, 5, 6, 1]
    np.testing.assert_array_equal(tree.tokens, expected.tokens)
    np.testing.assert_array_equal(tree.parents, expected.parents)
    np.testing.assert_array_equal(tree.q, expected.q)


def test_the_suffix_tree_reads_the_corpus_table_where_the_row_has_no_match():
    tables = suffix_table.fit_suffix_tables([[7, 8, 1, 7, 8, 2]], V, max_ngram=2, min_count=1)
    row = [4, 5, 7, 8]  # "7 8" never occurred in the row: the table's 1 and 2 (once each)
    tree, _ = propose_tree(suffix.SuffixDrafter(V, max_ngram=2), [row], [4], nodes=2, params=tables)
    assert tree.tokens[0].tolist() == [1, 2] and tree.parents[0].tolist() == [ROOT, ROOT]
    tree, _ = propose_tree(suffix.SuffixDrafter(V, max_ngram=2), [row], [4], nodes=2)
    assert not present(tree).any(), "without the table: no match, an empty tree"
