"""The speculative loop with its metrics kept per prompt, for confidence intervals over prompts.

`spec_jax.generate` sums the metrics over the batch. Here each prompt runs as its own batch of
one, and jax.vmap runs all of them in one compiled call: the same spec_prefill / spec_loop /
SpecMetrics code as the sampler, with a leading prompt axis on everything, so row b's metrics
are those of prompt b decoded on its own, with the key generate gives row b (its tokens are
generate's, up to float reassociation in the batched matmuls). The rows share every matmul,
as a batch does.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import bounds, plan
from spec_jax.decode import PrefillInputs, layout, pad_prompts
from spec_jax.drafting import as_drafter
from spec_jax.executables import compiled
from spec_jax.sampling import SamplingParams, row_keys
from spec_jax.speculative import SpecStatic, spec_loop, spec_prefill


def _rows(static: SpecStatic, target_params, draft_params, inputs: PrefillInputs):
    """inputs with a leading prompt axis R (tokens [R, 1, P]); returns (tokens [R, 1, N],
    num_generated [R, 1], metrics with a leading axis R)."""

    def one(row_inputs):
        state = spec_prefill(static, target_params, draft_params, row_inputs)
        state = spec_loop(static, target_params, draft_params, state, row_inputs.stop_ids)
        return state.out.tokens, state.out.num_generated, state.metrics

    axes = PrefillInputs(tokens=0, prompt_lens=0, stop_ids=None, keys=0, sampling=0)
    return jax.vmap(one, in_axes=(axes,))(inputs)


def run(
    target,
    draft,
    prompts,
    *,
    gamma: int,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    tree: int = 0,
):
    """Speculative decoding of each prompt (no stop tokens: every row makes max_new_tokens).

    draft: anything spec_jax.generate accepts (a models.Model or a (drafter, params) pair).
    tree: 0 (chains of gamma drafts) or N (tree rounds of N nodes: generate's `tree`).
    Returns (new tokens per prompt, metrics dict per prompt in the spec_jax.metrics schema,
    {"compile_seconds", "run_seconds"}).
    """
    sampling = SamplingParams(float(temperature))
    drafter, draft_params = as_drafter(draft, target)
    bounds.validate(target, prompts, drafter, gamma, max_new_tokens, None, tree)
    gamma = plan.GammaPolicy.of(gamma, drafter, tree).gamma  # a tree's: its node count
    width, cache_len = layout(target.config, prompts, max_new_tokens, gamma)
    static = SpecStatic(target.config, drafter, gamma, max_new_tokens, cache_len, tree_nodes=tree)
    tokens, lens = pad_prompts(prompts, width)
    inputs = PrefillInputs(
        tokens=jnp.asarray(tokens)[:, None],
        prompt_lens=jnp.asarray(lens)[:, None],
        stop_ids=jnp.asarray([-1], jnp.int32),
        keys=row_keys(jax.random.key(seed), np.arange(len(prompts)))[:, None],
        sampling=jax.tree.map(lambda x: x[:, None], sampling.for_rows(len(prompts))),
    )
    args = (target.params, draft_params, inputs)
    fn, compile_s = compiled("spec_rows", _rows, static, args)
    start = time.perf_counter()
    out, counts, metrics = jax.block_until_ready(fn(*args))
    run_s = time.perf_counter() - start
    out, counts = np.asarray(out[:, 0]), np.asarray(counts[:, 0])
    new_tokens = [out[b, : counts[b]].tolist() for b in range(len(prompts))]
    sources = drafter.sources
    per_row = [jax.tree.map(lambda x, b=b: x[b], metrics).to_dict(sources) for b in range(len(prompts))]
    return new_tokens, per_row, {"compile_seconds": compile_s, "run_seconds": run_s}
