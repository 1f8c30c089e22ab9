"""Sharded vs unsharded generation on 8 CPU devices, and the collectives of the sharded target forward.

  .venv/bin/python scripts/sharding_report.py [--devices=8] [--max_new_tokens=32]

Prints, for a mid-size random target/draft pair: tokens/s unsharded and on each mesh (the
second of two identical calls, so compilation is excluded), whether the tokens match, and
the all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute counts in the
compiled HLO of one target verification call (T = gamma + 1) with the per-layer parameter
layout (every layer's ops appear in the text; a scanned stack shows its body once). The
Megatron pattern is 2 all-reduces per layer (after wo and after w_down).
"""

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import models  # noqa: E402
import spec_jax  # noqa: E402
from models.transformer import forward, init_cache, param_shapes  # noqa: E402
from spec_jax import sharding  # noqa: E402

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo: str) -> dict[str, int]:
    # Async pairs (-start/-done) count once, by their -start.
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def forward_collectives(config, mesh, batch, gamma):
    params = param_shapes(config)
    cache = jax.eval_shape(lambda: init_cache(config, batch, 256))
    tokens = jax.ShapeDtypeStruct((batch, gamma + 1), jnp.int32)
    in_shardings = (
        sharding.param_shardings(params, mesh),
        sharding.batch_sharding(mesh, 2),
        sharding.batch_sharding(mesh, 2),
        sharding.state_shardings(cache, mesh, batch),
    )
    fn = jax.jit(lambda p, t, pos, c: forward(config, p, t, pos, c), in_shardings=in_shardings)
    return count_collectives(fn.lower(params, tokens, tokens, cache).compile().as_text())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    # Read when jax first starts its backend (the line below), not when it is imported.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices")
    shapes = {
        "divisible (16 q / 8 kv heads)": dict(num_heads=16, num_kv_heads=8),
        "qwen-like (12 q / 2 kv heads)": dict(num_heads=12, num_kv_heads=2),
    }
    for label, heads in shapes.items():
        d_model = 768 if heads["num_heads"] == 12 else 1024
        kw = dict(vocab_size=8192, num_layers=4, d_model=d_model, mlp_dim=4 * d_model, scan_layers=False)
        target = models.random_model(**kw, **heads, seed=0)
        draft = models.random_model(
            vocab_size=8192, num_layers=1, d_model=256, num_heads=4, num_kv_heads=2, seed=1, scan_layers=False
        )
        c = target.config
        print(
            f"\n== target {label}: {c.num_layers} layers, d_model {c.d_model}, mlp {c.mlp_dim}, vocab {c.vocab_size}"
        )
        prompts = [[(7 * i + j) % 200 + 1 for j in range(12 + i)] for i in range(args.batch)]
        run = dict(draft=draft, gamma=args.gamma, max_new_tokens=args.max_new_tokens, temperature=0.0)
        spec_jax.generate(target, prompts, **run)
        ref = spec_jax.generate(target, prompts, **run)
        print(f"unsharded        : {ref.stats['tokens_per_second']:8.1f} tokens/s")
        for mesh_spec in ("data:1,model:8", "data:2,model:4", "data:8,model:1"):
            mesh = sharding.make_mesh(mesh_spec)
            placed_target, placed_draft = sharding.place(target, mesh), sharding.place(draft, mesh)
            run_m = dict(run, draft=placed_draft, mesh=mesh)
            spec_jax.generate(placed_target, prompts, **run_m)
            gen = spec_jax.generate(placed_target, prompts, **run_m)
            collectives = forward_collectives(c, mesh, args.batch, args.gamma)
            print(
                f"{mesh_spec:17s}: {gen.stats['tokens_per_second']:8.1f} tokens/s, tokens identical "
                f"{gen.tokens == ref.tokens}; target verify forward: {collectives} "
                f"(Megatron: {2 * c.num_layers} all-reduces for {c.num_layers} layers)"
            )


if __name__ == "__main__":
    main()
