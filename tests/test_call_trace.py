"""scripts/call_trace.py (issue 54's measure): its counting on a synthetic call chain whose stops,
files and returns are known, the counts a broken tracer would give instead, and one traced
spec_jax.generate call on the tiny target (plain decoding: the least to compile)."""

import asyncio
import importlib
import sys
import textwrap

import pytest

from scripts import call_trace
from scripts.call_trace import Stop, Tracer, summarize

# Two packages of the synthetic project: `alpha` and `beta`. The tracked object goes
# alpha.one.start -> beta.two.middle (in *args) -> alpha.one.finish -> alpha.one.gen (a generator
# resumed three times: one stop) -> beta.two.last (in **kwargs); helper and skip never take it.
ONE = """
    from beta import two

    def start(obj, n):
        helper(n)
        two.middle(None, obj)
        return finish(obj)

    def helper(n):
        return n + 1

    def finish(obj):
        list(gen(obj))
        two.skip(3)
        return two.last(other=obj)

    def gen(obj):
        yield 1
        yield 2
"""
TWO = """
    def middle(x, *rest):
        return len(rest)

    def skip(n):
        return n

    def last(**kw):
        return {"derived": kw["other"]}

    async def waits(obj):
        await __import__("asyncio").sleep(0)
        await __import__("asyncio").sleep(0)
        return [obj]

    def derive(obj):
        return (obj, object())

    def uses(derived):
        return derived
"""
EXPECTED = [
    ("alpha/one.py", "start"),
    ("beta/two.py", "middle"),
    ("alpha/one.py", "finish"),
    ("alpha/one.py", "gen"),
    ("beta/two.py", "last"),
]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """(root, the alpha.one module, the beta.two module) of the synthetic project."""
    for package, name, source in (("alpha", "one", ONE), ("beta", "two", TWO)):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("alpha", "alpha.one", "beta", "beta.two"):
        sys.modules.pop(name, None)
    return tmp_path, importlib.import_module("alpha.one"), importlib.import_module("beta.two")


def test_stops_are_the_calls_that_take_the_object_and_returns_the_files_reentered(project):
    root, one, _ = project
    obj = object()
    tracer = Tracer(root, packages=("alpha", "beta"), tracked=[obj])
    tracer.run(one.start, obj, 1)
    assert [(s.file, s.function) for s in tracer.stops] == EXPECTED
    # alpha, beta, alpha (a return), alpha (the same file: no return), beta (a return)
    assert summarize(tracer.stops) == call_trace.Summary(stops=5, files=2, returns=2)


def test_a_tracer_counting_calls_that_do_not_take_the_object_would_count_differently(project, monkeypatch):
    root, one, _ = project
    obj = object()
    monkeypatch.setattr(call_trace, "argument_values", lambda frame: [obj])  # every call "takes" it
    broken = Tracer(root, packages=("alpha", "beta"), tracked=[obj])
    broken.run(one.start, obj, 1)
    names = [s.function for s in broken.stops]
    assert "helper" in names and "skip" in names
    assert summarize(broken.stops) != call_trace.Summary(stops=5, files=2, returns=2)


def test_returns_count_reentries_only_not_consecutive_stops_in_one_file():
    def stops(*files):
        return [Stop(f, "f") for f in files]

    assert summarize(stops("a", "a", "a")).returns == 0
    assert summarize(stops("a", "b", "a", "b", "c", "a")) == call_trace.Summary(6, 3, 3)
    # a count of every stop into a seen file (consecutive ones too) would say 5 here, not 3
    assert summarize(stops("a", "a", "b", "b", "a", "a")) == call_trace.Summary(6, 2, 1)


def test_a_coroutine_resumed_after_each_await_is_one_stop_and_its_return_value_is_followed(project):
    root, _, two = project
    obj = object()
    tracer = Tracer(root, packages=("alpha", "beta"), tracked=[obj], follow_returns=True)

    async def main():
        listed = await two.waits(obj)
        two.uses(listed)  # the list the coroutine returned (not what it yielded at each await)

    tracer.run(asyncio.run, main())
    assert [s.function for s in tracer.stops] == ["waits", "uses"]


def test_following_returns_tracks_what_a_stop_returns_and_the_items_of_a_tuple(project):
    root, _, two = project
    obj = object()

    def chain():
        pair = two.derive(obj)
        two.uses(pair[1])  # an item of the returned tuple: tracked when following returns
        two.skip(4)

    plain = Tracer(root, packages=("alpha", "beta"), tracked=[obj])
    plain.run(chain)
    following = Tracer(root, packages=("alpha", "beta"), tracked=[obj], follow_returns=True)
    following.run(chain)
    assert [s.function for s in plain.stops] == ["derive"]
    assert [s.function for s in following.stops] == ["derive", "uses"]


def test_start_arms_the_tracer_with_that_calls_arguments_and_until_ends_it(project):
    root, one, _ = project
    obj = object()
    tracer = Tracer(
        root,
        packages=("alpha", "beta"),
        start=lambda frame: frame.f_code.co_name == "finish",
        until=call_trace.calls_to("last"),
    )
    tracer.run(one.start, obj, 1)  # nothing is tracked before finish: start and middle are not stops
    assert [s.function for s in tracer.stops] == ["finish", "gen"]
    assert tracer.ended


def test_target_through_generate_on_the_tiny_target(tiny_target):
    stops = call_trace.trace_generate(tiny_target, None, gamma=1, max_new_tokens=2)  # plain: compiles least
    assert stops[0].file.startswith("spec_jax/") and stops[0].function == "generate"
    assert all(s.file.split("/")[0] in call_trace.PACKAGES for s in stops)
    summary = summarize(stops)
    assert 1 < summary.files <= summary.stops and summary.returns < summary.stops
    assert call_trace.table({"generate": stops}, verbose=True).count("spec_jax/") >= len(stops)
