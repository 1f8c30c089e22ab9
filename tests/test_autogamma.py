"""gamma=auto: the choice from measured round times and each row's running acceptance, and
exactness across gamma changes, fallbacks to plain decoding and renewed drafting.

No test here reads a clock: where time matters, chunks carry injected seconds (Scripted, or
Chunks built by hand), so the decisions follow from the costs and the acceptance alone.
"""

import dataclasses
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import apply, perturbed

import models
import spec_jax
from spec_jax.autogamma import controller as autogamma
from spec_jax.autogamma import cost_cache as step_costs
from spec_jax.autogamma import tries
from spec_jax.drafting import Drafter, NoDrafter, as_drafter
from spec_jax.drafting.model import ModelDrafter
from spec_jax.speculative import committed_text

PROMPTS = [[5, 9, 2], [1], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]
MAX_NEW = 40
END = autogamma.END


def costs(draft, verify_slope=0.1, gamma_max=8, resume=0.0):
    return step_costs.Costs(
        step_seconds=0.01,
        draft1=draft,
        draft2=draft,
        verify=(1.0,) + tuple(1.0 + verify_slope * g for g in range(1, gamma_max + 1)),
        resume=resume,
    )


def chunk(gamma, rounds, seconds, accepted, scored=None, remaining=100, batch=1):
    """A Chunk of one or more rows; accepted: per row, accepted positions of `scored`."""
    accepted = np.broadcast_to(np.asarray(accepted, float), (batch,))
    scored = np.broadcast_to(np.asarray(rounds * max(gamma, 1) if scored is None else scored), (batch,))
    return autogamma.Chunk(
        gamma=gamma,
        rounds=rounds,
        seconds=seconds,
        active_b=np.ones(batch, bool),
        committed_b=rounds + accepted if gamma else np.full(batch, rounds),
        overlap_b=accepted if gamma else np.zeros(batch),
        scored_b=scored if gamma else np.zeros(batch, int),
        remaining_b=np.broadcast_to(np.asarray(remaining), (batch,)),
    )


def run_chunk(controller, acceptance, extra_steps=0.0, remaining=100):
    """Asks for the next chunk and reports it back: every drafted position is accepted with
    probability `acceptance` (exactly, in expectation: accepted = acceptance * scored), and a
    round takes what the costs predict, plus extra_steps target steps per draft for the round's
    own work (which grows with gamma, as the loop's work over [gamma, V] does). Returns
    (gamma, rounds)."""
    gamma, rounds = controller.next_chunk(np.full(1, remaining))
    rounds = min(rounds, remaining)
    steps = controller.costs.round_cost(gamma) + extra_steps * gamma
    scored = rounds * gamma
    c = chunk(gamma, rounds, rounds * steps * controller.costs.step_seconds, acceptance * scored, scored)
    controller.observe(c)
    return gamma, rounds


def test_the_cached_costs_are_keyed_by_the_kernel_build(monkeypatch):
    from models.kernels import cpu_matmul, gguf_matmul

    keys = {}
    for isa in cpu_matmul.ISAS:  # the key names the build; nothing is built or run
        monkeypatch.setenv(cpu_matmul.ISA_ENV, isa)
        keys[isa] = step_costs.machine_key()
        assert f"-{isa}-" in keys[isa]["cpu_matmul"]
    assert step_costs.cache_path(keys["avx2"]) != step_costs.cache_path(keys["avx512"])
    # The GGUF kernel's build too: a faster product makes the costs measured with the old stale.
    monkeypatch.setenv(cpu_matmul.ISA_ENV, "avx512")
    assert step_costs.machine_key() == keys["avx512"]
    monkeypatch.setattr(gguf_matmul, "library_path", lambda cache_dir=None: pathlib.Path("gguf_matmul-0.so"))
    assert step_costs.cache_path(step_costs.machine_key()) != step_costs.cache_path(keys["avx512"])


@pytest.fixture
def measured(monkeypatch):
    """costs_for with measure() replaced by fixed costs; returns the list of measure calls."""
    calls = []

    def measure(target, drafter, params, sizes, **kwargs):
        calls.append(sizes.gamma_max)
        return costs(draft=0.05, gamma_max=sizes.gamma_max)

    monkeypatch.setattr(step_costs, "measure", measure)
    return calls


