"""The drafter interface: `Drafter`, what every round of the loop (spec_jax.speculative) needs,
composed with the optional capabilities, each a small class with its default behaviour:
`TreeDrafting` (tree rounds), `TargetFeatures` (a drafter that reads the target's features),
`Resumption` (catching up after plain chunks of gamma=auto), `MeshPlacement` (a mesh) and
`CostMeasurement` (what gamma=auto times). A drafter overrides only what it has; the defaults
make every drafter run everywhere.

A drafter is a frozen (hashable) dataclass of static settings subclassing `Drafter`, so it can
be a static argument of jax.jit; its arrays (model parameters, n-gram tables) and its state (a
KV cache, a token buffer) are pytrees passed through the loop. A new drafter subclasses
Drafter, sets `vocab_size` (and what differs from the defaults below) and writes `propose`;
tests/test_drafting.py defines one in the test file alone and runs it through generate,
gamma=auto's cost measurement and an 8-device mesh.

The loop calls `init` once after the prompt and `propose` once per round with the last two
committed tokens. Feeding both, at positions n-2 and n-1, keeps a drafter's cache equal to the
committed prefix in every case: after a fully accepted round the drafter has not yet seen its
own last draft (it is token n-2 now), and after a rejection the rejected entries past n-2 are
overwritten before they can be read.

A drafter may propose fewer than gamma tokens in a row: the positions it does not propose get
q = 0 (spec_jax.verify), and then `variable_length` is True, so that the loop checks for a
round where no row proposed anything (the target then scores one position, not gamma + 1).
`sources` names what served a row's round (spec_jax.drafting.hybrid.HybridDrafter has two and
says which served each row with `served`); the metrics count rounds, drafts and acceptances
per source.
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from spec_jax import sharding
from spec_jax import tree as tree_lib
from spec_jax.sampling import RowSampling

# Drafters without a model (n-gram tables, prompt lookup, suffix) can read any context length.
UNBOUNDED_CONTEXT = 2**31 - 1
# The most a round drafts where gamma=auto or tree="auto" chooses (spec_jax.autogamma's arms:
# chains of 1..AUTO_GAMMA_MAX drafts, trees of AUTO_TREE_SIZES node slots): what check_gamma is
# given for "auto" (the request's speculation bound).
AUTO_GAMMA_MAX = 8
# A drafter that copies text (prompt lookup, suffix, the hybrid's lookup) proposes long runs where
# a row copies (spec_jax.drafting.lookup.draft_counts): gamma=auto's chains go up to this for it
# (Drafter.auto_gamma_max).
AUTO_COPY_GAMMA_MAX = 16
AUTO_TREE_SIZES = (4, 8, 16)
AUTO_TREE_MAX = max(AUTO_GAMMA_MAX, *AUTO_TREE_SIZES)


class Proposal(NamedTuple):
    """What `propose` returns: a chain of drafts per row (a tree of candidates adds fields)."""

    tokens: jax.Array  # int32 [B, G]
    q: jax.Array  # float32 [B, G, V]: the warped distribution each token was sampled from,
    # all zero from a row's first position not proposed
    state: Any  # the drafter's new state


class TreeProposal(NamedTuple):
    """What `propose_tree` returns: a token tree per row (spec_jax.tree.Tree) and the new state."""

    tree: Any  # spec_jax.tree.Tree of N node slots
    state: Any


class TreeDrafting:
    """Optional: proposing a token tree. The loop's tree rounds (spec_jax.rounds.tree_round,
    for generate(tree=N) and tree="auto") call propose_tree, verify every node in one target
    call with a tree mask, then call `accepted` with the path each row took; the metrics count
    tree_calls. Default: the chain of `propose` as a tree, so every drafter runs tree rounds; a
    drafter that keeps its own copy of the text or a cache of its tree's nodes overrides
    `accepted` to bring it up to date."""

    def propose_tree(
        self, params: Any, state: Any, context_b2, length_b, nodes: int, sampling: RowSampling, keys_b
    ) -> TreeProposal:
        """A token tree of `nodes` slots per row (spec_jax.tree: a slot's parent comes before it;
        all-zero q marks an empty slot). Default: the chain of `propose` with gamma = nodes."""
        proposal = Proposal(*self.propose(params, state, context_b2, length_b, nodes, sampling, keys_b))
        return TreeProposal(tree_lib.chain(proposal.tokens, proposal.q), proposal.state)

    def tree_calls(self, nodes: int) -> int:
        """The batched drafting calls propose_tree makes for a tree of `nodes` slots (counted in
        the metrics' draft_calls). Default: the chain's, one per node."""
        return nodes

    def accepted(self, params: Any, state: Any, tree: Any, path_bn, count_b, length_b) -> Any:
        """The state after a tree round: row b accepted the nodes path_bn[b, :count_b[b]] (slots,
        root child first) of `tree`, whose tokens are now committed at positions length_b[b] ..
        length_b[b] + count_b[b] - 1 (length_b: the committed length before the round). Default:
        the state as it is, right for a chain (propose wrote its drafts where they are committed)."""
        return state


class TargetFeatures:
    """Optional: reading the target's features (a draft head, spec_jax.drafting.head). Where
    reads_features is True the loop's prefill hands `init` the target's features of the prompt,
    and after every round the loop calls `observe` with the features of the positions the
    target scored (the API and the engine keep the prompt's width for such a drafter:
    spec_jax.decode.layout). Default: reads no features; observe keeps the state."""

    reads_features: ClassVar[bool] = False  # init takes the prompt's features; observe is called

    def observe(self, params: Any, state: Any, features_bcd, tokens_bc, start_b, count_b) -> Any:
        """The state after a round: the target's features of the C positions it scored from
        start_b and the tokens committed after them, of which count_b [B] (in [1, C]) are real.
        Default: the state as it is."""
        return state


class Resumption:
    """Optional: catching up on text committed without the drafter. gamma=auto runs plain chunks
    (gamma 0, no drafter) between drafting chunks; before drafting again, spec_jax.autogamma's
    CatchUp calls `resume` of a resumable drafter. Default: not resumable, so gamma=auto makes
    plain decoding final for the call once it chose it (a draft head, which would need the
    target's features of the text it missed)."""

    resumable: ClassVar[bool] = False  # `resume` can catch up on text committed without it

    def resume(self, params: Any, state: Any, text_bs, synced_b, length_b, width: int) -> Any:
        """A resumable drafter's state after the loop committed text without it.

        text_bs: int32 [B, S] every row's committed tokens at their positions (below length_b,
        padding past it); synced_b: the state followed the text below this position; width: a
        static size for catching up (the longest gap length - 2 - synced, rounded up to a power
        of two and capped). The result must be a state `propose` can continue from at length_b.
        Default: NotImplementedError (resumable is False).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot resume (resumable is False)")


class MeshPlacement:
    """Optional: placement on a mesh (spec_jax.sharding). spec_jax.api and spec_jax.engine place
    the draft parameters by param_shardings and run the drafter as for_mesh returns it.
    Default: the drafter as it is, every parameter array replicated (right for tables)."""

    def for_mesh(self, mesh) -> "Drafter":
        """The drafter as it runs on mesh (a model's config adapted by sharding.for_mesh).
        Default: itself."""
        return self

    def param_shardings(self, params: Any, mesh):
        """A pytree of shardings matching params. Default: every array replicated."""
        return jax.tree.map(lambda _: sharding.replicated(mesh), params)


class TimedCall(NamedTuple):
    """A drafter's model call as data, for gamma=auto to time and price (CostMeasurement.timed_call):
    spec_jax.autogamma compiles `call` over W tokens per row at the next positions of a cache about
    half full, times it, keys the times by `config` and `key`, and prices the call by the bytes of
    `params` before anything is timed. The drafter says what runs; it times nothing itself."""

    config: Any  # models.config.ModelConfig of the model called (the cost's key holds it)
    params: Any  # the arrays one call reads (what `call` takes; their bytes price it)
    call: Callable  # call(params, cache, positions [B, W]) -> (logits [B, W or 1, R], cache)
    new_cache: Callable  # new_cache(batch, slots) -> the empty cache `call` runs on
    out_width: int  # R: the rows of the output head the logits are over
    widths: tuple[int, ...] | None = None  # the widths it has a call of (None: any)
    key: dict = {}  # what else the cost depends on (a trimmed head's rows), in the cost's key


class CostMeasurement:
    """Optional: what gamma=auto times and prices (spec_jax.autogamma measures `timed_call`, keys
    the cached costs by it or by cost_key, and prices the drafter's calls by call_bytes before any
    are measured), and the longest chain it runs (auto_gamma_max). Default: no call (a drafter
    without a model drafts for free), keyed by the class name, chains up to AUTO_GAMMA_MAX."""

    # The longest chain gamma=auto runs with this drafter (the speculation bound of "auto",
    # spec_jax.bounds): AUTO_COPY_GAMMA_MAX for a drafter that copies text.
    auto_gamma_max: ClassVar[int] = AUTO_GAMMA_MAX

    def timed_call(self, params: Any) -> TimedCall | None:
        """The drafter's model call as data (TimedCall), or None: it calls no model.
        Default: None."""
        return None

    def cost_key(self, params: Any):
        """What the costs of a drafter without a timed call depend on (part of their cache key;
        one with a timed call is keyed by its model's config and TimedCall.key). Default: the
        class name."""
        return type(self).__name__

    def without_model(self, params: Any) -> "tuple[Drafter, Any] | None":
        """(drafter, params) that drafts where this one's model calls would never pay (gamma=auto's
        "never": spec_jax.plan.bucket_controllers), or None: plain decoding. Default: None."""
        return None

    def call_bytes(self, params: Any) -> int:
        """Bytes of weights one of its calls reads: what gamma=auto's prior prices its calls by
        (over the target's) before any are measured. Default: the bytes of timed_call's params
        (0 without a call)."""
        timed = self.timed_call(params)
        return 0 if timed is None else sum(int(leaf.nbytes) for leaf in jax.tree.leaves(timed.params))


class Drafter(TreeDrafting, TargetFeatures, Resumption, MeshPlacement, CostMeasurement, abc.ABC):
    """The base of every drafter: what every round of the loop needs (the class attributes are
    the defaults of its settings), and the optional capabilities it composes, each with its
    default (TreeDrafting, TargetFeatures, Resumption, MeshPlacement, CostMeasurement)."""

    vocab_size: int  # the drafted vocabulary: the target's
    max_seq_len: int = UNBOUNDED_CONTEXT  # the longest context the drafter can read
    prefill_calls: int = 0  # batched calls `init` makes (counted in the metrics' draft_calls)
    variable_length: bool = False  # rows may propose fewer than gamma drafts (q = 0 past them)
    # A learned stop (an acceptance head) decides each round's length: 0 = none. Then gamma is
    # its cap (gamma="auto" means the largest), and every verification width is compiled.
    stop_rejection: float = 0.0
    # What verify_widths="auto" gives this drafter's rounds (spec_jax.plan.resolve_verify_widths):
    # "ends", or "doubling" for one whose rows propose power-of-two counts (lookup.draft_counts).
    auto_widths: ClassVar[str] = "ends"

    @property
    def sources(self) -> tuple[str, ...]:
        """The names of what can serve the drafter's rounds (one for most drafters)."""
        return (type(self).__name__,)

    def init(self, params: Any, tokens_bp, prompt_lens_b, cache_len: int, features_bpd=None) -> Any:
        """The drafter's state after reading the padded prompts [B, P]; features_bpd: the
        target's features of the prompt [B, P, D] for a drafter that reads_features, else None."""
        return ()

    @abc.abstractmethod
    def propose(
        self, params: Any, state: Any, context_b2, length_b, gamma: int, sampling: RowSampling, keys_b
    ) -> Proposal:
        """Drafts up to gamma tokens per row.

        Args:
          params, state: the drafter's parameters and its state (init's, then each round's).
          context_b2: int32 [B, 2], the last two committed tokens of each row, at positions
            length-2 and length-1 (the last one in no cache yet).
          length_b: int32 [B], each row's committed tokens, prompt included.
          gamma: the drafts to propose (static).
          sampling: each row's warp (RowSampling [B]): drafts are drawn from the warped q.
          keys_b: [B] PRNG keys; row b's drafts may depend on keys_b[b] only.

        Returns:
          A Proposal (or the (tokens, q, state) tuple it unpacks as): tokens int32 [B, gamma],
          q float32 [B, gamma, V] (all zeros past a row's last proposed draft), the new state.
        """

    def served(self, state: Any, batch: int):
        """int32 [B]: the index in `sources` of what served each row's last round."""
        return jnp.zeros((batch,), jnp.int32)


def check_gamma(
    gamma: int,
    longest_prompt: int,
    max_new_tokens: int,
    contexts: dict[str, int],
    *,
    name="gamma",
    shown=None,
) -> None:
    """The one upper bound on gamma, for every drafter: ValueError naming `name` and the allowed
    range unless 1 <= gamma <= the largest gamma that fits.

    A round writes up to gamma drafts past the committed text, into the target's KV cache (and
    a draft model's), at positions up to prompt + max_new_tokens + gamma; so that must fit
    every context in `contexts` ({"the target's": its max_seq_len, "the draft's": the
    drafter's max_seq_len}). A drafter without a model (prompt lookup, suffix, n-gram tables)
    has no context of its own (UNBOUNDED_CONTEXT): the target's bounds its gamma. shown: what
    the message says was asked for (default gamma itself)."""
    owner, context = min(contexts.items(), key=lambda item: item[1])
    limit = context - longest_prompt - max_new_tokens
    if 1 <= gamma <= limit:
        return
    need = (
        f"the longest prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}) + {name} "
        f"must fit {owner} context of {context} tokens"
    )
    shown = gamma if shown is None else shown
    if limit < 1:
        raise ValueError(f"no {name} fits: {need}, which leaves no room for drafts; got {shown}")
    raise ValueError(f"{name} must be in [1, {limit}] here ({need}), got {shown}")
