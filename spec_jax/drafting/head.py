"""Drafting with a draft head on the target's features (models.draft_head; EAGLE-1). Its arrays
for a target, and a trained head's loading, are spec_jax.drafting.trained_head's.

The head needs the target's feature at every committed position, and the target computes them
anyway: the verification call of each round returns its features beside its logits (one call,
no extra target pass). The drafter therefore has one more hook than the others, `observe`,
which the loop calls after the rule with the features of the positions the target scored and
the tokens the row committed after them:

  prefill   the target's features f_0 .. f_{P-1} of the prompt: `init` runs the head over the
            pairs (f_j, t_{j+1}) into its cache; the last pair waits for the first new token,
            which `observe` then feeds (position P-1).
  round     the target scores t_{n-1}, d_0 .. d_{G-1} at n-1 .. n-1+G and returns f_{n-1} ..
            f_{n-1+G}; the row commits c tokens t_n .. t_{n+c-1}, so the pairs (f_{n-1+i},
            t_{n+i}) for i < c are real: `observe` runs the head over all G + 1 (one shape) at
            positions n-1 .. n-1+G and keeps its output at i = c - 1 (position n'-2, n' = n + c),
            the prediction of f_{n'-1}. Pairs past c hold rejected drafts; they sit at positions
            >= n'-1, which `propose` overwrites before anything reads them.
  propose   draft 0 comes from the kept prediction through the target's output head; draft i
            feeds (prediction of f_{n'-2+i}, d_{i-1}) at position n'-2+i and reads the next.

So after `observe` the head's cache holds, below n'-1, exactly what a run of the head over the
committed text with the target's true features would hold (tests/test_head.py checks it
against a fresh prefill after every round), whatever was accepted or rejected. The draft
distribution q is the head's (over the output head's token subset, 0 elsewhere, as a
vocabulary-trimmed draft), and the drafts are sampled from it, so the rule stays exact.
"""

import dataclasses
import functools
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

import spec_jax.drafting.acceptance_head as acceptance_head
from models import draft_head
from models.cache import KVCache
from models.config import ModelConfig
from spec_jax import sharding
from spec_jax.decode import PAD_ID
from spec_jax.drafting.base import Drafter, Proposal, TimedCall, TreeProposal
from spec_jax.drafting.dynamic_tree import DynamicTree
from spec_jax.drafting.model import TrimmedHead, on_ids
from spec_jax.sampling import RowSampling, draw_rows, split_rows, warp


@flax.struct.dataclass
class HeadParams:
    head: Any  # the head's parameters (models.draft_head, any precision)
    embed: Any  # the target's input embedding [V, D]
    out: TrimmedHead  # the target's output head, its rows for the drafted tokens (all: ids = 0..V-1)
    acceptance: Any = (
        None  # spec_jax.drafting.acceptance_head.AcceptanceParams, for HeadDrafter.stop_rejection
    )


@flax.struct.dataclass
class HeadState:
    cache: KVCache  # the head's cache: exact below length - 1 after observe
    hidden: jax.Array  # [B, D]: the head's prediction of the target's feature at length - 1