def fixed_entry(fixed):
    """A CostEntry of fixed costs that a run does not refresh (source "measured")."""
    return step_costs.CostEntry(fixed, "measured", pathlib.Path("unused.json"), {}, fixed)


def cached_costs(target, cache_dir):
    drafter = NoDrafter(target.config.vocab_size)
    sizes = step_costs.CostSizes(batch=1, cache_slots=64, gamma_max=8)
    return step_costs.costs_for(target, drafter, None, sizes, cache_dir=cache_dir)


@pytest.mark.parametrize(
    "edit",
    [
        {"verify": [1.0]},  # one entry: would turn drafting off forever
        {"verify": [1.0, 1.1, 1.2]},
        {"step_seconds": float("nan")},
        {"draft1": float("inf")},
        {"verify": [1.0] + [-1.0] * 8},
        {"step_seconds": 0.0},
    ],
)
def test_cached_costs_of_the_wrong_shape_or_not_finite_positive_are_measured_again(
    pair, tmp_path, measured, edit
):
    import json

    first = cached_costs(pair[0], tmp_path)
    (path,) = (tmp_path / "costs").glob("*.json")
    saved = json.loads(path.read_text())
    saved["costs"].update(edit)
    path.write_text(json.dumps(saved))  # valid JSON (NaN as JSON allows it), wrong content
    with pytest.warns(UserWarning, match="not usable"):
        assert cached_costs(pair[0], tmp_path) == first
    assert len(measured) == 2
    assert cached_costs(pair[0], tmp_path) == first and len(measured) == 2  # the file was rewritten


def test_a_cost_cache_that_cannot_be_written_is_a_warning_and_the_costs_are_used(pair, tmp_path, measured):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")  # the cache root is a file: nothing can be written under it
    with pytest.warns(UserWarning, match="could not cache the costs"):
        got = cached_costs(pair[0], blocker)
    assert len(got.verify) == 9 and len(measured) == 1


def test_two_threads_write_the_cost_cache_through_their_own_temporary_files(
    pair, tmp_path, measured, monkeypatch
):
    import os
    import threading

    barrier = threading.Barrier(2)
    measure = step_costs.measure
    monkeypatch.setattr(step_costs, "measure", lambda *a, **k: barrier.wait(5) * 0 or measure(*a, **k))
    sources, errors = [], []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: sources.append(str(src)) or replace(src, dst))

    def run():
        try:
            cached_costs(pair[0], tmp_path)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(measured) == 2
    assert len(set(sources)) == 2, sources
    assert [p.name for p in (tmp_path / "costs").iterdir() if p.name.startswith(".tmp")] == []


def test_an_expensive_draft_is_never_worth_drafting_with():
    expensive = costs(draft=1.5)
    assert all(expensive.best_gamma(a) == 0 for a in (0.0, 0.5, 0.9, 0.99, 1.0))
    assert autogamma.Controller(expensive, 8).phase == "never"


def test_a_cheap_draft_drafts_more_as_acceptance_rises_and_never_at_alpha_zero():
    cheap = costs(draft=0.05)
    choices = [cheap.best_gamma(a) for a in (0.0, 0.3, 0.6, 0.8, 0.95)]
    assert choices[0] == 0
    assert choices == sorted(choices) and choices[-1] > choices[1] > 0
    # The choice maximizes the rate it predicts.
    for a in (0.3, 0.8):
        g = cheap.best_gamma(a)
        assert all(cheap.rate(a, g) >= cheap.rate(a, h) for h in range(9))


def test_a_plain_round_is_timed_first_then_a_short_draft_that_grows_with_acceptance():
    controller = autogamma.Controller(costs(draft=0.05), gamma_max=8)
    assert run_chunk(controller, 1.0) == (0, autogamma.PLAIN_FIRST)
    first = controller.probe_gamma()  # what pays best at EXPLORE_ALPHA: a short, cheap try
    assert 0 < first < controller.best_at(autogamma.GOOD_ALPHA)
    gammas = [run_chunk(controller, 1.0)[0] for _ in range(6)]
    assert gammas[0] == first
    assert gammas[-1] > first and gammas == sorted(gammas)  # more drafts as acceptance shows
    assert controller.phase == "draft"


