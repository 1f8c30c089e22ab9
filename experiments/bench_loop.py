"""Benchmark: the whole decode as one compiled lax.while_loop against a Python loop of the same
jitted round (a host check per token, as a Python loop does), per generated token.

Plain autoregressive decoding (the loop with gamma = 0), greedy, on synthetic prompts; the
prefill alone is timed too and subtracted. Medians over interleaved repeats after a warm-up.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections

from experiments import common, framework
from spec_jax import timing
from spec_jax.decode import PrefillInputs, layout, pad_prompts
from spec_jax.drafting import NoDrafter
from spec_jax.sampling import row_keys
from spec_jax.speculative import SpecStatic, spec_loop, spec_prefill, spec_round

TITLE = "Benchmark loop: the compiled while_loop against a Python loop of the jitted round"


MODEL_KEYS = ("model",)
DTYPE_KEYS = ("dtype",)
INT_RANGES = {"batch_size": (1, 64), "max_new_tokens": (2, 4096), "repeats": (1, 1000)}


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
    """One random model (a tiny one when quick), batch 1, greedy."""
    config = ml_collections.ConfigDict()
    config.model = "tiny" if quick else "random"
    config.dtype = "float32"  # models.precision.PRECISIONS
    config.batch_size = 1
    config.max_new_tokens = 8 if quick else 128
    config.repeats = 2 if quick else 5
    return config


def synthetic_prompts(batch_size: int) -> list[list[int]]:
    """Ragged prompts of 8, 11, 14, ... token ids in [1, 50]."""
    return [[1 + (7 * i + j) % 50 for j in range(8 + 3 * i)] for i in range(batch_size)]


def plain_loop_setup(model, prompts, max_new_tokens: int):
    """(static, inputs) of plain autoregressive decoding of these prompts, greedy, no stop token."""
    width, cache_len = layout(model.config, prompts, max_new_tokens, 0)
    static = SpecStatic(model.config, NoDrafter(model.config.vocab_size), 0, max_new_tokens, cache_len)
    tokens, lens = pad_prompts(prompts, width)
    inputs = PrefillInputs(
        jnp.asarray(tokens),
        jnp.asarray(lens),
        jnp.asarray([-1], jnp.int32),
        row_keys(jax.random.key(0), jnp.arange(len(prompts))),
    )
    return static, inputs


def run(config) -> framework.Result:
    model = common.load_model(config.model, config.dtype)
    n = config.max_new_tokens
    static, inputs = plain_loop_setup(model, synthetic_prompts(config.batch_size), n)
    prefill = jax.jit(functools.partial(spec_prefill, static))
    loop = jax.jit(functools.partial(spec_loop, static), donate_argnums=2)
    step = jax.jit(functools.partial(spec_round, static), donate_argnums=2)

    def compiled_loop():
        return loop(model.params, (), prefill(model.params, (), inputs), inputs.stop_ids)

    def python_loop():
        state = prefill(model.params, (), inputs)
        while not bool(jnp.all(state.out.done)):  # a host check per token, as a Python loop does
            state = step(model.params, (), state, inputs.stop_ids)
        return state

    variants = {
        "compiled lax.while_loop": compiled_loop,
        "python loop of jitted step": python_loop,
        "prefill alone": lambda: prefill(model.params, (), inputs),
    }
    results = timing.timed_interleaved(variants, config.repeats)
    prefill_only = results.pop("prefill alone")
    rows = []
    for name, t in results.items():
        per_token = (t["median"] - prefill_only["median"]) / (n - 1)  # prefill draws the first token
        rows.append(
            {
                "variant": name,
                "ms_per_token": 1e3 * per_token,
                "total_ms_median": 1e3 * t["median"],
                "total_ms_min": 1e3 * t["min"],
                "total_ms_max": 1e3 * t["max"],
                "tokens": n,
                "prefill_ms_median": 1e3 * prefill_only["median"],
            }
        )
    return framework.Result.from_dicts(rows)
