"""The prefix cache (spec_jax.prefix_cache): a row prefilled from cached prompt blocks has the bits
of a full prefill; the index finds exactly the shared blocks; eviction never serves a block's
slot with another block's entries."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.transformer import attention_impl
from spec_jax import decode
from spec_jax.prefix_cache import BLOCK, PrefixCache, block_bytes, block_keys

WIDTH, CACHE_LEN = 128, 160


@pytest.fixture(scope="module")
def model():
    f32 = models.random_model(
        vocab_size=96, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, scan_layers=False, seed=5
    )
    m = models.cast(f32, "int8")
    assert attention_impl(m.config) == "cpu"  # the row-wise prefill, where a hit is read
    return m


def _ids(n, seed):
    return list(np.random.default_rng(seed).integers(1, 96, n))


_prefill = jax.jit(decode.prefill, static_argnums=(0, 4, 5))


def run(model, prompts, cache=None):
    """decode.prefill of prompts (padded to WIDTH), reading each one's hit in `cache` first."""
    tokens, lens = decode.pad_prompts(prompts, WIDTH)
    prefix = None
    if cache is not None:
        hits = [cache.lookup(p) for p in prompts]
        prefix = (cache.pool, jnp.asarray(cache.block_table(hits, len(prompts), WIDTH)))
    return _prefill(
        model.config, model.params, jnp.asarray(tokens), jnp.asarray(lens), CACHE_LEN, False, prefix
    )


def assert_same_rows(got, ref, prompts):
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(ref.logits))
    for r, p in enumerate(prompts):
        for a, b in ((got.cache.k, ref.cache.k), (got.cache.v, ref.cache.v)):
            np.testing.assert_array_equal(np.asarray(a[:, r, : len(p)]), np.asarray(b[:, r, : len(p)]))


def cache_of(model, prompts, mb=1.0):
    cache = PrefixCache(model.config, mb)
    out = run(model, prompts)
    cache.insert(prompts, out.cache, len(prompts), WIDTH)
    return cache


def test_a_row_read_from_cached_blocks_has_the_bits_of_a_full_prefill(model):
    """Prompts sharing 70 tokens with a cached one (the hit ends inside a chunk: 64 read, the
    chunk of 64-95 read again), exactly 64 (the hit ends at a chunk's edge), the whole cached
    prompt of 96 tokens (its last block is read again: its last token's logits), and none."""
    base = _ids(96, 0)
    cache = cache_of(model, [base])
    prompts = [base[:70] + _ids(20, 1), base[:64] + _ids(9, 2), base, _ids(50, 3)]
    hits = [cache.lookup(p).tokens for p in prompts]
    assert hits == [64, 64, 64, 0]
    assert_same_rows(run(model, prompts, cache), run(model, prompts), prompts)


def test_a_hit_shifted_by_one_token_would_be_caught(model):
    """Broken on purpose: a cache whose blocks were read one position off (the prompt shifted by
    one token) gives other bits than a full prefill: the bit-for-bit comparison catches it."""
    base = _ids(96, 0)
    cache = cache_of(model, [[7] + base[:-1]])  # the same blocks' tokens, one position later
    prompt = [base[:70] + _ids(20, 1)]
    hit = cache.lookup(prompt[0])
    assert hit.tokens == 0  # the chain keys differ: nothing is shared
    cache.index = collections.OrderedDict(zip(block_keys(prompt[0][:64]), range(2), strict=True))
    with pytest.raises(AssertionError):
        assert_same_rows(run(model, prompt, cache), run(model, prompt), prompt)


def test_block_keys_chain_every_token_before_the_blocks_end():
    a = _ids(100, 4)
    b = list(a)
    b[5] += 1  # a change in block 0 changes every later key
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 100 // BLOCK == 3
    assert all(x != y for x, y in zip(ka, kb, strict=True))
    c = a[:64] + [a[64] + 1] + a[65:]  # a change in block 2 keeps blocks 0 and 1
    assert block_keys(c)[:2] == ka[:2] and block_keys(c)[2] != ka[2]