def test_gamma_changes_only_for_a_real_gain():
    controller = autogamma.Controller(costs(draft=0.05), gamma_max=8)
    run_chunk(controller, 0.8)
    for _ in range(10):
        run_chunk(controller, 0.8)
    settled = controller.gamma
    assert controller.alphas()[0] == pytest.approx(0.8, abs=0.02)
    rates = controller.rates(np.full(1, 0.8), np.full(1, END))
    # Within SWITCH_GAIN of the best (here gamma 4 and 5 differ by 0.4%), and it stays there.
    assert max(rates) <= autogamma.SWITCH_GAIN * rates[settled] and settled >= 3
    for _ in range(5):
        assert run_chunk(controller, 0.8)[0] == settled


def test_a_round_whose_own_work_is_expensive_ends_drafting_though_its_calls_are_cheap():
    """The model calls say drafting pays at this acceptance (gamma 1: 1.7 tokens for 1.15
    steps); the measured rounds take 1 target step more per draft (the loop's own work): plain
    decoding wins at every gamma, and auto decodes plainly after its first drafting chunk. With
    the rounds as the calls predict it keeps drafting."""
    fixed = costs(draft=0.05)
    assert fixed.best_gamma(0.7) > 0
    expensive = autogamma.Controller(fixed, gamma_max=8)
    schedule = [run_chunk(expensive, 0.7, extra_steps=1.0) for _ in range(4)]
    assert [g > 0 for g, _ in schedule] == [False, True, False, False], schedule
    assert expensive.phase == "plain"
    # The measured drafting round is what the controller now uses, not the calls' prediction.
    first = expensive.probe_gamma()
    assert expensive.round_seconds(first) == pytest.approx(0.01 * (fixed.round_cost(first) + first))
    cheap = autogamma.Controller(fixed, gamma_max=8)
    assert [run_chunk(cheap, 0.7)[0] > 0 for _ in range(5)] == [False] + [True] * 4


def seldom_proposing(controller, monkeypatch=None):
    """Chunks of a drafter that calls no model and proposes in one round of 8 (prompt lookup on
    text it does not copy): its proposals are right (alpha 1 over the few positions scored),
    yet each round costs 1.2 plain rounds as timed and commits 1.125 tokens (6% lost). Returns
    the schedule of the first 30 chunks."""
    schedule = []
    for _ in range(30):
        gamma, rounds = controller.next_chunk(np.full(1, 100))
        rounds = min(rounds, 16)
        if gamma == 0:
            controller.observe(chunk(0, rounds, rounds * 0.01, 0))
        else:
            scored = rounds / 8  # the positions scored: one round in 8 proposes one draft
            controller.observe(chunk(gamma, rounds, rounds * 0.012, scored, scored))
        schedule.append((gamma, rounds))
    return schedule


def test_a_try_that_measures_a_loss_ends_though_its_acceptance_looks_good():
    """The acceptance model sees few scored positions, all accepted, and keeps drafting; the
    rounds as timed lose 6% against plain rounds: the try ends after TRY_ROUNDS of them (its
    first chunk left out), as a draft that loses in its predictions would. Without the measured
    rule (Try.lost always False) it drafts on."""
    free = costs(draft=0.0, verify_slope=0.01)
    schedule = seldom_proposing(autogamma.Controller(free, gamma_max=8))
    first_try = list(itertools.takewhile(lambda c: c[0] > 0, schedule[1:]))
    assert schedule[0][0] == 0 and sum(r for _, r in first_try) <= 2 + tries.TRY_ROUNDS + autogamma.MAX_CHUNK
    drafted, plain = (sum(r for g, r in schedule if bool(g) == d) for d in (True, False))
    assert drafted < plain / 3  # renewed tries, each ended as the first


def test_without_the_measured_rule_the_same_try_drafts_on(monkeypatch):
    monkeypatch.setattr(tries.Try, "lost", lambda self, chunk, times, active: False)
    free = costs(draft=0.0, verify_slope=0.01)
    schedule = seldom_proposing(autogamma.Controller(free, gamma_max=8))
    assert sum(r for g, r in schedule if g) > 100


def test_a_draft_whose_acceptance_collapses_is_dropped_within_a_few_rounds():
    controller = autogamma.Controller(costs(draft=0.05), gamma_max=8)
    for _ in range(12):  # a perfect draft: gamma climbs
        run_chunk(controller, 1.0)
    assert controller.gamma >= 3
    rounds = 0
    while controller.phase == "draft":  # then always wrong
        rounds += run_chunk(controller, 0.0)[1]
    assert rounds <= 6