@dataclasses.dataclass(frozen=True)
class HeadDrafter(DynamicTree, Drafter):
    """Drafts with a draft head (models.draft_head) from the target's features.

    config: the head's config. trimmed: the output head holds a subset of the vocabulary
    (HeadParams.out.ids) and q is 0 off it. threshold: a row stops drafting at the first
    position whose top probability (before the warp) is below it, as ModelDrafter's.
    stop_rejection: with an acceptance head (HeadParams.acceptance, spec_jax.drafting.acceptance_head), a row
    stops drafting before the first position where the head's probability that at least one of
    its drafts so far is rejected exceeds this (SpecDec++); 0 = off. Both stops read only the
    drafter's own signals, so the output stays exact.

    tree_depth (D), tree_width (K): the dynamic tree of a tree round (propose_tree, EAGLE-2, as
    ModelDrafter's, its spine drawn from q at temperature > 0); tree_width 0: the chain of
    `propose`. The head's cache has K * (D - 1)
    slots (tree_queries) more than the loop asks for, so that the widest tree call fits.
    """

    config: ModelConfig
    trimmed: bool = False
    threshold: float = 0.0
    stop_rejection: float = 0.0
    prefill_calls: int = 1
    tree_depth: int = 16
    tree_width: int = 2
    sources: ClassVar[tuple[str, ...]] = ("head",)
    reads_features: ClassVar[bool] = True

    @property
    def variable_length(self) -> bool:
        return self.threshold > 0 or self.stop_rejection > 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def init(
        self, params: HeadParams, tokens_bp, prompt_lens_b, cache_len: int, features_bpd=None
    ) -> HeadState:
        """The head over the prompt's pairs (f_j, t_{j+1}); the pair at each row's last prompt
        position holds padding until observe feeds the first new token there."""
        batch, width = tokens_bp.shape
        next_tokens = jnp.concatenate(
            [tokens_bp[:, 1:], jnp.full((batch, 1), PAD_ID, tokens_bp.dtype)], axis=1
        )
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        cache = draft_head.new_cache(self.config, batch, cache_len + self.tree_queries)
        _, cache = draft_head.forward(
            self.config, params.head, features_bpd, next_tokens, positions, cache, params.embed
        )
        hidden = jnp.zeros((batch, self.config.d_model), self.config.jnp_dtype)
        return HeadState(cache=cache, hidden=hidden)

    def observe(
        self, params: HeadParams, state: HeadState, features_bcd, tokens_bc, start_b, count_b
    ) -> HeadState:
        """Feeds the pairs (features[:, i], tokens[:, i]) at positions start + i (C of them, one
        shape) and keeps the head's output at i = count - 1 (count in [1, C]: the pairs that are
        real; the rest are overwritten before they are read)."""
        width = tokens_bc.shape[1]
        positions = start_b[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        hidden, cache = draft_head.forward(
            self.config, params.head, features_bcd, tokens_bc, positions, state.cache, params.embed
        )
        last = jnp.take_along_axis(hidden, (count_b - 1)[:, None, None], axis=1)[:, 0]
        return HeadState(cache=cache, hidden=last)

    def on_target_vocab(self, params: HeadParams, probs):
        """[..., V]: probabilities over the output head's rows ([..., R]) as the target's
        vocabulary (zeros off a trimmed head's tokens)."""
        return on_ids(probs, params.out.ids, self.vocab_size) if self.trimmed else probs

    def distribution(self, params: HeadParams, hidden_bd, sampling: RowSampling):
        """(q [B, V] warped, confidence [B], entropy [B]) of the token after a hidden state,
        through the (trimmed) output head; confidence and entropy are of the unwarped
        distribution (so that greedy decoding has them too)."""
        logits = draft_head.logits(hidden_bd[:, None], params.out.weight, self.config)[:, 0]
        q = self.on_target_vocab(params, warp(logits, sampling))
        logp = jax.nn.log_softmax(logits, axis=-1)
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return q, jnp.exp(jnp.max(logp, axis=-1)), entropy

    def draft_chain(self, params: HeadParams, state: HeadState, length_b, gamma: int, sampling, keys_b):
        """Drafts up to gamma tokens per row: (tokens [B, G], q [B, G, V] (0 from a row's first
        unproposed position), signals {"hidden" [B, G, D], "confidence", "entropy",
        "reject" [B, G]} of each position drafted, new cache).

        Draft i is drawn from the head's output for the pair (prediction of f_{n-2+i}, d_{i-1})
        at position n - 2 + i (draft 0 from the kept prediction). A row stops at the first
        position its stop rule refuses (threshold: confidence below it; stop_rejection: the
        acceptance head's probability that some draft so far is rejected above it), and the
        loop ends when no row drafts: a stop saves the remaining head calls too.
        """
        batch, vocab, width = length_b.shape[0], self.vocab_size, self.config.d_model
        keys = split_rows(keys_b, gamma)  # [G, B]
        dtype = self.config.jnp_dtype
        empty = dict(
            tokens=jnp.zeros((batch, gamma), jnp.int32),
            q=jnp.zeros((batch, gamma, vocab), jnp.float32),
            hidden=jnp.zeros((batch, gamma, width), dtype),
            confidence=jnp.zeros((batch, gamma), jnp.float32),
            entropy=jnp.zeros((batch, gamma), jnp.float32),
            reject=jnp.zeros((batch, gamma), jnp.float32),
        )

        def position(i, hidden, drafting, survive, out):
            q, conf, entropy = self.distribution(params, hidden, sampling)
            token = draw_rows(keys[i], q)
            keep, survive, reject = self.stop_rule(params, i, hidden, conf, entropy, drafting, survive)
            rows = (("tokens", token), ("q", q * keep[:, None]), ("hidden", hidden))
            rows += (("confidence", conf), ("entropy", entropy), ("reject", reject))
            out = {k: out[k].at[:, i].set(v.astype(out[k].dtype)) for k, v in rows}
            return keep, survive, out

        drafting, survive, out = position(
            0, state.hidden, jnp.ones((batch,), bool), jnp.ones((batch,)), empty
        )

        def cond(carry):
            i, _, _, drafting, _, _ = carry
            return (i < gamma) & jnp.any(drafting)

        def body(carry):
            i, hidden, cache, drafting, survive, out = carry
            pos = (length_b - 2 + i)[:, None]
            prev = out["tokens"][:, i - 1]
            step, cache = draft_head.forward(
                self.config, params.head, hidden[:, None], prev[:, None], pos, cache, params.embed
            )
            drafting, survive, out = position(i, step[:, 0], drafting, survive, out)
            return i + 1, step[:, 0], cache, drafting, survive, out

        carry = (jnp.ones((), jnp.int32), state.hidden, state.cache, drafting, survive, out)
        _, _, cache, _, _, out = jax.lax.while_loop(cond, body, carry)
        signals = {k: out[k] for k in ("hidden", "confidence", "entropy", "reject")}
        return out["tokens"], out["q"], signals, cache

    def stop_rule(self, params: HeadParams, i: int, hidden, conf, entropy, drafting, survive):
        """Which rows still draft at position i: (keep bool [B], survive [B], reject [B] float32).
        A row keeps drafting while it was (drafting), its confidence is at least threshold (when
        > 0), and with stop_rejection > 0 while the acceptance head's probability that some draft
        so far is rejected, 1 - survive (survive: the product of 1 - reject), is at most it;
        reject is 0 without an acceptance stop."""
        keep = drafting
        reject = jnp.zeros_like(conf)
        if self.threshold > 0:
            keep = keep & (conf >= self.threshold)
        if self.stop_rejection > 0:
            reject = acceptance_head.reject_probability(
                params.acceptance, acceptance_head.signals(hidden, conf, entropy, i)
            )
            survive = survive * (1.0 - reject)
            keep = keep & (1.0 - survive <= self.stop_rejection)
        return keep, survive, reject

    def propose(self, params: HeadParams, state: HeadState, context_b2, length_b, gamma, sampling, keys_b):
        tokens, q, _, cache = self.draft_chain(params, state, length_b, gamma, sampling, keys_b)
        return Proposal(tokens, q, state.replace(cache=cache))

    def propose_tree(
        self, params: HeadParams, state: HeadState, context_b2, length_b, nodes, sampling, keys_b
    ):
        """EAGLE-2's dynamic tree (DynamicTree.dynamic_tree) of `nodes` slots per row, from the
        head's own predicted features.

        The root's candidates come from the kept prediction (of f_{n-1}), as draft 0 of a chain.
        A node of depth d and token x feeds the pair (its parent's predicted feature, x) at
        position n - 2 + d, as the chain's draft d - 1 feeds (prediction, d_{d-2}), and its output
        predicts the feature after it, whose output-head distribution gives its children. Each
        expansion is one head call over the nodes expanded so far (slots n - 1 .. n - 2 + E,
        the committed pairs below n - 1 and its ancestors read through the tree mask). The pairs
        it leaves at slots >= n - 1 are overwritten by `observe` (the target's features along
        the accepted path) or past the path before anything reads them, so `accepted` is the
        default. keys_b is unused (the candidates are top-k)."""
        if not self.tree_width:
            return super().propose_tree(params, state, context_b2, length_b, nodes, sampling, keys_b)
        cfg = self.config

        def expand(carry, tokens, parents, depths, bits, newest):
            cache, hidden = carry  # hidden [B, E - K, D]: the previous call's outputs
            known = jnp.concatenate([state.hidden[:, None], hidden], axis=1)  # the root's first
            features = jnp.take_along_axis(known, (parents + 1)[:, :, None], axis=1)
            positions = (length_b - 2)[:, None] + depths[None, :]
            out, cache = draft_head.forward(
                cfg, params.head, features, tokens, positions, cache, params.embed, tree=bits
            )
            newest_out = jnp.take_along_axis(out, newest[:, :, None], axis=1)
            return draft_head.logits(newest_out, params.out.weight, cfg), (cache, out)

        root_logits = draft_head.logits(state.hidden[:, None], params.out.weight, cfg)  # [B, 1, R]
        empty = jnp.zeros((length_b.shape[0], 0, cfg.d_model), state.hidden.dtype)
        to_vocab = functools.partial(self.on_target_vocab, params)
        tree, _, (cache, _) = self.dynamic_tree(
            root_logits, expand, (state.cache, empty), nodes, sampling, to_vocab, keys_b
        )
        return TreeProposal(tree, state.replace(cache=cache))

    def for_mesh(self, mesh):
        return dataclasses.replace(self, config=sharding.for_mesh(self.config, mesh))

    def param_shardings(self, params: HeadParams, mesh):
        """The head by the rule table, the target's input embedding as the target's; the output
        head's rows and an acceptance head replicated."""
        replicated = sharding.replicated(mesh)
        return params.replace(
            head=sharding.param_shardings(params.head, mesh),
            embed=sharding.weight_shardings(("embed", "embedding"), params.embed, mesh),
            out=jax.tree.map(lambda _: replicated, params.out),
            acceptance=jax.tree.map(lambda _: replicated, params.acceptance),
        )

    def timed_call(self, params: HeadParams):
        """A drafting step (width 1) and a 2-pair call (a round's observe call and first draft)
        over the target's features (here ones), through the (trimmed) output head."""
        cfg, rows = self.config, int(params.out.ids.shape[0])

        def call(params, cache, positions_bw):
            feats = jnp.ones(positions_bw.shape + (cfg.d_model,), cfg.jnp_dtype)
            tokens = jnp.ones(positions_bw.shape, jnp.int32)
            hidden, cache = draft_head.forward(
                cfg, params.head, feats, tokens, positions_bw, cache, params.embed
            )
            return draft_head.logits(hidden[:, -1:], params.out.weight, cfg), cache

        new_cache = functools.partial(draft_head.new_cache, cfg)
        key = {"kind": "draft_head", "head_rows": rows}
        return TimedCall(cfg, params, call, new_cache, rows, widths=(1, 2), key=key)
