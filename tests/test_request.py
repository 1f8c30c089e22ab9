"""The one request type (spec_jax.request): its defaults are the command line's, each field's
range is checked in one place, and an error names the field."""

import dataclasses

import pytest

from launch import generate as cli
from spec_jax import api
from spec_jax.bounds import MAX_TREE_NODES, speculation_bound
from spec_jax.drafting import AUTO_GAMMA_MAX, AUTO_TREE_MAX
from spec_jax.request import MAX_STOP_IDS, Request, RequestError


def test_the_defaults_are_the_command_lines():
    r = Request(prompt="x")
    flags = cli.FLAGS
    assert r.temperature == flags["temperature"].default == 0.0
    assert r.max_tokens == flags["max_new_tokens"].default
    assert (r.top_k, r.top_p, r.seed) == (
        flags["top_k"].default,
        flags["top_p"].default,
        flags["seed"].default,
    )
    assert r.stop_ids is None and flags["stop_ids"].default == "auto"  # the model's stop tokens
    assert r.speculate and r.sampling.greedy
    options = api.Options()
    assert (options.temperature, options.max_new_tokens, options.gamma, options.eos_id) == (
        0.0,
        64,
        "auto",
        "auto",
    )


@pytest.mark.parametrize(
    "fields, field, message",
    [
        (dict(), "prompt", "exactly one of prompt, messages, prompt_ids"),
        (dict(prompt="a", prompt_ids=(1,)), "prompt", "exactly one"),
        (dict(prompt=""), "prompt", "non-empty string"),
        (dict(prompt_ids=()), "prompt_ids", "non-empty list of token ids"),
        (dict(prompt_ids=(1, -2)), "prompt_ids", "integers >= 0"),
        (dict(messages=({"role": "user"},)), "messages", "messages"),
        (dict(prompt="a", max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1, got 0"),
        (dict(prompt="a", max_tokens=-1), "max_tokens", ">= 1"),
        (dict(prompt="a", max_tokens="8"), "max_tokens", ">= 1"),
        (dict(prompt="a", temperature=-0.5), "temperature", "temperature must be a finite number >= 0"),
        (dict(prompt="a", temperature=float("nan")), "temperature", "temperature must be a number"),
        (dict(prompt="a", temperature="hot"), "temperature", "temperature must be a number"),
        (dict(prompt="a", top_k=-1), "top_k", "top_k must be an integer >= 0"),
        (dict(prompt="a", top_p=0.0), "top_p", r"top_p must be in \(0, 1\]"),
        (dict(prompt="a", seed=2**63), "seed", "seed must be an integer"),
        (dict(prompt="a", stop=("",)), "stop", "non-empty strings"),
        (dict(prompt="a", stop_ids=tuple(range(MAX_STOP_IDS + 1))), "stop_ids", f"at most {MAX_STOP_IDS}"),
        (dict(prompt="a", speculate="no"), "speculate", "true or false"),
        (dict(prompt="a", max_drafts=-1), "max_drafts", r"\[0, 2147483647\]"),
        (dict(prompt="a", max_drafts=1.5), "max_drafts", "integer"),
    ],
)
def test_each_field_out_of_range_is_named(fields, field, message):
    with pytest.raises(RequestError, match=message) as e:
        Request(**fields).validate()
    assert e.value.field == field and str(e.value) == e.value.message


def test_from_dict_builds_a_validated_request_and_names_unknown_fields():
    r = Request.from_dict({"prompt": "a", "stop": "\n", "stop_ids": [3, 4], "max_tokens": 5})
    assert r == Request(prompt="a", stop=("\n",), stop_ids=(3, 4), max_tokens=5)
    with pytest.raises(RequestError, match="unknown field 'temprature'") as e:
        Request.from_dict({"prompt": "a", "temprature": 1.0})
    assert e.value.field == "temprature"
    with pytest.raises(RequestError) as e:
        Request.from_dict({"prompt": "a", "max_tokens": -1})
    assert e.value.field == "max_tokens"


def test_a_request_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Request(prompt="a").max_tokens = 3


def test_the_gamma_and_tree_rule():
    assert speculation_bound(3, 0) == (3, 3, "gamma")
    assert speculation_bound("auto", 0)[0] == AUTO_GAMMA_MAX
    assert speculation_bound(3, 5) == (5, 5, "tree")
    assert speculation_bound(3, "auto")[0] == AUTO_TREE_MAX
    for bad in (0, -1, "x", 2.5, True):
        with pytest.raises(RequestError, match="gamma must be an integer >= 1 or 'auto'"):
            speculation_bound(bad, 0)
    for bad in (MAX_TREE_NODES + 1, -1, "many", 2.5):
        with pytest.raises(RequestError, match=r"tree must be 0 \(chains\), a node count in \[1, 31\]"):
            speculation_bound(3, bad)
    with pytest.raises(RequestError, match="--gamma must be"):
        speculation_bound("bad", 0, gamma_name="--gamma")