def test_renewed_drafting_brings_the_draft_back_when_acceptance_recovers():
    controller = autogamma.Controller(costs(draft=0.05), gamma_max=8)
    for _ in range(12):  # drafting pays for a while: savings to spend on renewed tries
        run_chunk(controller, 1.0, remaining=1000)
    while controller.phase == "draft":
        run_chunk(controller, 0.0, remaining=1000)
    while (gamma := run_chunk(controller, 0.0, remaining=1000)[0]) == 0:
        pass
    assert gamma == controller.probe_gamma()  # a renewed try
    tried = autogamma.PROBE_ROUNDS
    while controller.phase == "draft":  # that fails: the draft is still always wrong
        tried += run_chunk(controller, 0.0, remaining=1000)[1]
    assert tried <= 6
    wait = controller.rounds_until_probe(np.full(1, 1000))
    assert wait >= 2 * autogamma.PROBE_SPACING  # a failed try makes the next one wait longer
    while run_chunk(controller, 0.0, remaining=1000)[0] == 0:
        pass
    for _ in range(4):  # now the draft is good again: drafting resumes and stays
        run_chunk(controller, 1.0, remaining=1000)
    assert controller.phase == "draft" and controller.gamma >= 2


def test_renewed_tries_spend_only_savings_and_a_small_share_of_the_time():
    """With catch-ups that cost 5 target steps and nothing saved, a try comes only when
    PROBE_SHARE of the time spent covers its worst loss; never in a short call."""
    controller = autogamma.Controller(costs(draft=0.05, resume=5.0), gamma_max=8)
    run_chunk(controller, 0.0, remaining=60)
    while controller.phase == "draft":
        run_chunk(controller, 0.0, remaining=60)
    assert controller.bank < 0
    assert controller.rounds_until_probe(np.full(1, 50)) == END
    wait = controller.rounds_until_probe(np.full(1, 10**6))
    worst = controller.probe_cost(controller.probe_gamma(), autogamma.RESUME_WINDOW)
    assert worst > 5 * 0.01 * 2
    spent = controller.elapsed + wait * controller.round_seconds(0)
    assert spent * autogamma.PROBE_SHARE + controller.bank >= worst


def test_each_row_keeps_its_own_acceptance():
    controller = autogamma.Controller(costs(draft=0.05), gamma_max=8, batch=2)
    seconds = 4 * 0.01 * controller.costs.round_cost(1)
    controller.observe(chunk(1, 4, seconds, accepted=[4, 0], scored=[4, 4], batch=2))
    alphas = controller.alphas()
    assert alphas[0] > 0.8 and alphas[1] < 0.2


def test_the_batch_drafts_for_its_throughput_summed_over_the_rows_still_running():
    controller = autogamma.Controller(costs(draft=0.2, verify_slope=0.3), gamma_max=8, batch=2)
    good_and_bad = controller.rates(np.array([0.95, 0.05]), np.array([100, 100]))
    good_alone = controller.rates(np.array([0.95, 0.05]), np.array([100, 0]))
    assert np.argmax(good_and_bad) == 0  # the bad row pays every round's cost for nothing
    assert np.argmax(good_alone) > 0  # once it is done, drafting pays for the good one
    # A row about to finish gains nothing from drafting past its last token.
    last = controller.rates(np.array([1.0, 1.0]), np.array([1, 0]))
    assert np.argmax(last) == 0


# --- generate with gamma="auto" on tiny models ---------------------------------------------


class Scripted(autogamma.Controller):
    """A Controller whose chunks take what the costs predict (plus `extra` target steps per
    draft for the round's own work) instead of what the clock says, so its decisions follow
    from the costs and the acceptance alone."""

    extra = 0.0

    def observe(self, chunk):
        steps = self.costs.round_cost(chunk.gamma) + self.extra * chunk.gamma
        seconds = chunk.rounds * steps * self.costs.step_seconds
        super().observe(dataclasses.replace(chunk, seconds=seconds))

    def observe_resume(self, seconds, calls):
        super().observe_resume(calls * self.costs.resume * self.costs.step_seconds, calls)


