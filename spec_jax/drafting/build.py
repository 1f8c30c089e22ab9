"""The one place drafters are made: build(kind, target, settings) -> (drafter, params), for the
CLI, the benchmarks, the experiments and spec_jax.generate.

BUILDERS is the registry of drafter kinds (DRAFTERS their names, which the CLI's --drafter
lists). Adding a drafter is one new module in spec_jax/drafting/ (a Drafter subclass) and one
line here; tests/test_drafting.py's toy drafter shows that the rest (the loop, the API,
sharding, gamma=auto) needs nothing more.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from models import corpora
from models.settings import is_int, is_number
from models.tokenizer import check_pair
from spec_jax.drafting.base import Drafter
from spec_jax.drafting.head import HeadDrafter
from spec_jax.drafting.hybrid import HybridDrafter
from spec_jax.drafting.lookup import MAX_NGRAM_LIMIT, PromptLookupDrafter
from spec_jax.drafting.model import ModelDrafter, trim_vocabulary
from spec_jax.drafting.ngram import fit_bigram, fit_unigram
from spec_jax.drafting.suffix import SuffixDrafter
from spec_jax.drafting.suffix_table import SuffixTables, fit_suffix_tables
from spec_jax.drafting.tables import frequent_tokens, suffix_tables
from spec_jax.drafting.trained_head import load_drafter


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the drafter kinds are built from (each kind reads the fields it needs).

    draft: model / hybrid: the draft model (a models.Model, or a (ModelDrafter, params) pair,
      e.g. a vocabulary-trimmed one); head: a (HeadDrafter, HeadParams) pair, or None to load
      the trained head from head_dir.
    draft_vocab: model / hybrid: VocabTrim, the draft proposes only this many tokens (the most
      frequent of the training corpora, spec_jax.drafting.tables.frequent_tokens, plus stop_ids); 0: all.
    stop_ids: the target's stop tokens (kept by VocabTrim).
    max_ngram: prompt_lookup / suffix / hybrid: the longest suffix matched.
    threshold: model / head / hybrid / suffix: a row stops drafting below this confidence.
    tree_depth, tree_width: model / head: the dynamic tree in tree rounds (generate's tree=N):
      depth D, K children per expanded node and K expanded per depth (width 0: the chain);
      spec_jax.drafting.dynamic_tree.DynamicTree.
    sequences: unigram / bigram / suffix: token-id lists to fit the tables on.
    tables: suffix: a spec_jax.drafting.suffix_table.SuffixTables.
    corpus: unigram / bigram / suffix with neither sequences nor tables: fit on the training
      split of the corpora (models.corpora; tables cached by spec_jax.drafting.tables), as the CLI does.
    head_dir, head_dtype, acceptance: head: the trained head's workdir (None: the default for
      the target), its precision (None: the target's), and whether its acceptance head decides
      each row's draft length (spec_jax.drafting.trained_head.load_drafter).
    """

    draft: Any = None
    draft_vocab: int = 0
    stop_ids: Sequence[int] = ()
    max_ngram: int = 3
    threshold: float = 0.0
    tree_depth: int = ModelDrafter.tree_depth
    tree_width: int = ModelDrafter.tree_width
    sequences: Any = None
    tables: Any = None
    corpus: bool = False
    head_dir: str | None = None
    head_dtype: str | None = None
    acceptance: bool = False

    def validate(self) -> None:
        """ValueError naming the setting and its allowed values."""
        if not is_int(self.max_ngram) or not 1 <= self.max_ngram <= MAX_NGRAM_LIMIT:
            raise ValueError(
                f"max_ngram must be an integer in [1, {MAX_NGRAM_LIMIT}], got {self.max_ngram!r}"
            )
        t = self.threshold
        if not is_number(t) or not 0.0 <= t < 1.0:
            raise ValueError(f"threshold must be a number in [0, 1) (0: drafts never stop early), got {t!r}")
        if not is_int(self.draft_vocab) or self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be 0 or a positive token count, got {self.draft_vocab!r}")


def as_drafter(draft, target=None) -> tuple[Drafter, Any]:
    """(drafter, params): a Model becomes (ModelDrafter(config), its params), paired with
    target where one is given (`paired_vocab`); a (drafter, params) pair (e.g. from build or
    spec_jax.drafting.ngram.fit_bigram) is used as it is."""
    if hasattr(draft, "config") and hasattr(draft, "params"):
        vocab = 0 if target is None else paired_vocab(target, draft)
        draft = ModelDrafter(draft.config, vocab=vocab), draft.params
    if not (isinstance(draft, tuple) and len(draft) == 2):
        raise ValueError(
            "draft must be None, a models.Model or a (drafter, params) pair "
            f"(a spec_jax.drafting.Drafter and its arrays); got {type(draft).__name__}"
        )
    if not isinstance(draft[0], Drafter):
        raise ValueError(
            f"draft's drafter must be a spec_jax.drafting.Drafter; got {type(draft[0]).__name__}"
        )
    return draft


def paired_vocab(target, draft) -> int:
    """ModelDrafter.vocab for a draft model of target: the target's vocabulary size where the
    draft's is smaller (a prefix), else 0. Where both models have a tokenizer, ValueError
    (models.tokenizer.check_pair) unless the draft's vocabulary is the target's or a prefix of
    it; a larger draft without tokenizers is refused by the size check (spec_jax.request.validate)."""
    target_vocab, draft_vocab = target.config.vocab_size, draft.config.vocab_size
    if getattr(target, "tokenizer", None) is not None and getattr(draft, "tokenizer", None) is not None:
        check_pair(target.tokenizer, draft.tokenizer, target_vocab, draft_vocab)
    return target_vocab if draft_vocab < target_vocab else 0


