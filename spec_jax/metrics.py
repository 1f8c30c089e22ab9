"""Acceptance statistics in one schema, accumulated inside the compiled loop.

The names follow the serving engines so results compare: a "round" is one row's draft +
verify step (rows that are already done do not count), acceptance_rate is accepted/drafted,
and mean_accepted_length is 1 + accepted/rounds (the paper's expected tokens per round,
before truncation at max_new_tokens or EOS). Rows may draft fewer than gamma tokens (a
lookup that found nothing, a confidence stop): only proposed positions count as drafted or
scored. A drafter with several sources (spec_jax.drafting.hybrid.HybridDrafter: prompt lookup, then
the model) says which one served each row's round; the counts are also kept per source.
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class SpecMetrics:
    num_rounds: jax.Array  # int32 [], row-rounds
    num_draft_tokens: jax.Array  # int32 []
    num_accepted_tokens: jax.Array  # int32 []
    per_position_accepted: jax.Array  # int32 [G]: rounds whose draft i was accepted
    accepted_histogram: jax.Array  # int32 [G + 1]: rounds that accepted exactly k drafts
    overlap_sum: jax.Array  # float32 []: sum of sum_x min(p, q) over scored positions
    overlap_count: jax.Array  # int32 []
    num_committed_tokens: jax.Array  # int32 []: tokens committed by rounds, after truncation
    target_calls: jax.Array  # int32 [], batched target forward calls (prefill included)
    draft_calls: jax.Array  # int32 [], batched drafter steps (prefill included)
    source_rounds: jax.Array  # int32 [S]: rounds each of the drafter's sources served
    source_draft_tokens: jax.Array  # int32 [S]
    source_accepted_tokens: jax.Array  # int32 [S]
    # overlap_sum and overlap_count of each row: gamma=auto's per-row acceptance (not in to_dict)
    row_overlap_sum: jax.Array  # float32 [B]
    row_overlap_count: jax.Array  # int32 [B]

    @classmethod
    def zeros(cls, gamma: int, num_sources: int = 1, batch: int = 1) -> "SpecMetrics":
        i = jnp.zeros((), jnp.int32)
        per_source = jnp.zeros((num_sources,), jnp.int32)
        return cls(
            i,
            i,
            i,
            jnp.zeros((gamma,), jnp.int32),
            jnp.zeros((gamma + 1,), jnp.int32),
            jnp.zeros((), jnp.float32),
            i,
            i,
            i,
            i,
            per_source,
            per_source,
            per_source,
            jnp.zeros((batch,), jnp.float32),
            jnp.zeros((batch,), jnp.int32),
        )

    def update(
        self,
        active_b,
        num_drafted_b,
        num_accepted_b,
        overlap_bg,
        committed_b,
        draft_steps: int,
        source_b,
        num_scored_b=None,
    ) -> "SpecMetrics":
        """Adds one round. active: rows that drafted; num_drafted: [B] proposed drafts per row (at
        most G); overlap: [B, G] sum_x min(p, q) per position, G at most the gamma these metrics
        were made for (gamma=auto runs rounds of several gammas into metrics sized for the
        largest); source: int32 [B], the drafter's source that served each row.

        Only proposed positions the target scored on the committed prefix (i <= num_accepted)
        enter alpha: after the first rejection the drafts are conditioned on a rejected token.
        A tree round (spec_jax.rounds.tree_round) counts every node as drafted and passes
        num_scored [B], the depths whose overlap (along the accepted path) enters alpha.
        """
        gamma = overlap_bg.shape[1]
        size = self.per_position_accepted.shape[0]
        overlap_bg = jnp.pad(overlap_bg, ((0, 0), (0, size - gamma)))
        act = active_b.astype(jnp.int32)
        acc = num_accepted_b * act
        drafted = num_drafted_b * act
        pos = jnp.arange(size)[None, :]
        if num_scored_b is None:
            num_scored_b = jnp.minimum(num_drafted_b, num_accepted_b + 1)
        scored = (pos < num_scored_b[:, None]) & active_b[:, None]
        by_source = jax.nn.one_hot(source_b, self.source_rounds.shape[0], dtype=jnp.int32)  # [B, S]
        row_overlap_b = jnp.sum(jnp.where(scored, overlap_bg, 0.0), axis=1)
        row_scored_b = jnp.sum(scored, axis=1).astype(jnp.int32)
        return SpecMetrics(
            num_rounds=self.num_rounds + jnp.sum(act),
            num_draft_tokens=self.num_draft_tokens + jnp.sum(drafted),
            num_accepted_tokens=self.num_accepted_tokens + jnp.sum(acc),
            per_position_accepted=self.per_position_accepted
            + jnp.sum((pos < num_accepted_b[:, None]) & active_b[:, None], axis=0).astype(jnp.int32),
            accepted_histogram=self.accepted_histogram
            + jnp.sum(jax.nn.one_hot(num_accepted_b, size + 1, dtype=jnp.int32) * act[:, None], axis=0),
            overlap_sum=self.overlap_sum + jnp.sum(row_overlap_b),
            overlap_count=self.overlap_count + jnp.sum(row_scored_b),
            num_committed_tokens=self.num_committed_tokens + jnp.sum(committed_b),
            target_calls=self.target_calls + 1,
            draft_calls=self.draft_calls + draft_steps,
            source_rounds=self.source_rounds + act @ by_source,
            source_draft_tokens=self.source_draft_tokens + drafted @ by_source,
            source_accepted_tokens=self.source_accepted_tokens + acc @ by_source,
            row_overlap_sum=self.row_overlap_sum + row_overlap_b,
            row_overlap_count=self.row_overlap_count + row_scored_b,
        )

    def to_dict(self, sources: tuple[str, ...] = ()) -> dict:
        """Host-side summary in the metrics schema above (plain Python numbers and lists).
        sources: the names of the drafter's sources (Drafter.sources); with them
        the per-source counts come out as {name: count} dicts (see by_drafter)."""
        rounds = int(self.num_rounds)
        drafted = int(self.num_draft_tokens)
        accepted = int(self.num_accepted_tokens)
        count = int(self.overlap_count)
        out = {
            "num_rounds": rounds,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "mean_accepted_length": 1.0 + accepted / rounds if rounds else float("nan"),
            "per_position_acceptance": (np.asarray(self.per_position_accepted) / max(rounds, 1)).tolist(),
            "accepted_histogram": np.asarray(self.accepted_histogram).tolist(),
            "alpha_hat": float(self.overlap_sum) / count if count else float("nan"),
            # Positions the target scored on the committed prefix (drafts up to the first
            # rejection); accepted / scored estimates alpha directly, for any gamma.
            "num_scored_positions": count,
            "num_committed_tokens": int(self.num_committed_tokens),
            "target_calls": int(self.target_calls),
            "draft_calls": int(self.draft_calls),
        }
        if sources and len(sources) == self.source_rounds.shape[0]:
            for key, values in zip(BY_DRAFTER, self._source_counts(), strict=True):
                out[key] = dict(zip(sources, np.asarray(values).tolist(), strict=True))
            out.update(by_drafter(out))
        return out

    def _source_counts(self):
        return self.source_rounds, self.source_draft_tokens, self.source_accepted_tokens


# Per-source counts ({source name: count}); pool adds them up name by name.
BY_DRAFTER = ("rounds_by_drafter", "draft_tokens_by_drafter", "accepted_tokens_by_drafter")


def by_drafter(stats: dict) -> dict:
    """The per-source rates from the per-source counts: fraction_of_rounds_by_drafter (the
    share of rounds each source served), acceptance_rate_by_drafter (accepted / drafted) and
    mean_accepted_length_by_drafter (1 + accepted / rounds), as {name: value} dicts."""
    rounds, drafted, accepted = (stats[k] for k in BY_DRAFTER)
    total = sum(rounds.values())
    nan = float("nan")
    return {
        "fraction_of_rounds_by_drafter": {k: v / total if total else nan for k, v in rounds.items()},
        "acceptance_rate_by_drafter": {k: accepted[k] / v if v else nan for k, v in drafted.items()},
        "mean_accepted_length_by_drafter": {
            k: 1.0 + accepted[k] / v if v else nan for k, v in rounds.items()
        },
    }


COUNTS = (
    "num_rounds",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_scored_positions",
    "num_committed_tokens",
    "target_calls",
    "draft_calls",
)
TIMINGS = ("compile_seconds", "prefill_seconds", "decode_seconds", "num_new_tokens")
# Per-row stats: one entry per prompt of a run, in prompt order (pool concatenates them).
# nonfinite_logits[b]: the target's logits that row b's next tokens would have come from were
# NaN or infinite, so the row stopped there (spec_jax.decode.Output.nonfinite); its tokens are
# those committed before. A row that stopped so counts no round for the round it stopped in.
NONFINITE = "nonfinite_logits"
PER_ROW = (NONFINITE,)


def nonfinite_rows(stats: dict) -> list[int]:
    """The indices of the rows (prompts) whose target logits became non-finite."""
    return [b for b, flag in enumerate(stats.get(NONFINITE, ())) if flag]


def pool(stats: list[dict]) -> dict:
    """Pools the stats of several runs (batches, repeats, prompts) into one dict, by definition:
    counts and seconds add; acceptance_rate = accepted / drafted; mean_accepted_length = 1 +
    accepted / rounds; alpha_hat is the mean overlap over ALL scored positions (each run's
    alpha_hat weighted by its num_scored_positions, so a run with no rounds adds nothing);
    per_position_acceptance weighted by rounds; histograms add; tokens_per_second = new tokens
    over prefill + decode seconds; the per-drafter counts add name by name and their rates are
    recomputed from them; per-row stats (PER_ROW) are concatenated in the order of `stats`. Keys a run does not have are left out (plain decoding has no
    acceptance), as are per-position lists of different lengths. The one place this is done:
    the CLI, the benchmarks and the experiments all pool with it.
    """
    if not stats:
        raise ValueError("pool needs at least one stats dict")
    out = {}
    for key in COUNTS + TIMINGS:
        if all(key in s for s in stats):
            out[key] = sum(s[key] for s in stats)
    for key in PER_ROW:
        if all(key in s for s in stats):
            out[key] = [value for s in stats for value in s[key]]
    if "num_new_tokens" in out and "prefill_seconds" in out:
        seconds = out["prefill_seconds"] + out["decode_seconds"]
        out["tokens_per_second"] = out["num_new_tokens"] / seconds if seconds > 0 else float("nan")
    if "num_draft_tokens" not in out:
        return out
    drafted, accepted, rounds = out["num_draft_tokens"], out["num_accepted_tokens"], out["num_rounds"]
    scored = out["num_scored_positions"]
    out["acceptance_rate"] = accepted / drafted if drafted else float("nan")
    out["mean_accepted_length"] = 1.0 + accepted / rounds if rounds else float("nan")
    overlap_sum = sum(s["alpha_hat"] * s["num_scored_positions"] for s in stats if s["num_scored_positions"])
    out["alpha_hat"] = overlap_sum / scored if scored else float("nan")
    if all(k in s for s in stats for k in BY_DRAFTER):
        for key in BY_DRAFTER:
            names = list(dict.fromkeys(name for s in stats for name in s[key]))
            out[key] = {name: sum(s[key].get(name, 0) for s in stats) for name in names}
        out.update(by_drafter(out))
    for key in ("per_position_acceptance", "accepted_histogram"):
        lengths = {len(s[key]) for s in stats if key in s}
        if len(lengths) != 1 or not all(key in s for s in stats):
            continue
        if key == "accepted_histogram":
            out[key] = np.sum([s[key] for s in stats], axis=0).astype(int).tolist()
        elif rounds:
            weighted = np.sum([np.multiply(s[key], s["num_rounds"]) for s in stats], axis=0)
            out[key] = (weighted / rounds).tolist()
    return out
