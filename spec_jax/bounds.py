"""How far a round may write past the committed text (speculation_bound: the one gamma / tree
rule, which spec_jax.api, the engine's plan and launch.generate use), and a spec_jax.generate
call's checks against its models (validate: the prompts, the budget, the context, gamma;
check_pairing: the draft's vocabulary against the target's). Errors name the argument and its
allowed range.
"""

from typing import Any

import numpy as np

from models import kernels
from models.settings import is_int
from spec_jax.decode import stop_id_list
from spec_jax.drafting import AUTO_GAMMA_MAX, AUTO_TREE_MAX, Drafter, check_gamma
from spec_jax.request import RequestError

# A tree call scores the root and N nodes, one bit each in the attention's int32 mask.
MAX_TREE_NODES = kernels.MAX_TREE_QUERIES - 1


def speculation_bound(
    gamma, tree, *, auto_gamma_max: int = AUTO_GAMMA_MAX, gamma_name="gamma", tree_name="tree"
) -> tuple[int, Any, str]:
    """The one gamma / tree rule: (the most tokens a round may write past the committed text,
    what an error message shows was asked for, the setting that bounds it). tree: 0 (chains),
    a node count in [1, MAX_TREE_NODES] or "auto" (then gamma is auto too; the largest tree or
    chain auto may run); gamma: an integer >= 1 or "auto" (up to auto_gamma_max: the drafter's
    Drafter.auto_gamma_max, AUTO_GAMMA_MAX where no drafter is known yet).
    RequestError naming gamma_name / tree_name where a value is out of range."""
    if tree != "auto" and (not is_int(tree) or not 0 <= tree <= MAX_TREE_NODES):
        raise RequestError(
            tree_name,
            f"{tree_name} must be 0 (chains), a node count in [1, {MAX_TREE_NODES}] or 'auto', got {tree!r}",
        )
    if tree == "auto":
        bound = max(AUTO_TREE_MAX, auto_gamma_max)
        return bound, f"'auto' (up to {bound})", tree_name
    if tree:  # a tree round writes up to its node count past the text
        return tree, tree, tree_name
    if gamma == "auto":
        return auto_gamma_max, f"'auto' (up to {auto_gamma_max})", gamma_name
    if not is_int(gamma) or gamma < 1:
        raise RequestError(gamma_name, f"{gamma_name} must be an integer >= 1 or 'auto', got {gamma!r}")
    return gamma, gamma, gamma_name


def validate(target, prompts, drafter, gamma, max_new_tokens, eos_id, tree=0):
    """spec_jax.generate's call checked against the target (prompts as token ids; drafter: a
    drafter or None): returns None; raises ValueError naming the argument and its allowed range."""
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    vocab = target.config.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str) or (isinstance(p, list | tuple) and any(isinstance(m, dict) for m in p)):
            what = "a text" if isinstance(p, str) else "a conversation"
            raise ValueError(
                f"prompts[{i}] is {what}; prompts are token ids: target.tokenizer.encode(text), or "
                "target.tokenizer.encode_chat(messages) for a conversation in the model's chat template"
            )
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        arr = np.asarray(p)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must be a flat list of integer token ids")
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(
                f"prompts[{i}] has token ids outside the vocabulary [0, {vocab}): "
                f"min {arr.min()}, max {arr.max()}"
            )
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.config.max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"context of {target.config.max_seq_len} tokens"
        )
    stop_id_list(eos_id, vocab)
    if drafter is None:
        speculation_bound("auto", tree)  # the tree setting is checked without a drafter too
        return
    bound, shown, name = speculation_bound(gamma, tree, auto_gamma_max=drafter.auto_gamma_max)
    check_pairing(vocab, drafter)
    contexts = {"the target's": target.config.max_seq_len, "the draft's": drafter.max_seq_len}
    check_gamma(bound, longest, max_new_tokens, contexts, name=name, shown=shown)


def check_pairing(vocab: int, drafter: Drafter) -> None:
    """The draft/target pairing check on the vocabularies (the tokenizers are checked where a
    draft model becomes a drafter: spec_jax.drafting.build.paired_vocab): ValueError unless the
    drafter proposes over the target's vocabulary of `vocab` tokens."""
    if drafter.vocab_size != vocab:
        raise ValueError(
            f"draft vocabulary size ({drafter.vocab_size}) differs from the target's ({vocab}); "
            "speculative decoding needs one shared vocabulary"
        )