def _model(target, settings: Settings, kind: str = "model") -> tuple[ModelDrafter, Any]:
    """The draft model (paired with target), vocabulary-trimmed to settings.draft_vocab tokens
    when that is set."""
    if settings.draft is None:
        raise ValueError(f"drafter {kind!r} needs a draft model")
    draft = settings.draft
    if settings.draft_vocab and hasattr(draft, "config"):
        vocab = paired_vocab(target, draft)
        drafter, params = trim_vocabulary(draft, _frequent_tokens(draft, settings))
        draft = dataclasses.replace(drafter, vocab=vocab), params
    drafter, params = as_drafter(draft, target)
    if not isinstance(drafter, ModelDrafter):
        raise ValueError(f"drafter {kind!r} needs a draft model, got a {type(drafter).__name__}")
    tree = dict(tree_depth=settings.tree_depth, tree_width=settings.tree_width)
    return dataclasses.replace(drafter, threshold=float(settings.threshold), **tree), params


def _frequent_tokens(draft, settings: Settings):
    vocab, count, stops = draft.config.vocab_size, settings.draft_vocab, list(settings.stop_ids)
    if not len(stops) < count <= vocab:
        raise ValueError(
            f"draft_vocab must be 0 or in [{len(stops) + 1}, {vocab}] (more than the stop tokens), got {count}"
        )
    return frequent_tokens(draft.config.name, draft.tokenizer, vocab, count, always=stops)


def _sequences(target, settings: Settings, kind: str):
    if settings.sequences is None and settings.corpus:
        return corpora.training_sequences(target.tokenizer)
    if settings.sequences is None:
        raise ValueError(f"drafter {kind!r} needs sequences (token-id lists) to fit its table on")
    return settings.sequences


def _suffix(target, settings: Settings):
    vocab, tables = target.config.vocab_size, settings.tables
    if tables is None and settings.sequences is not None:
        tables = fit_suffix_tables(settings.sequences, vocab, settings.max_ngram)
    elif tables is None and settings.corpus:
        tables = suffix_tables(target.config.name, target.tokenizer, vocab, settings.max_ngram)
    if tables is not None and not isinstance(tables, SuffixTables):
        raise ValueError(
            f"tables must be a spec_jax.drafting.suffix_table.SuffixTables, got {type(tables).__name__}"
        )
    drafter = SuffixDrafter(vocab, settings.max_ngram, float(settings.threshold))
    return drafter, (() if tables is None else tables)


def _head(target, settings: Settings):
    tree = dict(tree_depth=settings.tree_depth, tree_width=settings.tree_width)
    if settings.draft is None:
        dtype = settings.head_dtype or target.config.dtype
        drafter, params = load_drafter(
            target, settings.head_dir, dtype, float(settings.threshold), acceptance=settings.acceptance
        )
        return dataclasses.replace(drafter, **tree), params
    drafter, params = as_drafter(settings.draft)
    if not isinstance(drafter, HeadDrafter):
        raise ValueError(
            "drafter 'head' needs a (HeadDrafter, HeadParams) pair as draft, or none to load the "
            "trained head (spec_jax.drafting.trained_head.load_drafter)"
        )
    return dataclasses.replace(drafter, threshold=float(settings.threshold), **tree), params


def _hybrid(target, settings: Settings):
    prompt_lookup = PromptLookupDrafter(target.config.vocab_size, settings.max_ngram)
    model, params = _model(target, settings, "hybrid")
    return HybridDrafter(prompt_lookup, model), params


# The registry: kind -> builder(target, settings) -> (drafter, params). One line per drafter.
BUILDERS: dict[str, Callable[[Any, Settings], tuple[Drafter, Any]]] = {
    "model": _model,
    "head": _head,
    "prompt_lookup": lambda t, s: (PromptLookupDrafter(t.config.vocab_size, s.max_ngram), ()),
    "suffix": _suffix,
    "hybrid": _hybrid,
    "unigram": lambda t, s: fit_unigram(_sequences(t, s, "unigram"), t.config.vocab_size),
    "bigram": lambda t, s: fit_bigram(_sequences(t, s, "bigram"), t.config.vocab_size),
}
DRAFTERS = tuple(BUILDERS)


def build(kind: str, target, settings: Settings = Settings()) -> tuple[Drafter, Any]:
    """The (drafter, params) pair of a drafter kind for `target` (a models.Model), for
    spec_jax.generate's `draft`:
      model          the draft model settings.draft (VocabTrim: settings.draft_vocab), stopping
                     each row below settings.threshold (0: never); in tree rounds its dynamic
                     tree of settings.tree_depth and tree_width
      head           a draft head on the target's features: settings.draft, or the trained one
                     (load_drafter), stopping each row below the threshold
      prompt_lookup  spec_jax.drafting.lookup.PromptLookupDrafter(max_ngram): no model
      suffix         spec_jax.drafting.suffix.SuffixDrafter(max_ngram, threshold): the row's own
                     text, and settings.tables (or tables fitted on settings.sequences or the
                     corpora); a row stops where the top successor frequency is below threshold
      hybrid         prompt lookup, and the draft model where it finds nothing
      unigram, bigram  n-gram tables fitted on settings.sequences (or the corpora)
    ValueError naming the setting and its allowed values otherwise.
    """
    if kind not in BUILDERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {kind!r}")
    settings.validate()
    return BUILDERS[kind](target, settings)