@dataclasses.dataclass(frozen=True)
class Turning(Drafter):
    """Drafts as `inner` except at row lengths in [wrong_from, wrong_until), where it proposes
    inner's drafts + 1 (mod V) with one-hot q. With the target itself as inner, greedy drafts
    are always accepted outside that range and never inside it."""

    inner: ModelDrafter
    wrong_from: int
    wrong_until: int = 2**30

    vocab_size = property(lambda self: self.inner.vocab_size)
    max_seq_len = property(lambda self: self.inner.max_seq_len)
    prefill_calls = property(lambda self: self.inner.prefill_calls)
    sources = ("model",)
    resumable = True

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        return self.inner.init(params, tokens_bp, prompt_lens_b, cache_len)

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        tokens, q, state = self.inner.propose(params, state, context_b2, length_b, gamma, sampling, keys_b)
        wrong = ((length_b >= self.wrong_from) & (length_b < self.wrong_until))[:, None]
        shifted = (tokens + 1) % self.vocab_size
        q_shifted = jax.nn.one_hot(shifted, self.vocab_size, dtype=q.dtype)
        return jnp.where(wrong, shifted, tokens), jnp.where(wrong[..., None], q_shifted, q), state

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return self.inner.resume(params, state, text_bs, synced_b, length_b, width)


@pytest.fixture(scope="module")
def pair():
    target = models.random_model(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0)
    return target, perturbed(target, 0.1, seed=7)


@pytest.fixture(scope="module")
def greedy_ar(pair):
    return spec_jax.generate(pair[0], PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0).tokens


@pytest.fixture
def scripted(monkeypatch):
    """generate(gamma="auto") with fixed costs (a cheap draft: gamma 1-4 pay at high acceptance)
    and Scripted chunk times; returns the Scripted class to adjust."""
    fixed = costs(draft=0.05, verify_slope=0.2, resume=0.5)
    monkeypatch.setattr(spec_jax.autogamma, "cost_entry", lambda *a, **k: fixed_entry(fixed))
    monkeypatch.setattr(spec_jax.autogamma, "Controller", Scripted)
    monkeypatch.setattr(Scripted, "extra", 0.0)
    return Scripted


