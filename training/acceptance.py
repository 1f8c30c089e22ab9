"""An acceptance head that decides the draft length (SpecDec++: Huang et al. 2024, "SpecDec++:
Boosting Speculative Decoding via Adaptive Candidate Lengths", arXiv 2405.19715).

A small classifier reads, at each draft position, what the drafter knows there (the draft
head's hidden state that produced the draft, the draft distribution's top probability and
entropy, the position) and predicts the probability r_i that the draft is rejected, given
that every draft before it was accepted. The drafter stops before the first position where
the probability that some draft so far is rejected, 1 - prod_k<=i (1 - r_k), exceeds a
threshold h (spec_jax.drafting.head.HeadDrafter.stop_rejection). Draft-side information only,
so the output stays exact.

Training data are logged rounds of the real pair (`log_rounds`): the loop runs round by round
with the head drafting gamma_max tokens, and every draft position up to the first rejection
is one example (label 1: rejected). The classifier trains with optax (AdamW, class-weighted
binary cross-entropy); `choose_threshold` then picks h on held-out logged rounds: with the
measured call costs (spec_jax.autogamma.costs.Costs) it simulates each round stopped where h says
(committed tokens min(accepted, k) + 1, cost of k drafts and a verify call over k + 1
positions) and takes the h with the most tokens per unit of time, beside every fixed gamma.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from spec_jax import speculative
from spec_jax.decode import PrefillInputs, layout, pad_prompts, stop_id_list
from spec_jax.drafting.acceptance_head import (  # noqa: F401 - the classifier, trained here
    HIDDEN,
    POSITIONS,
    AcceptanceParams,
    init,
    logit,
    reject_probability,
    signals,
)
from spec_jax.drafting.head import HeadDrafter
from spec_jax.sampling import row_keys


@dataclasses.dataclass
class Log:
    """Logged rounds. Per example (a draft position reached: every earlier draft accepted):
    x [N, F] its signals, label [N] 1 where rejected, round [N] its round's index. Per round:
    accepted [R] drafts accepted, prompt [R] which prompt it decoded (for splits)."""

    x: np.ndarray
    label: np.ndarray
    round: np.ndarray
    accepted: np.ndarray
    prompt: np.ndarray
    gamma: int

    def split(self, prompts_held_out) -> tuple["Log", "Log"]:
        """(rest, held out) by prompt."""
        held = np.isin(self.prompt, list(prompts_held_out))
        out = []
        for keep_rounds in (~held, held):
            ids = np.flatnonzero(keep_rounds)
            remap = -np.ones(len(self.accepted), np.int64)
            remap[ids] = np.arange(len(ids))
            ex = keep_rounds[self.round]
            out.append(
                Log(
                    self.x[ex],
                    self.label[ex],
                    remap[self.round[ex]],
                    self.accepted[ids],
                    self.prompt[ids],
                    self.gamma,
                )
            )
        return out[0], out[1]


def log_rounds(
    target,
    drafter,
    params,
    prompts,
    *,
    gamma: int,
    max_new_tokens: int,
    batch_size: int,
    eos_id=None,
    progress=True,
) -> Log:
    """Runs the loop round by round (greedy) with `drafter` (a HeadDrafter without stop rules)
    drafting gamma tokens, and logs every draft position reached. A round whose row stopped
    (stop token, max_new_tokens) is not logged: its acceptance was cut."""
    drafter = dataclasses.replace(drafter, threshold=0.0, stop_rejection=0.0)
    recorder = RecordingDrafter(drafter.config, drafter.trimmed, gamma=gamma)
    xs, labels, round_ids, accepted_all, prompt_ids = [], [], [], [], []
    stop = jnp.asarray(stop_id_list(eos_id, target.config.vocab_size) or [-1], jnp.int32)
    bar = tqdm(total=len(prompts) * max_new_tokens, unit="tok", desc="log rounds", disable=not progress)
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        width, cache_len = layout(target.config, batch, max_new_tokens, gamma)
        static = speculative.SpecStatic(target.config, recorder, gamma, max_new_tokens, cache_len)
        tokens, lens = pad_prompts(batch, width)
        keys = row_keys(jax.random.key(0), np.arange(start, start + len(batch)))
        inputs = PrefillInputs(jnp.asarray(tokens), jnp.asarray(lens), stop, keys)
        state, step = speculative.stepper(static, target.params, params, inputs)
        while not bool(jnp.all(state.out.done)):
            before = np.asarray(state.length)
            state = step(state)
            rec = jax.device_get(state.draft_state)
            after, done = np.asarray(state.length), np.asarray(state.out.done)
            x = np.asarray(
                jax.vmap(signals, in_axes=(1, 1, 1, 0), out_axes=1)(
                    rec.hidden, rec.confidence, rec.entropy, jnp.arange(gamma)
                )
            )  # [B, G, F]
            for b in range(len(batch)):
                if after[b] == before[b] or done[b]:
                    continue
                a = int(after[b] - before[b] - 1)
                reached = min(a + 1, gamma)
                xs.append(x[b, :reached])
                labels.append((np.arange(reached) == a).astype(np.int8))
                round_ids.append(np.full(reached, len(accepted_all)))
                accepted_all.append(a)
                prompt_ids.append(start + b)
            bar.update(int(np.sum(after - before)))
    bar.close()
    return Log(
        x=np.concatenate(xs).astype(np.float32),
        label=np.concatenate(labels),
        round=np.concatenate(round_ids),
        accepted=np.asarray(accepted_all),
        prompt=np.asarray(prompt_ids),
        gamma=gamma,
    )


@flax.struct.dataclass
class RecordingState:
    head: object  # the HeadDrafter's HeadState
    hidden: jax.Array  # [B, G, D]: the last round's signals per draft position
    confidence: jax.Array  # [B, G]
    entropy: jax.Array  # [B, G]


@dataclasses.dataclass(frozen=True)
class RecordingDrafter(HeadDrafter):
    """A HeadDrafter that keeps each round's per-position signals in its state (logging)."""

    gamma: int = 1

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd):
        inner = super().init(params, tokens_bp, prompt_lens_b, cache_len, features_bpd)
        batch, width = tokens_bp.shape[0], self.config.d_model
        return RecordingState(
            head=inner,
            hidden=jnp.zeros((batch, self.gamma, width), self.config.jnp_dtype),
            confidence=jnp.zeros((batch, self.gamma), jnp.float32),
            entropy=jnp.zeros((batch, self.gamma), jnp.float32),
        )

    def observe(self, params, state, features_bcd, tokens_bc, start_b, count_b):
        return state.replace(
            head=super().observe(params, state.head, features_bcd, tokens_bc, start_b, count_b)
        )

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        tokens, q, sig, cache = self.draft_chain(params, state.head, length_b, gamma, sampling, keys_b)
        head = state.head.replace(cache=cache)
        return tokens, q, RecordingState(head, sig["hidden"], sig["confidence"], sig["entropy"])