def test_eviction_takes_least_recently_used_leaves_and_never_mislabels_a_slot(model):
    """A pool of 2 blocks: a 3-block prompt keeps its last blocks' slots written once each (the
    slot taken twice in one insert holds the later block); a lookup then finds only blocks whose
    entries are their own, and a row read from them has a full prefill's bits."""
    base = _ids(100, 6)
    cache = cache_of(model, [base], mb=2 * block_bytes(model.config) / 2**20)
    assert cache.num_slots == 2 and len(cache.index) == 2
    assert cache.lookup(base).tokens == 0  # block 0 was evicted for block 2: its descendants are unreachable
    other = _ids(40, 7)
    out = run(model, [other])
    cache.insert([other], out.cache, 1, WIDTH)  # evicts the least recent of the two
    assert cache.lookup(other + [1]).tokens == BLOCK
    prompts = [other + _ids(30, 8)]
    assert_same_rows(run(model, prompts, cache), run(model, prompts), prompts)


def test_a_pool_smaller_than_a_block_is_refused_naming_the_flag(model):
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        PrefixCache(model.config, 1e-6)


def alone(target, draft, prompt, max_new_tokens: int, seed: int, temperature: float = 0.0) -> list[int]:
    """The request's tokens from spec_jax.generate alone (gamma 3, EOS ignored): what the engine's
    row must equal, whatever it read from the prefix cache."""
    import spec_jax

    gen = spec_jax.generate(
        target, [prompt], draft=draft, gamma=3, max_new_tokens=max_new_tokens,
        temperature=temperature, seed=seed, eos_id=None,
    )  # fmt: skip
    return gen.tokens[0]


@pytest.mark.xdist_group("tiny_target")
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_engine_requests_behind_a_shared_prefix_read_it_from_the_cache_and_stay_exact(
    tiny_target, tiny_draft, temperature
):
    """A system prompt of 70 tokens shared by three requests (and a fourth that repeats the first
    whole): the later ones read 64 of its tokens from the cache (two blocks; the chunk holding the
    70th is read again), and every request's tokens equal spec_jax.generate's for it alone."""
    from spec_jax.engine import Engine
    from spec_jax.request import Request

    system = [1 + (7 * i) % 60 for i in range(70)]
    prompts = [system + [5, 9, 2], system + [7, 3], system + [11] * 20, system + [5, 9, 2]]
    engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma=3, max_context=160)
    handles, tokens = [], {}
    for i, p in enumerate(prompts):
        handles.append(
            engine.submit(
                Request(prompt_ids=tuple(p), max_tokens=6, seed=i, temperature=temperature, stop_ids=())
            )
        )
        for u in engine.drain():
            tokens.setdefault(u.handle, []).extend(u.token_ids)
    assert [h.cached_tokens for h in handles] == [0, 64, 64, 64]
    assert engine.stats()["prefix_cache_hit_tokens"] == 3 * 64
    for i, (h, p) in enumerate(zip(handles, prompts, strict=True)):
        assert tokens[h] == alone(tiny_target, tiny_draft, p, 6, i, temperature), i


