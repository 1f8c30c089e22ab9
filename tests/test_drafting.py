"""The drafter interface (spec_jax.drafting.base.Drafter): a new drafter is a subclass and
nothing else. The toy drafter below lives in this file alone and runs through generate (greedy
output equals plain decoding), gamma=auto's cost measurement and an 8-device mesh; and the loop,
the API, sharding and gamma=auto ask no drafter what class it is."""

import ast
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import spec_jax
from spec_jax import drafting
from spec_jax.autogamma import cost_cache as step_costs

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16]]


@dataclasses.dataclass(frozen=True)
class TableDrafter(drafting.Drafter):
    """Drafts by a next-token table (params: int32 [V]): d_0 = table[last], d_i = table[d_{i-1}],
    with one-hot q; no state. Everything else is the base's default."""

    vocab_size: int

    def propose(self, params, state, context_b2, length_b, gamma, sampling, keys_b):
        tokens = [params[context_b2[:, 1]]]
        for _ in range(gamma - 1):
            tokens.append(params[tokens[-1]])
        tokens = jnp.stack(tokens, axis=1)  # [B, G]
        return drafting.Proposal(tokens, jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32), state)

    def cost_key(self, params):
        return {"table": int(params.shape[0])}


def tiny_target():
    return models.random_model(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=4, seed=0)


def toy_draft(target):
    """The toy drafter with the target's own greedy successor of each token as its table, so
    that many drafts are accepted (and a few are not)."""
    vocab = target.config.vocab_size
    table = np.asarray((np.arange(vocab) * 7 + 3) % vocab, np.int32)
    return TableDrafter(vocab), jnp.asarray(table)


def test_a_drafter_defined_in_a_test_file_decodes_greedily_as_plain_decoding():
    target = tiny_target()
    kw = dict(max_new_tokens=12, temperature=0.0)
    plain = spec_jax.generate(target, PROMPTS, **kw)
    spec = spec_jax.generate(target, PROMPTS, draft=toy_draft(target), gamma=3, **kw)
    assert spec.tokens == plain.tokens
    assert spec.stats["num_draft_tokens"] > 0
    assert list(spec.stats["fraction_of_rounds_by_drafter"]) == ["TableDrafter"]  # the default source


def test_gamma_auto_measures_and_keys_a_new_drafters_costs_by_its_hooks(tmp_path):
    target = tiny_target()
    drafter, params = toy_draft(target)
    sizes = step_costs.CostSizes(batch=1, cache_slots=32, gamma_max=2)
    costs = step_costs.costs_for(target, drafter, params, sizes, cache_dir=tmp_path)
    assert costs.draft1 == costs.draft2 == costs.resume == 0.0  # no timed_call: free
    assert len(costs.verify) == 3 and costs.step_seconds > 0
    (saved,) = (tmp_path / "costs").glob("*.json")
    assert json.loads(saved.read_text())["key"]["draft"] == {"table": 64}


MESH_RUN = """
import json, sys
sys.path.insert(0, "tests")
import spec_jax
from spec_jax import sharding
from test_drafting import PROMPTS, tiny_target, toy_draft
target = tiny_target()
kw = dict(gamma=3, max_new_tokens=10, temperature=0.0)
plain = spec_jax.generate(target, PROMPTS, max_new_tokens=10, temperature=0.0)
mesh = sharding.make_mesh("data:2,model:4")
spec = spec_jax.generate(target, PROMPTS, draft=toy_draft(target), mesh=mesh, **kw)
print(json.dumps({"devices": len(mesh.devices.flat), "plain": plain.tokens, "spec": spec.tokens,
                  "drafted": spec.stats["num_draft_tokens"]}))
"""


def test_a_drafter_defined_in_a_test_file_runs_on_an_8_device_mesh():
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
    }
    out = subprocess.run(
        [sys.executable, "-c", MESH_RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8 and result["drafted"] > 0
    assert result["spec"] == result["plain"]


CALLERS = (
    "spec_jax/speculative.py",
    "spec_jax/api.py",
    "spec_jax/runner.py",
    "spec_jax/sharding.py",
    "spec_jax/autogamma/controller.py",
    "spec_jax/autogamma/trees.py",
    "spec_jax/autogamma/costs.py",
    "spec_jax/autogamma/cost_cache.py",
    "spec_jax/autogamma/chunking.py",
)


@pytest.mark.parametrize("path", CALLERS)
def test_the_loop_api_sharding_and_autogamma_ask_no_drafter_its_class(path):
    """No isinstance / getattr / hasattr on anything draft-related (drafter, draft, draft_params):
    what they need to know is a Drafter hook."""
    source = (ROOT / path).read_text()
    offenders = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "isinstance",
            "getattr",
            "hasattr",
        ):
            text = ast.get_source_segment(source, node)
            if "draft" in text.lower():
                offenders.append(f"line {node.lineno}: {text}")
    assert not offenders, f"{path} probes drafters: {offenders}"


CAPABILITIES = ("TreeDrafting", "TargetFeatures", "Resumption", "MeshPlacement", "CostMeasurement")
# What every round of the loop needs, declared on Drafter itself (vocab_size is annotated only).
ROUND_MEMBERS = {"max_seq_len", "prefill_calls", "variable_length", "stop_rejection", "sources", "init"}
ROUND_MEMBERS |= {"auto_widths"}
ROUND_MEMBERS |= {"propose", "served"}


def test_the_drafter_base_holds_what_every_round_needs_and_composes_documented_capabilities():
    """A drafter author sees what is optional: each capability is a class with a docstring that
    says who calls it and what its default does, and each of its hooks has a default and says it."""
    assert [c.__name__ for c in drafting.Drafter.__bases__] == [*CAPABILITIES, "ABC"]
    own = {name for name in vars(drafting.Drafter) if not name.startswith("_")}
    assert own == ROUND_MEMBERS
    declared = set()
    for cls in drafting.Drafter.__bases__[:-1]:
        assert "Default" in cls.__doc__ and "Optional" in cls.__doc__, cls.__name__
        hooks = {name: m for name, m in vars(cls).items() if not name.startswith("_")}
        assert hooks and not declared & set(hooks)  # each hook on one capability
        declared |= set(hooks)
        for name, member in hooks.items():
            assert not callable(member) or "Default" in member.__doc__, f"{cls.__name__}.{name}"
    assert drafting.Drafter.__abstractmethods__ == {"propose"}  # the one hook without a default