def test_greedy_output_is_exact_while_gamma_changes_between_chunks(pair, greedy_ar, scripted):
    gen = spec_jax.generate(
        pair[0], PROMPTS, draft=pair[1], gamma="auto", max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == greedy_ar
    drafting = {g for g, _ in gen.stats["gamma_schedule"] if g}
    assert gen.stats["gamma_schedule"][0] == [0, autogamma.PLAIN_FIRST]
    assert len(drafting) >= 2, gen.stats["gamma_schedule"]


def test_auto_rules_out_a_deliberately_expensive_draft_from_its_weights_alone(
    pair, greedy_ar, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPEC_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(step_costs, "measure", lambda *a, **k: pytest.fail("measured before the run"))
    # The draft is ~300x the target's compute: no acceptance rate can make it pay.
    expensive = models.random_model(
        vocab_size=64, num_layers=4, d_model=512, num_heads=8, num_kv_heads=2, seed=3
    )
    gen = spec_jax.generate(
        pair[0], PROMPTS, draft=expensive, gamma="auto", max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == greedy_ar
    assert [g for g, _ in gen.stats["gamma_schedule"]] == [0]
    assert gen.stats["num_draft_tokens"] == 0
    assert not (tmp_path / "costs").exists()  # nothing drafted, nothing timed to cache


def test_a_loop_whose_own_work_is_expensive_decodes_plainly_after_one_try(pair, scripted):
    target = pair[0]
    prompt = [PROMPTS[2]]
    ar = spec_jax.generate(target, prompt, max_new_tokens=MAX_NEW, temperature=0.0).tokens
    perfect = ModelDrafter(target.config), target.params
    scripted.extra = 1.0  # the round's own work: a target step per draft, which the calls do not show
    gen = spec_jax.generate(
        target, prompt, draft=perfect, gamma="auto", max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == ar
    assert [g for g, _ in gen.stats["gamma_schedule"]] == [0, 1, 0], gen.stats["gamma_schedule"]
    scripted.extra = 0.0  # the same draft when the rounds cost what their calls do: it drafts on
    gen = spec_jax.generate(
        target, prompt, draft=perfect, gamma="auto", max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == ar
    assert gen.stats["gamma_schedule"][-1][0] > 1, gen.stats["gamma_schedule"]


def test_auto_stops_drafting_within_a_few_rounds_when_the_draft_turns_always_wrong(pair, scripted):
    target = pair[0]
    prompt = PROMPTS[2]
    ar = spec_jax.generate(target, [prompt], max_new_tokens=MAX_NEW, temperature=0.0).tokens
    turning = Turning(ModelDrafter(target.config), wrong_from=len(prompt) + 16), target.params
    gen = spec_jax.generate(
        target, [prompt], draft=turning, gamma="auto", max_new_tokens=MAX_NEW, temperature=0.0
    )
    assert gen.tokens == ar
    schedule = gen.stats["gamma_schedule"]
    assert schedule[-1][0] == 0 and max(g for g, _ in schedule) >= 2, schedule
    # Every drafting round after the turn accepts nothing, every one before it all its drafts
    # (the histogram counts plain rounds at 0 accepted too).
    plain_rounds = sum(r for g, r in schedule if g == 0)
    rejected_rounds = gen.stats["accepted_histogram"][0] - plain_rounds
    assert 1 <= rejected_rounds <= 6, (schedule, gen.stats["accepted_histogram"])


def test_drafting_comes_back_after_plain_decoding_when_the_draft_recovers(pair, scripted, monkeypatch):
    target = pair[0]
    prompt = PROMPTS[0]
    max_new = 160
    monkeypatch.setattr(autogamma, "PROBE_SPACING", 8)
    ar = spec_jax.generate(target, [prompt], max_new_tokens=max_new, temperature=0.0).tokens
    start, stop = len(prompt) + 24, len(prompt) + 80  # always wrong for 56 tokens, then right
    turning = Turning(ModelDrafter(target.config), wrong_from=start, wrong_until=stop), target.params
    gen = spec_jax.generate(
        target, [prompt], draft=turning, gamma="auto", max_new_tokens=max_new, temperature=0.0
    )
    assert gen.tokens == ar
    schedule = gen.stats["gamma_schedule"]
    gammas = [g for g, _ in schedule]
    fallback = gammas.index(0, 1)  # the first plain chunk after the one that timed a plain round
    assert max(gammas[fallback:]) >= 2, schedule  # drafting again, at more than one draft
    assert gammas[-1] > 0, schedule  # to the end: the draft is right from there on
    assert gen.stats["resume_seconds"] > 0  # the draft caught up on what plain decoding committed


def test_resume_catches_the_draft_cache_up_on_the_committed_text(pair):
    """After a resume from `synced`, the draft's cache at positions synced .. length-3 equals a
    fresh prefill of the committed text; committed_text lays out prompt + generated tokens."""
    target, draft = pair
    drafter, params = as_drafter(draft)
    prompt_bp = jnp.asarray([[3, 4, 5, 0], [6, 7, 0, 0]], jnp.int32)
    prompt_lens = jnp.asarray([3, 2], jnp.int32)
    out_bn = jnp.asarray([[10, 11, 12, 13, 14, 15, 0], [20, 21, 22, 23, 0, 0, 0]], jnp.int32)
    length = prompt_lens + jnp.asarray([6, 4])
    slots = 16
    text = committed_text(prompt_bp, prompt_lens, out_bn, length, slots)
    assert np.asarray(text)[0, :10].tolist() == [3, 4, 5, 10, 11, 12, 13, 14, 15, 0]
    assert np.asarray(text)[1, :7].tolist() == [6, 7, 20, 21, 22, 23, 0]
    cache = drafter.init(params, prompt_bp, prompt_lens, slots)
    synced = prompt_lens
    for width in (1, 2, 8):
        resumed = jax.jit(drafter.resume, static_argnums=5)(params, cache, text, synced, length, width)
        for b in range(2):
            n = int(length[b])
            fresh = apply(
                draft, text[b : b + 1], jnp.arange(slots)[None], models.init_cache(draft.config, 1, slots)
            ).cache
            np.testing.assert_allclose(resumed.k[:, b, : n - 2], fresh.k[:, 0, : n - 2], atol=1e-5)
            np.testing.assert_allclose(resumed.v[:, b, : n - 2], fresh.v[:, 0, : n - 2], atol=1e-5)