@dataclasses.dataclass
class Trained:
    params: AcceptanceParams
    history: list  # per epoch: train loss, held-out loss and accuracy


def train(
    log: Log,
    held_out: Log,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    reject_weight: float,
    seed: int,
    progress=True,
) -> Trained:
    """The classifier trained on `log` (AdamW, cosine decay, binary cross-entropy with the rejected
    class weighted by reject_weight), evaluated on held_out every epoch-sized stretch."""
    params = init(log.x, seed)
    schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.05)
    tx = optax.adamw(schedule, weight_decay=1e-4)
    opt_state = tx.init(params)

    def loss(p, x, y):
        z = logit(p, x)
        w = jnp.where(y > 0, reject_weight, 1.0)
        return jnp.sum(w * optax.sigmoid_binary_cross_entropy(z, y)) / jnp.sum(w)

    @jax.jit
    def step(p, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    x_all, y_all = jnp.asarray(log.x), jnp.asarray(log.label, jnp.float32)
    xv, yv = jnp.asarray(held_out.x), jnp.asarray(held_out.label, jnp.float32)
    history = []
    per_epoch = max(len(log.label) // batch_size, 1)
    for s in tqdm(range(steps), desc="train acceptance head", unit="step", disable=not progress):
        epoch, i = divmod(s, per_epoch)
        perm = np.random.default_rng([seed, epoch]).permutation(len(log.label))
        idx = np.resize(perm, per_epoch * batch_size)[i * batch_size : (i + 1) * batch_size]
        params, opt_state, value = step(params, opt_state, x_all[idx], y_all[idx])
        if (s + 1) % per_epoch == 0 or s + 1 == steps:
            prob = reject_probability(params, xv)
            history.append(
                {
                    "step": s + 1,
                    "train_loss": float(value),
                    "held_out_loss": float(loss(params, xv, yv)),
                    "held_out_accuracy": float(jnp.mean((prob > 0.5) == (yv > 0))),
                }
            )
    return Trained(params=params, history=history)


def stop_positions(reject_rk: np.ndarray, threshold: float) -> np.ndarray:
    """[R] drafts each round proposes under stop_rejection = threshold, from the predicted
    rejection probabilities of its positions [R, G]."""
    survive = np.cumprod(1.0 - reject_rk, axis=1)
    keep = np.cumprod((1.0 - survive) <= threshold, axis=1)
    return keep.sum(axis=1)


def simulate(accepted_r: np.ndarray, proposed_r: np.ndarray, cost_of) -> float:
    """Tokens per unit of time of rounds that propose proposed[r] drafts, of which the first
    accepted[r] (as logged with more drafts) would be accepted: committed min(a, k) + 1 each."""
    committed = np.minimum(accepted_r, proposed_r) + 1
    return float(committed.sum() / sum(cost_of(int(k)) for k in proposed_r))


def round_cost_fn(costs):
    """cost_of(k) in target steps of a head round that proposes k drafts: the observe call and
    first draft (draft2), k - 1 drafting steps, and a verify call over k + 1 positions (k = 0:
    one decode step after the observe call)."""

    def cost_of(k: int) -> float:
        if k == 0:
            return costs.draft2 + 1.0
        return costs.draft2 + (k - 1) * costs.draft1 + costs.verify[k]

    return cost_of


def predicted_rejects(params: AcceptanceParams, log: Log) -> np.ndarray:
    """[R, G] predicted rejection probabilities per round and position (positions not reached
    repeat the last reached one's)."""
    prob = np.asarray(reject_probability(params, jnp.asarray(log.x)))
    out = np.zeros((len(log.accepted), log.gamma))
    starts = np.r_[0, np.flatnonzero(np.diff(log.round)) + 1]
    for s, e in zip(starts, np.r_[starts[1:], len(log.round)], strict=True):
        r = log.round[s]
        out[r, : e - s] = prob[s:e]
        out[r, e - s :] = prob[e - 1]
    return out


def choose_threshold(
    params: AcceptanceParams, held_out: Log, costs, thresholds=None
) -> tuple[float, list[dict]]:
    """(h, curve): the stop_rejection threshold with the most simulated tokens per unit time on
    held-out logged rounds, and the curve ({threshold, mean_proposed, tokens_per_step}), beside
    every fixed gamma ({gamma, tokens_per_step})."""
    thresholds = np.round(np.linspace(0.05, 0.95, 19), 3) if thresholds is None else thresholds
    reject = predicted_rejects(params, held_out)
    cost_of = round_cost_fn(costs)
    curve = []
    for h in thresholds:
        k = stop_positions(reject, float(h))
        curve.append(
            {
                "threshold": float(h),
                "mean_proposed": float(k.mean()),
                "tokens_per_step": simulate(held_out.accepted, k, cost_of),
            }
        )
    for g in range(1, held_out.gamma + 1):
        k = np.full(len(held_out.accepted), g)
        curve.append({"gamma": g, "tokens_per_step": simulate(held_out.accepted, k, cost_of)})
    best = max((c for c in curve if "threshold" in c), key=lambda c: c["tokens_per_step"])
    return best["threshold"], curve
