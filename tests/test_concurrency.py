"""The compiled-program cache (spec_jax.executables) under threads and over many shapes: two
threads that generate with the same shapes compile each loop once, and the cache keeps only
the most recently used loops up to its bound, and within a budget of memory mappings."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest

import models
import spec_jax
from spec_jax import executables

PROMPTS = [[3, 1, 4], [1, 5]]


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty cache of compiled loops for this test only (the others' loops stay)."""
    monkeypatch.setattr(executables, "_EXECUTABLES", {})


def _traces():
    return {k: executables.TRACE_COUNTS[k] for k in ("spec_prefill", "spec_loop")}


def _delta(before):
    return {k: v - before[k] for k, v in _traces().items()}


def test_two_threads_generating_the_same_shapes_compile_each_loop_once(fresh_cache):
    target = models.random_model(vocab_size=32, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=5)
    kwargs = dict(max_new_tokens=3, temperature=0.0)
    barrier, results, errors = threading.Barrier(2), [None, None], []

    def run(i):
        try:
            barrier.wait(10)  # both ask for the loops before either has compiled them
            results[i] = spec_jax.generate(target, PROMPTS, **kwargs)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    before = _traces()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    two_threads = _delta(before)
    executables.clear_compiled()
    before = _traces()
    alone = spec_jax.generate(target, PROMPTS, **kwargs)
    assert two_threads == _delta(before)  # the traces of one compilation of each loop
    # (which thread compiles which loop is a race: one may compile the prefill, the other the loop)
    assert results[0].tokens == results[1].tokens == alone.tokens


def test_the_compiled_loop_cache_keeps_the_most_recently_used_up_to_its_bound(fresh_cache, monkeypatch):
    def scale(factor, x):
        return x * factor

    def get(n):
        return executables.compiled("scale", scale, 2.0, (jnp.ones(n),))

    def shapes():
        return [key[3][0][0] for key in executables._EXECUTABLES]

    monkeypatch.setattr(executables, "MAX_EXECUTABLES", 2, raising=False)
    # the count alone bounds it here: a worker process that compiled many programs before may
    # hold more mappings than the default budget, which drops loops for its own reason (below)
    monkeypatch.setattr(executables, "map_budget", lambda: 2**62)
    for n in (1, 2, 3):  # three distinct shapes
        get(n)
    assert shapes() == [(2,), (3,)]  # the oldest, (1,), was dropped
    assert get(2)[1] == 0.0  # a hit: (2,) is now the most recently used
    get(4)
    assert shapes() == [(2,), (4,)]  # (3,) went, not (2,)


def test_set_max_executables_bounds_the_cache_at_once(fresh_cache, monkeypatch):
    old = executables.MAX_EXECUTABLES
    monkeypatch.setattr(executables, "MAX_EXECUTABLES", old)  # restored after the test

    def scale(factor, x):
        return x * factor

    for n in (1, 2, 3):
        executables.compiled("scale", scale, 2.0, (jnp.ones(n),))
    assert executables.set_max_executables(1) == old
    assert executables.MAX_EXECUTABLES == 1 and len(executables._EXECUTABLES) == 1
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        executables.set_max_executables(0)


def _scale(factor, x):
    return x * factor


def _scale_shapes():
    return [key[3][0][0] for key in executables._EXECUTABLES]


def test_the_compiled_loop_cache_drops_its_oldest_loops_while_the_process_holds_more_mappings_than_its_budget(
    fresh_cache, monkeypatch
):
    executables.compiled("scale", _scale, 2.0, (np.ones(1, np.float32),))
    budget = executables.mapping_count()  # the mappings with (1,) compiled: (2,) passes it
    monkeypatch.setattr(executables, "map_budget", lambda: budget)
    executables.compiled("scale", _scale, 2.0, (np.ones(2, np.float32),))
    assert _scale_shapes() == [(2,)]  # far below MAX_EXECUTABLES, (1,) was dropped for the mappings


def test_a_dropped_loop_releases_its_memory_mappings_and_the_default_budget_is_half_the_kernels_limit(
    fresh_cache, monkeypatch
):
    """The budget can only bound the mappings if dropping a loop frees them: on XLA:CPU a loop
    holds about 280 (each kernel JIT-compiled into its own sections), and past vm.max_map_count
    XLA's compiler segfaults (spec_jax.executables.map_budget)."""
    with open("/proc/sys/vm/max_map_count") as f:
        assert executables.map_budget() == int(f.read()) // 2
    monkeypatch.setattr(executables, "MAX_EXECUTABLES", 8)
    monkeypatch.setattr(executables, "map_budget", lambda: 2**62)  # the count alone drops loops here
    # NumPy arguments: jnp.ones(n) would compile and keep a program of its own for each n
    before = executables.mapping_count()
    for n in range(1, 9):
        executables.compiled("scale", _scale, 2.0, (np.ones(n, np.float32),))
    grown = executables.mapping_count() - before
    assert grown >= 8  # each kept program holds mappings of its own
    executables.set_max_executables(1)
    assert executables.mapping_count() - before <= grown / 4  # seven dropped: their mappings went
