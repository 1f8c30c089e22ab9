"""The draft-head drafter (models.draft_head, spec_jax.drafting.head): greedy output equals plain
decoding, the head's cache holds the target's true features of the committed text after every
round, and sampling with it is exact (chi-square), while an off-by-one q fails."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import loop_by_hand
from test_distribution import WARPS, chi2_pvalue, exact_joint, pair, sample_counts  # noqa: F401
from test_ngram import cycle_following_target

import models
import spec_jax
from models import draft_head
from models.transformer import init_params
from spec_jax.drafting.head import HeadDrafter
from spec_jax.drafting.trained_head import head_params

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]
MAX_NEW = 13


def random_head(target, seed=1, **kw):
    cfg = draft_head.config_for(target.config, **kw)
    return models.Model(cfg, init_params(cfg, seed))


@pytest.fixture(scope="module")
def target():
    return models.random_model(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0)


def test_a_head_no_wider_or_deeper_than_its_target_is_enforced(target):
    with pytest.raises(ValueError, match=r"mlp_dim must be an integer in \[1, 96\]"):
        draft_head.config_for(target.config, mlp_dim=97)
    with pytest.raises(ValueError, match=r"num_layers must be an integer in \[1, 2\]"):
        draft_head.config_for(target.config, num_layers=3)
    head = random_head(target, mlp_dim=48)
    assert set(head.params) == {"fc", "layers_0"}  # no embedding, final norm or output head of its own
    assert head.params["fc"]["weight"].shape == (32, 64)
    with pytest.raises(ValueError, match="forward runs decoders"):
        models.forward(
            head.config, head.params, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), None
        )


def test_the_head_drafter_refuses_a_head_of_another_width(target):
    other = models.random_model(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="does not fit target"):
        head_params(target, random_head(other))


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("trimmed", [False, True])
def test_greedy_head_drafting_equals_autoregressive(target, gamma, trimmed):
    head = random_head(target, mlp_dim=48)
    ids = np.arange(0, 64, 2) if trimmed else None
    draft = (HeadDrafter(head.config, trimmed=trimmed), head_params(target, head, ids))
    ar = spec_jax.generate(target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    gen = spec_jax.generate(
        target, PROMPTS, draft=draft, gamma=gamma, max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == ar.tokens
    assert gen.stats["num_rounds"] > 0 and gen.stats["fraction_of_rounds_by_drafter"] == {"head": 1.0}
    eos = ar.tokens[2][3]  # a row that stops early
    ar_eos = spec_jax.generate(target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0, eos_id=eos)
    gen_eos = spec_jax.generate(
        target, PROMPTS, draft=draft, gamma=gamma, max_new_tokens=MAX_NEW, temperature=0.0, eos_id=eos
    )
    assert gen_eos.tokens == ar_eos.tokens and len(gen_eos.tokens[2]) <= 4


@pytest.mark.parametrize("trimmed", [True])  # untrimmed: the cycle heads' trees below
def test_greedy_head_trees_equal_autoregressive(target, trimmed):
    """Tree rounds of the head (EAGLE-2's dynamic tree from its own predicted features): the
    output is plain decoding's, a tree of 8 nodes per round."""
    head = random_head(target, mlp_dim=48)
    ids = np.arange(0, 64, 2) if trimmed else None
    draft = (HeadDrafter(head.config, trimmed=trimmed), head_params(target, head, ids))
    ar = spec_jax.generate(target, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    gen = spec_jax.generate(target, PROMPTS, draft=draft, tree=8, max_new_tokens=MAX_NEW, temperature=0.0)
    assert gen.tokens == ar.tokens
    assert gen.stats["num_draft_tokens"] == 8 * gen.stats["num_rounds"]


def cycle_head(target, wrong: dict[int, int], feature_weight: float = 0.0):
    """A head for cycle_following_target (feature at j = sqrt(V) one-hot(t_j)) that predicts the
    feature of the token it is given, sqrt(V) one-hot(t_{j+1}) (so its draft is t_{j+1} + 1,
    the target's choice), except that token a is read mostly as token b for each a: b in wrong
    (its draft is b + 1, which the target rejects; the hidden state still differs from token
    b's, so an acceptance head can tell them apart). Its layer's outputs are zero; its cache
    is written all the same. feature_weight: the feature it reads, added at this weight (small:
    the drafts stay the same, and the cache then depends on which features the head read)."""
    vocab = target.config.vocab_size
    head = random_head(target, seed=3)
    eye = np.eye(vocab, dtype=np.float32)
    read = eye.copy()
    for a, b in wrong.items():
        read[:, a] = 0.9 * eye[b] + 0.3 * eye[a]
    fc = np.concatenate([feature_weight * eye, np.sqrt(vocab) * read], axis=1)

    def edit(path, x):
        name = jax.tree_util.keystr(path)
        if "fc" in name:
            return jnp.asarray(fc)
        if "wo" in name or "w_down" in name:
            return jnp.zeros_like(x)
        return x

    return head.replace(params=jax.tree_util.tree_map_with_path(edit, head.params))


@pytest.mark.parametrize("tree", [0, 6])
def test_a_head_that_predicts_the_cycle_has_every_draft_accepted(tree):
    """A chain of 3, and a tree of 6 nodes (depth 3, width 2): each node reads its parent's
    predicted feature, so the tree's best path is the cycle and every round accepts its whole
    depth (a node fed the root's prediction, or its own, would draft the wrong token)."""
    vocab, gamma, new = 16, 3, 13
    target = cycle_following_target(vocab)
    head = cycle_head(target, {})
    drafter = HeadDrafter(head.config, tree_depth=3)
    draft = (drafter, head_params(target, head))
    prompts = [[3, 4], [10], [15, 0, 1]]
    gen = spec_jax.generate(
        target, prompts, draft=draft, gamma=gamma, tree=tree, max_new_tokens=new, temperature=0.0
    )
    for prompt, tokens in zip(prompts, gen.tokens, strict=True):
        assert tokens == [(prompt[-1] + 1 + i) % vocab for i in range(new)]
    assert gen.stats["mean_accepted_length"] == gamma + 1
    if not tree:
        assert gen.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("tree", [0, 6])
def test_the_heads_cache_holds_the_true_features_of_the_committed_text_after_every_round(tree):
    """Stepping the loop by hand on the cycle target with a head that is wrong after tokens 5 and
    12: rounds accept 0..gamma drafts (a chain of 3; a tree of 6 nodes, depth 3, whose second
    branches make up for some wrong drafts). After every round the head's cache below n - 1
    equals a fresh run of the head over the committed text with the target's true features (its
    pairs (f_j, t_{j+1})), and its kept state equals that run's output at n - 2: after a tree
    round the head has observed the features along the accepted path, not the tree's slots (the
    head reads its features a little, so the cache tells them apart)."""
    vocab, gamma, max_new = 16, tree or 3, 24
    target = cycle_following_target(vocab)
    head = cycle_head(target, {5: 9, 12: 2}, feature_weight=0.05)
    drafter, params = HeadDrafter(head.config, tree_depth=3), head_params(target, head)
    prompt = [2, 3, 4]
    slots = 16 + max_new + gamma
    state, step = loop_by_hand(target, drafter, params, [prompt], gamma, max_new, tree=tree)
    seq = prompt + [(prompt[-1] + 1 + i) % vocab for i in range(max_new)]
    # One fresh run over the whole text the loop will commit (it is known: the cycle), read below
    # n - 1 after each round: the target and the head are causal (each position reads the ones
    # at or before it), so these entries are those of a fresh run over the first n tokens alone,
    # and one program of one shape serves every round.
    text = jnp.asarray([seq + [0] * (slots - len(seq))])
    feats = jax.jit(models.forward, static_argnums=0, static_argnames="with_features")(
        target.config,
        target.params,
        text,
        jnp.arange(slots)[None],
        models.init_cache(target.config, 1, slots),
        with_features=True,
    ).features
    hidden, fresh = jax.jit(draft_head.forward, static_argnums=0)(
        head.config,
        head.params,
        feats[:, : slots - 1],
        text[:, 1:],
        jnp.arange(slots - 1)[None],
        draft_head.new_cache(head.config, 1, slots),
        params.embed,
    )
    accepted = set()
    checks = 0
    while True:
        n = int(state.length[0])
        committed = np.asarray(state.out.tokens)[0, : n - len(prompt)].tolist()
        assert committed == seq[len(prompt) : n]
        cache = state.draft_state.cache
        np.testing.assert_allclose(cache.k[:, 0, : n - 1], fresh.k[:, 0, : n - 1], atol=1e-5)
        np.testing.assert_allclose(cache.v[:, 0, : n - 1], fresh.v[:, 0, : n - 1], atol=1e-5)
        np.testing.assert_allclose(state.draft_state.hidden[0], hidden[0, n - 2], atol=1e-5)
        checks += 1
        if bool(state.out.done[0]):
            break
        before = state.metrics.num_accepted_tokens
        state = step(state)
        accepted.add(int(state.metrics.num_accepted_tokens - before))
    if tree:  # every round accepts the depth: a wrong first choice's sibling is right (the
        # chain's rounds reject there), so those paths run through later slots
        assert checks > 5 and accepted == {3}, accepted
    else:
        assert checks > 5 and {0, gamma} <= accepted and len(accepted) >= 3, accepted


@pytest.fixture(scope="module")
def v8_head(pair):  # noqa: F811
    target, _ = pair
    head = random_head(target, seed=11)
    return HeadDrafter(head.config), head_params(target, head)


def test_head_drafting_matches_target_distribution_exactly(pair, v8_head):  # noqa: F811
    target, _ = pair
    counts, s = sample_counts(target, v8_head, WARPS[0], gamma=2, seed=0)
    assert 0.1 < s["acceptance_rate"] < 0.95 and s["accepted_histogram"][2] > 100
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) > 1e-3


@dataclasses.dataclass(frozen=True)
class OffByOneHead(HeadDrafter):
    """Broken on purpose: samples each draft from its q but hands the rule the q of the position
    before (the first position keeps its own), the classic misalignment of a chained draft."""

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        tokens, q, state = super().propose(params, state, context_b2, length_b, gamma, sampling, keys_b)
        return tokens, jnp.concatenate([q[:, :1], q[:, :-1]], axis=1), state


def test_a_head_handing_the_rule_the_previous_positions_q_fails(pair, v8_head):  # noqa: F811
    target, _ = pair
    drafter, params = v8_head
    broken = OffByOneHead(drafter.config)
    counts, _ = sample_counts(target, (broken, params), WARPS[0], gamma=2, seed=0)
    assert chi2_pvalue(counts, exact_joint(target, WARPS[0])) < 1e-6
