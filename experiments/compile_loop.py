"""The speculative decoding program itself, compiled for real TPUs and GPUs on a CPU-only host.

models/kernels/compile_targets.py compiles attention calls and single model steps for
compile-only devices (libtpu, XLA's CUDA plugin). This module does the same for the two programs
`spec_jax.generate` runs: `spec_prefill` (both models read the padded prompts) and `spec_loop`
(the while_loop of draft -> verify -> commit rounds), for a target / draft pair of registered
model configs, with abstract parameters (`models.weights.param_shapes`) placed on the device:
no weights are needed. It lives in experiments/ (the benchmarks and scripts/compile_sweep.py use
it; the inference library does not), not beside the kernels' checks, because `models` imports
nothing from `spec_jax`.

DEMO is what `make demo` runs (launch.generate's defaults): the Qwen2.5-Coder pair, gamma 4, 64
new tokens, greedy, the default prompt "def fibonacci(n):\\n    " (5 Qwen tokens, so the 16-token
bucket of spec_jax.decode.layout and a cache of 16 + 64 + 4 slots), and the Qwen tokenizer's two
end-of-generation ids as stop ids. The dtype is left to the case (the demo's default is int8 for
both models, with --gamma=auto: auto runs this same program at the gammas it tries, with a limit
on the rounds of each chunk).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.cache import KVCache
from models.kernels import compile_targets as ct
from models.weights import param_shapes
from spec_jax.decode import PrefillInputs, layout
from spec_jax.drafting.model import ModelDrafter
from spec_jax.prefix_cache import BLOCK
from spec_jax.sampling import RowSampling, row_keys
from spec_jax.speculative import SpecStatic, spec_loop, spec_prefill

PHASES = ("prefill", "loop", "prefix_prefill")  # prefix_prefill: the engine's, reading the prefix cache


@dataclasses.dataclass(frozen=True)
class Demo:
    """The settings of `make demo` that shape its compiled programs (see the module docstring)."""

    model: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    gamma: int = 4
    max_new_tokens: int = 64
    prompt_tokens: int = 5  # launch.generate.DEFAULT_PROMPT in the Qwen tokenizer
    num_stop_ids: int = 2  # the Qwen tokenizer's stop_ids: <|endoftext|>, <|im_end|>
    temperature: float = 0.0


DEMO = Demo()


@dataclasses.dataclass(frozen=True)
class LoopCase:
    """One compile of the speculative decoding program: spec_prefill or spec_loop of a pair.

    phase: "prefill", "loop", or "prefix_prefill" (the engine's prefill reading each row's cached
    prefix from the prefix cache's pool: spec_jax.prefix_cache). num_layers: None for the models' own depths (28 and 24 for the Qwen
    pair), or both models cut to that many layers (the same program with a shorter layer scan).
    impl: "forced" (the target's Pallas impl) or "auto" (what the dispatcher picks there).
    The other fields default to DEMO's values.
    """

    phase: str
    batch: int
    dtype: str
    num_layers: int | None = None
    model: str = DEMO.model
    draft: str = DEMO.draft
    gamma: int = DEMO.gamma
    max_new_tokens: int = DEMO.max_new_tokens
    prompt_tokens: int = DEMO.prompt_tokens
    num_stop_ids: int = DEMO.num_stop_ids
    temperature: float = DEMO.temperature
    impl: str = "forced"

    kind = "loop"  # the sweep's column (not a field)

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        for name in (self.model, self.draft):
            if name not in ct.MODELS:
                raise ValueError(f"model and draft must be in {tuple(ct.MODELS)}, got {name!r}")
        if self.impl not in ct.IMPL_CHOICES:
            raise ValueError(f"impl must be one of {ct.IMPL_CHOICES}, got {self.impl!r}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be None or >= 1, got {self.num_layers}")

    @property
    def step(self) -> str:
        return f"spec_{self.phase}"

    def configs(self, impl: str):
        """(target config, draft config) with this case's dtype, depth and attention impl."""

        def config(name):
            cfg = dataclasses.replace(ct.MODELS[name], dtype=self.dtype, attention_impl=impl)
            return cfg if self.num_layers is None else dataclasses.replace(cfg, num_layers=self.num_layers)

        return config(self.model), config(self.draft)

    def label(self) -> str:
        layers = "" if self.num_layers is None else f" L={self.num_layers}"
        impl = "" if self.impl == "forced" else " auto"
        return (
            f"loop {self.model}+{self.draft} {self.step} B={self.batch} gamma={self.gamma} "
            f"new={self.max_new_tokens} P={self.prompt_tokens}{layers} {self.dtype}{impl}"
        )


def abstract_inputs(batch: int, width: int, num_stop_ids: int) -> PrefillInputs:
    """The prefill inputs of `batch` prompts padded to `width` as shapes (no arrays): what the
    loop is compiled for without data (here and experiments/pod_pairs.py)."""
    ints = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    return PrefillInputs(
        tokens=ints((batch, width)),
        prompt_lens=ints((batch,)),
        stop_ids=ints((num_stop_ids,)),
        keys=jax.eval_shape(lambda: row_keys(jax.random.key(0), np.arange(batch))),
        sampling=jax.eval_shape(lambda: RowSampling.greedy_rows(batch)),  # each row's warp: operands
    )


def loop_program(case: LoopCase, target_name: str):
    """(function, abstract arguments, impl, donate_argnums) of one LoopCase, built as
    spec_jax.api.run builds them (the loop's state donated)."""
    impl = "auto" if case.impl == "auto" else ct.pallas_impl(target_name)
    target_cfg, draft_cfg = case.configs(impl)
    b = case.batch
    width, cache_len = layout(target_cfg, [[0] * case.prompt_tokens] * b, case.max_new_tokens, case.gamma)
    static = SpecStatic(
        target_cfg,
        ModelDrafter(draft_cfg),
        case.gamma,
        case.max_new_tokens,
        cache_len,
    )
    inputs = abstract_inputs(b, width, case.num_stop_ids)
    params, draft_params = param_shapes(target_cfg), param_shapes(draft_cfg)
    prefill = functools.partial(spec_prefill, static)
    if case.phase == "prefill":
        return prefill, (params, draft_params, inputs), impl, ()
    if case.phase == "prefix_prefill":  # a pool of 64 blocks; each row's block table
        shape = (target_cfg.num_layers, 64, BLOCK, target_cfg.num_kv_heads, target_cfg.head_dim)
        pool = KVCache(*(jax.ShapeDtypeStruct(shape, target_cfg.jnp_dtype),) * 2)
        inputs = inputs.replace(prefix_blocks=jax.ShapeDtypeStruct((b, width // BLOCK), jnp.int32))
        return prefill, (params, draft_params, inputs, pool), impl, ()
    state = jax.eval_shape(prefill, params, draft_params, inputs)
    return functools.partial(spec_loop, static), (params, draft_params, state, inputs.stop_ids), impl, (2,)


def compile_loop_case(case: LoopCase, target_name: str) -> ct.Result:
    """Traces, lowers and compiles `case` for the target; errors become a Result that says which."""
    fn, args, impl, donate = loop_program(case, target_name)
    return ct.compile_program(fn, args, impl, target_name, donate)


def compile_any(case, target_name: str) -> ct.Result:
    """compile_case for a models.kernels.compile_targets.Case, compile_loop_case for a LoopCase."""
    if isinstance(case, LoopCase):
        return compile_loop_case(case, target_name)
    return ct.compile_case(case, target_name)
