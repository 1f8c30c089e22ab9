"""tree="auto" (spec_jax.tree_auto.TreeController): chunk by chunk, plain decoding, chains or
token trees, by expected tokens per second from the costs and the running acceptance; greedy
output equals plain decoding whatever it chooses.

No test here reads a clock: chunks take the seconds their arm's costs say (TreeScripted), and
where a tree's rounds cost more than its calls measured offline, `actual` says how much.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_case

import spec_jax
from spec_jax import theory
from spec_jax import tree as tree_lib
from spec_jax.autogamma import controller as autogamma
from spec_jax.autogamma import cost_cache as step_costs
from spec_jax.autogamma import trees as tree_auto
from spec_jax.drafting import AUTO_GAMMA_MAX, AUTO_TREE_SIZES
from spec_jax.drafting.base import Drafter, Proposal, TreeProposal

PROMPTS = [[5, 9, 2], [7, 7, 3, 8, 11, 4, 6, 2, 9, 10]]
NEW = 64
SIZES = AUTO_TREE_SIZES


def costs(tree_verify, chain_slope=0.02, gamma_max=AUTO_GAMMA_MAX):
    """A drafter without a model (drafting is free): chain verify calls 1 + slope * g target
    steps, tree verify calls as given ({N: steps})."""
    return step_costs.Costs(
        step_seconds=0.01,
        draft1=0.0,
        draft2=0.0,
        verify=(1.0,) + tuple(1.0 + chain_slope * g for g in range(1, gamma_max + 1)),
        tree_verify=tuple((n, float(tree_verify[n])) for n in SIZES),
    )


CHEAP = {4: 1.05, 8: 1.1, 16: 1.3}  # a tree verifies almost as cheaply as a decode step
EXPENSIVE = {4: 3.0, 8: 6.0, 16: 12.0}  # trees lose at any yield their drafter has here


class TreeScripted(tree_auto.TreeController):
    """A TreeController whose chunks take what the costs say instead of what the clock says: a
    chain's round its calls, a tree's round `actual[N]` target steps (default: its calls)."""

    actual: dict = {}

    def observe(self, chunk):
        if chunk.tree:
            steps = self.actual.get(chunk.tree, self.costs.tree_round_cost(chunk.tree))
        else:
            steps = self.costs.round_cost(chunk.gamma)
        super().observe(dataclasses.replace(chunk, seconds=chunk.rounds * steps * self.costs.step_seconds))

    def observe_resume(self, seconds, calls):
        super().observe_resume(0.0, calls)


@dataclasses.dataclass(frozen=True)
class Oracle(Drafter):
    """Knows each row's greedy text (its params, its state from init on). A chain's first
    `chain_right` drafts are right, the rest wrong; a tree of N slots holds N // 2 levels of
    [wrong, right] siblings, each level under the previous right node, right for `tree_right`
    levels: its trees accept far more than its chains. right=False: every draft is wrong."""

    vocab_size: int
    chain_right: int = 1
    tree_right: int = 6
    right: bool = True
    resumable = True

    def init(self, params, tokens_bp, prompt_lens_b, cache_len, features_bpd=None):
        return params

    def resume(self, params, state, text_bs, synced_b, length_b, width):
        return state

    def _text(self, state, length_b, depth):
        d = jnp.arange(depth)
        return jnp.take_along_axis(state, jnp.minimum(length_b[:, None] + d, state.shape[1] - 1), axis=1)

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        right = self._text(state, length_b, gamma)
        keep = self.right & (jnp.arange(gamma) < self.chain_right)[None, :]
        tokens = jnp.where(keep, right, (right + 1) % self.vocab_size).astype(jnp.int32)
        return Proposal(tokens, jax.nn.one_hot(tokens, self.vocab_size), state)

    def propose_tree(self, params, state, context_b2, length_b, nodes, sampling, keys_b):
        b, levels = length_b.shape[0], nodes // 2
        d = jnp.arange(levels)
        right = self._text(state, length_b, levels)
        wrong = (right + 1) % self.vocab_size
        keep = self.right & (d < self.tree_right)[None, :]
        right = jnp.where(keep, right, (right + 2) % self.vocab_size)
        tokens = jnp.pad(jnp.stack([wrong, right], axis=2).reshape(b, 2 * levels), ((0, 0), (0, nodes % 2)))
        parents = jnp.pad(jnp.repeat(2 * d - 1, 2), (0, nodes % 2), constant_values=-1)
        q = jax.nn.one_hot(tokens, self.vocab_size) * (jnp.arange(nodes) < 2 * levels)[None, :, None]
        tree = tree_lib.Tree(
            tokens.astype(jnp.int32), jnp.broadcast_to(parents, (b, nodes)).astype(jnp.int32), q
        )
        return TreeProposal(tree, state)


@pytest.fixture(scope="module")
def plain(tiny_target):
    return spec_jax.generate(tiny_target, PROMPTS, max_new_tokens=NEW, temperature=0.0)


def oracle_params(plain_gen):
    s = max(len(p) for p in PROMPTS) + NEW + 32
    text = np.zeros((len(PROMPTS), s), np.int32)
    for i, (p, t) in enumerate(zip(PROMPTS, plain_gen.tokens, strict=True)):
        text[i, : len(p) + len(t)] = p + t
    return jnp.asarray(text)


@pytest.fixture
def scripted(monkeypatch):
    """generate(tree="auto") with the costs set by set_costs and TreeScripted chunk times."""
    monkeypatch.setattr(spec_jax.autogamma, "TreeController", TreeScripted)
    monkeypatch.setattr(TreeScripted, "actual", {})

    def set_costs(fixed, actual=None):
        entry = step_costs.CostEntry(fixed, "measured", pathlib.Path("unused.json"), {}, fixed)
        monkeypatch.setattr(spec_jax.autogamma, "cost_entry", lambda *a, **k: entry)
        monkeypatch.setattr(TreeScripted, "actual", actual or {})

    return set_costs


def run_auto(target, plain_gen, **oracle):
    draft = Oracle(target.config.vocab_size, **oracle), oracle_params(plain_gen)
    return spec_jax.generate(target, PROMPTS, draft=draft, tree="auto", max_new_tokens=NEW, temperature=0.0)


def rounds_by_kind(schedule) -> dict:
    """{"plain": rounds, "chain": rounds, "tree": rounds} of a gamma_schedule."""
    out = {"plain": 0, "chain": 0, "tree": 0}
    for arm, rounds in schedule:
        out["tree" if isinstance(arm, str) else "chain" if arm else "plain"] += rounds
    return out


def test_cheap_trees_that_accept_more_than_chains_run_tree_chunks(tiny_target, plain, scripted):
    scripted(costs(CHEAP))
    gen = run_auto(tiny_target, plain)
    assert gen.tokens == plain.tokens
    schedule = gen.stats["gamma_schedule"]
    kinds = rounds_by_kind(schedule)
    assert kinds["tree"] > kinds["chain"] + kinds["plain"], schedule
    # The schedule names the arms: plain first, a chain tried, then the trees ("treeN").
    assert schedule[0] == [0, autogamma.PLAIN_FIRST] and schedule[1][0] in range(1, 9), schedule
    assert {arm for arm, _ in schedule if isinstance(arm, str)} <= {autogamma.tree_arm(n) for n in SIZES}
    assert schedule[-1][0] == autogamma.tree_arm(16), schedule  # 7 tokens for 1.3 steps: the best


def test_trees_whose_verify_call_costs_too_much_are_never_run(tiny_target, plain, scripted):
    scripted(costs(EXPENSIVE))
    gen = run_auto(tiny_target, plain)
    assert gen.tokens == plain.tokens
    kinds = rounds_by_kind(gen.stats["gamma_schedule"])
    assert kinds["tree"] == 0 and kinds["chain"] > kinds["plain"], gen.stats["gamma_schedule"]


def test_a_tree_whose_measured_rounds_lose_is_dropped_for_the_chain(
    tiny_target, plain, scripted, monkeypatch
):
    """The offline calls say trees are cheap, the rounds as run take 12 target steps (say, the
    tree mask's own cost): auto tries the trees briefly and settles on a chain. A controller
    that times a tree as the chain of as many drafts (ignoring its measured rounds) keeps the
    losing tree."""
    scripted(costs(CHEAP), actual={n: 12.0 for n in SIZES})
    gen = run_auto(tiny_target, plain)
    assert gen.tokens == plain.tokens
    schedule = gen.stats["gamma_schedule"]
    kinds = rounds_by_kind(schedule)
    assert kinds["tree"] <= len(SIZES) * tree_auto.TREE_PROBE_ROUNDS * 2, schedule
    assert kinds["chain"] > 3 * kinds["tree"] and isinstance(schedule[-1][0], int), schedule

    def chains_time(self, nodes):
        return self.round_seconds(min(nodes, self.gamma_max))

    monkeypatch.setattr(tree_auto.TreeController, "tree_round_seconds", chains_time)
    broken = run_auto(tiny_target, plain)
    assert broken.tokens == plain.tokens
    schedule = broken.stats["gamma_schedule"]
    kinds = rounds_by_kind(schedule)
    assert kinds["tree"] > kinds["chain"] + kinds["plain"] and isinstance(schedule[-1][0], str), schedule


def test_a_drafter_that_never_matches_decodes_plainly(tiny_target, plain, scripted):
    scripted(costs(CHEAP, chain_slope=0.1))
    gen = run_auto(tiny_target, plain, right=False)
    assert gen.tokens == plain.tokens
    schedule = gen.stats["gamma_schedule"]
    kinds = rounds_by_kind(schedule)
    assert schedule[-1][0] == 0 and kinds["plain"] > 3 * (kinds["chain"] + kinds["tree"]), schedule
    assert kinds["tree"] <= tree_auto.TREE_PROBE_ROUNDS, schedule  # one short try at most


def test_an_untried_tree_runs_only_when_its_prior_beats_the_best_arm():
    """The prior 1 + TREE_BONUS * (E(alpha, N) - 1): at alpha 0 a tree promises plain
    decoding's one token; at a good alpha with a cheap verify it beats the chains."""
    controller = tree_auto.TreeController(costs(CHEAP), AUTO_GAMMA_MAX)
    controller.overlap, controller.weight = np.zeros(1), np.full(1, 100.0)  # alpha 0
    assert controller.tree_yields(8) == pytest.approx([1.0])
    controller.overlap = np.full(1, 80.0)  # alpha 0.8
    expected = float(theory.expected_tokens(0.8, 8))
    assert controller.tree_yields(8) == pytest.approx([1.0 + tree_auto.TREE_BONUS * (expected - 1.0)])
    end = np.full(1, autogamma.END)
    chains = controller.rates(controller.alphas(), end)
    assert controller.tree_rate(8, end) > autogamma.SWITCH_GAIN * chains.max()
    costly = tree_auto.TreeController(costs(EXPENSIVE), AUTO_GAMMA_MAX)
    costly.overlap, costly.weight = controller.overlap, controller.weight
    assert max(costly.tree_rate(n, end) for n in SIZES) < costly.rates(costly.alphas(), end).max()


def test_tree_auto_measures_the_tree_widths_under_its_own_key(tiny_target, tmp_path, monkeypatch):
    from spec_jax.drafting import NoDrafter

    calls = []

    def measure(target, drafter, params, sizes, **kwargs):
        calls.append(sizes.tree_sizes)
        return dataclasses.replace(
            costs(CHEAP), tree_verify=costs(CHEAP).tree_verify if sizes.tree_sizes else ()
        )

    monkeypatch.setattr(step_costs, "measure", measure)
    drafter = NoDrafter(tiny_target.config.vocab_size)

    def cached(tree_sizes=()):
        sizes = step_costs.CostSizes(batch=1, cache_slots=64, tree_sizes=tree_sizes)
        return step_costs.costs_for(tiny_target, drafter, None, sizes, cache_dir=tmp_path)

    assert cached().tree_verify == ()
    assert dict(cached(SIZES).tree_verify) == CHEAP
    assert cached(SIZES) == cached(SIZES) and cached() == cached()
    assert calls == [(), SIZES]  # two keys, each measured once
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2
    with pytest.raises(ValueError, match="tree_verify is for trees of"):
        step_costs.checked_costs(dataclasses.asdict(costs(CHEAP)), AUTO_GAMMA_MAX, (4, 8))


def test_measure_times_the_verify_call_of_each_tree_size(tiny_target):
    from spec_jax.drafting import NoDrafter

    sizes = step_costs.CostSizes(batch=1, cache_slots=64, gamma_max=2, tree_sizes=(4, 16))
    got = step_costs.measure(tiny_target, NoDrafter(64), None, sizes, repeats=1)
    assert [n for n, _ in got.tree_verify] == [4, 16] and all(v > 0 for _, v in got.tree_verify)
    assert got.tree_round_cost(16) == dict(got.tree_verify)[16]  # a drafter without a model: free


def test_arm_shapes():
    assert autogamma.arm_shape(0) == (0, 0) and autogamma.arm_shape(5) == (5, 0)
    assert autogamma.arm_shape(autogamma.tree_arm(16)) == (16, 16)


def test_bad_tree_values_are_one_line_naming_the_range():
    pair = ["--target=random", "--draft=random-draft", "--gamma=4", "--prompt=abc"]
    cases = [pair + ["--tree=many"], pair + ["--tree=-1"], pair + ["--tree=auto", "--max_new_tokens=2040"]]
    expected = [
        "--tree must be 0 (chains), a node count in [1, 31] or 'auto', got 'many'",
        "--tree must be 0 (chains), a node count in [1, 31] or 'auto', got '-1'",
        "--tree must be in [1, 5] here (the longest prompt (3 tokens) + max_new_tokens (2040) + --tree "
        "must fit the target's context of 2048 tokens), got 'auto' (up to 16)",
    ]
    for case, message in zip(cases, expected, strict=True):
        result = cli_case("launch.generate", cases, case)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert message in lines[0] and "Traceback" not in result.stderr


def test_generate_refuses_bad_tree_values(tiny_target):
    for bad in ("many", 32, -1, 2.5):
        with pytest.raises(
            ValueError, match="tree must be 0 \\(chains\\), a node count in \\[1, 31\\] or 'auto'"
        ):
            spec_jax.generate(tiny_target, PROMPTS, draft=tiny_target, tree=bad, max_new_tokens=4)


def test_a_draft_models_chains_and_trees_interleave_exactly(tiny_target, tiny_draft, plain, scripted):
    """The draft model's chunks switch between chains (its cache written by propose) and its
    EAGLE-2 trees (the path moved by accepted): greedy output stays plain decoding's."""
    scripted(costs(CHEAP))
    gen = spec_jax.generate(
        tiny_target, PROMPTS, draft=tiny_draft, tree="auto", max_new_tokens=NEW, temperature=0.0
    )
    assert gen.tokens == plain.tokens
    kinds = rounds_by_kind(gen.stats["gamma_schedule"])
    assert kinds["tree"] > 0 and kinds["chain"] > 0, gen.stats["gamma_schedule"]