@pytest.mark.xdist_group("tiny_target")
def test_a_long_prompt_takes_turns_with_the_running_rows_and_both_stay_exact(tiny_target, tiny_draft):
    """A 200-token prompt arrives while a request decodes: it is read into the prefix cache in
    pieces of PREFILL_PIECE tokens, each followed by a chunk of the running row's decoding (the
    running request gets tokens between the pieces, not only after the whole prefill), then
    admitted reading its cached prefix; both requests' tokens equal each alone."""
    from spec_jax import prefiller
    from spec_jax.engine import Engine
    from spec_jax.request import Request

    long_prompt = [1 + (5 * i) % 60 for i in range(200)]
    engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma=3, max_context=320)
    running = engine.submit(Request(prompt_ids=(5, 9, 2), max_tokens=250, seed=1, stop_ids=()))
    tokens = {}
    for u in engine.step():  # admitted: it decodes from the next step on
        tokens.setdefault(u.handle, []).extend(u.token_ids)
    late = engine.submit(Request(prompt_ids=tuple(long_prompt), max_tokens=8, seed=2, stop_ids=()))
    progress = []  # (pieces so far, the running request's tokens so far) after each step
    while not engine.idle:
        for u in engine.step():
            tokens.setdefault(u.handle, []).extend(u.token_ids)
        progress.append((engine.stats().get("prefill_pieces", 0), len(tokens.get(running, []))))
    pieces = progress[-1][0]
    assert pieces == -(-(200 - prefiller.PREFILL_PIECE) // prefiller.PREFILL_PIECE)  # the last is admitted
    # between the first piece and the last the running request kept producing tokens
    during = [n for p, n in progress if 1 <= p < pieces]
    assert during and during[-1] > during[0]
    assert late.cached_tokens >= 200 - prefiller.PREFILL_PIECE
    for h, (p, n, seed) in ((running, ([5, 9, 2], 250, 1)), (late, (long_prompt, 8, 2))):
        assert tokens[h] == alone(tiny_target, tiny_draft, p, n, seed)


@pytest.mark.slow
def test_a_prefix_hit_has_a_full_prefills_bits_on_the_real_target_at_gguf_q8():
    """The Qwen 1.5B at the server's precision (the GGUF kernel's blocks): a prompt read from a
    cached 64-token prefix has the logits and cache entries of a full prefill, bit for bit."""
    target = models.load("qwen2.5-coder-1.5b", dtype="gguf_q8")
    assert attention_impl(target.config) == "cpu"  # the row-wise prefill
    text = "def fibonacci(n):\n    " + " ".join(f"x{i} = {i} * n" for i in range(40))
    ids = target.tokenizer.encode(text)[:100]
    assert len(ids) == 100
    cache = PrefixCache(target.config, 64.0)
    out = run(target, [ids])
    cache.insert([ids], out.cache, 1, WIDTH)
    prompts = [ids[:70] + target.tokenizer.encode(" return fib(n - 1)")]
    assert cache.lookup(prompts[0]).tokens == 64
    assert_same_rows(run(target, prompts, cache), run(target, prompts), prompts)


@pytest.mark.xdist_group("tiny_target")
def test_a_request_behind_a_long_prompt_is_admitted_while_its_pieces_are_read(tiny_target, tiny_draft):
    """A short request sent just after a 200-token prompt (while a row decodes) does not wait for
    the long prompt's whole prefill: it gets its first token before the long prompt's last
    piece is read, and every request's tokens equal each alone (the old rule, admitting nothing
    while the queue's head is read in pieces, made it wait for all of them)."""
    from spec_jax import prefiller
    from spec_jax.engine import Engine
    from spec_jax.request import Request

    long_prompt = [1 + (7 * i) % 60 for i in range(200)]
    engine = Engine(tiny_target, tiny_draft, max_batch=3, gamma=3, max_context=320)
    jobs = {}
    running = engine.submit(Request(prompt_ids=(5, 9, 2), max_tokens=120, seed=1, stop_ids=()))
    jobs[running] = ([5, 9, 2], 120, 1)
    tokens = {}
    for u in engine.step():
        tokens.setdefault(u.handle, []).extend(u.token_ids)
    late = engine.submit(Request(prompt_ids=tuple(long_prompt), max_tokens=4, seed=2, stop_ids=()))
    short = engine.submit(Request(prompt_ids=(3, 4, 8), max_tokens=6, seed=3, stop_ids=()))
    jobs.update({late: (long_prompt, 4, 2), short: ([3, 4, 8], 6, 3)})
    first_at = None  # pieces read when the short request's first token came
    while not engine.idle:
        for u in engine.step():
            tokens.setdefault(u.handle, []).extend(u.token_ids)
            if u.handle is short and u.token_ids and first_at is None:
                first_at = engine.stats().get("prefill_pieces", 0)
    pieces = -(-(200 - prefiller.PREFILL_PIECE) // prefiller.PREFILL_PIECE)
    assert engine.stats()["prefill_pieces"] == pieces
    assert first_at is not None and first_at < pieces
    for h, (p, n, seed) in jobs.items():
        assert tokens[h] == alone(tiny_target, tiny_draft, p, n, seed)


@pytest.mark.xdist_group("tiny_target")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_finished_rows_generated_tokens_are_kept_with_a_full_prefills_bits(
    tiny_target, tiny_draft, temperature
):
    """A request of 40 prompt tokens that generates 60 (speculative rounds of gamma 3: verify
    calls write the entries) leaves the blocks of its prompt and reply in the prefix cache
    (decode_entries_exact): each block's entries are a full prefill's of the same tokens, bit
    for bit, and the next turn (the reply and more) reads 96 tokens from them, its tokens those
    of the request alone."""
    from spec_jax.engine import Engine
    from spec_jax.prefix_cache import decode_entries_exact
    from spec_jax.request import Request

    assert decode_entries_exact(tiny_target.config)
    engine = Engine(tiny_target, tiny_draft, max_batch=2, gamma=3, max_context=160)
    prompt = [1 + (11 * i) % 60 for i in range(40)]
    first = engine.submit(
        Request(prompt_ids=tuple(prompt), max_tokens=60, seed=1, temperature=temperature, stop_ids=())
    )
    reply = [t for u in engine.drain() if u.handle is first for t in u.token_ids]
    assert len(reply) == 60
    ids = prompt + reply[:59]  # the last token's entry is not written
    prefix = engine._prefiller.prefix
    assert prefix.cached_tokens(ids + [3]) == 96  # 3 blocks: 1 of the prompt, 2 reaching the reply
    full = run(tiny_target, [ids]).cache
    for j, key in enumerate(block_keys(ids)[:3]):
        slot = prefix.index[key]
        for pooled, ref in ((prefix.pool.k, full.k), (prefix.pool.v, full.v)):
            np.testing.assert_array_equal(
                np.asarray(pooled[:, slot]), np.asarray(ref[:, 0, j * BLOCK : (j + 1) * BLOCK])
            )
    later = ids + [5, 9, 2]
    second = engine.submit(
        Request(prompt_ids=tuple(later), max_tokens=6, seed=2, temperature=temperature, stop_ids=())
    )
    tokens = [t for u in engine.drain() if u.handle is second for t in u.token_ids]
    assert second.cached_tokens == 96
    assert tokens == alone(tiny_target, tiny_draft, later, 6, 2, temperature)


@pytest.mark.slow
def test_decoded_entries_have_a_full_prefills_bits_on_the_real_target_at_gguf_q8():
    """What keeping a finished row's reply rests on (decode_entries_exact), on the Qwen 1.5B at the
    server's precision: 40 tokens decoded one at a time after an 11-token prompt leave the cache
    entries that one prefill of the 51 tokens writes, bit for bit."""
    from models.kernels import gguf_matmul
    from models.transformer import forward, init_cache
    from spec_jax.prefix_cache import decode_entries_exact
    from spec_jax.row_prefill import PREFILL_CHUNK, prefill_rows

    target = models.load("qwen2.5-coder-1.5b", dtype="gguf_q8")
    config, params = target.config, target.params
    if not decode_entries_exact(config):
        pytest.skip(f"this CPU keeps no generated entries (multi-row kernels: {gguf_matmul.multirow()})")
    prefill = jax.jit(lambda toks, n, cache: prefill_rows(config, params, toks, n, cache, PREFILL_CHUNK))
    step = jax.jit(lambda toks, pos, cache: forward(config, params, toks, pos, cache))
    prompt = target.tokenizer.encode('def quicksort(items):\n    """Sort a list."""\n')

    def padded(ids):
        return jnp.asarray([ids + [0] * (WIDTH - len(ids))], jnp.int32)

    out = prefill(padded(prompt), jnp.asarray([len(prompt)], jnp.int32), init_cache(config, 1, WIDTH))
    cache, ids = out.cache, list(prompt)
    token = int(jnp.argmax(out.logits[0]))
    for _ in range(40):
        ids.append(token)
        o = step(jnp.asarray([[token]], jnp.int32), jnp.asarray([[len(ids) - 1]], jnp.int32), cache)
        cache, token = o.cache, int(jnp.argmax(o.logits[0, -1]))
    full = prefill(padded(ids), jnp.asarray([len(ids)], jnp.int32), init_cache(config, 1, WIDTH)).cache
    for a, b in ((cache.k, full.k), (cache.v, full.v)):
        np.testing.assert_array_equal(np.asarray(a[:, 0, : len(ids)]), np.asarray(b[:, 0, : len(ids)]))
