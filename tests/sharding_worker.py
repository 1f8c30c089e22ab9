"""Subprocess side of tests/test_sharding.py: jax must see 8 (or 4) host devices, so it runs here.

python tests/sharding_worker.py equivalence qwen|divisible OUT.json
    8 CPU devices in one process: unsharded vs sharded generation, plus sharding facts.
python tests/sharding_worker.py multihost PROCESS_ID NUM_PROCESSES PORT OUT.json
    4 CPU devices per process under jax.distributed; sharded generation on data:2,model:4.
"""

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 10


def models_for(pair: str):
    import models

    if pair == "qwen":  # the Qwen2.5 head counts: target 12 q / 2 kv heads, draft 14 q / 2 kv heads
        target = models.random_model(
            vocab_size=128, num_layers=2, d_model=96, num_heads=12, num_kv_heads=2, seed=0
        )
        draft = models.random_model(
            vocab_size=128, num_layers=1, d_model=112, num_heads=14, num_kv_heads=2, seed=1
        )
    else:  # every head count divisible by 4 and 8; the target in the per-layer (layers_i) layout
        target = models.random_model(
            vocab_size=128, num_layers=2, d_model=128, num_heads=16, num_kv_heads=8, seed=2, scan_layers=False
        )
        draft = models.random_model(
            vocab_size=128, num_layers=1, d_model=64, num_heads=8, num_kv_heads=8, seed=3
        )
    return target, draft


def generation(state, num_rows: int) -> dict:
    """Host tokens and rounds of a final loop state (what spec_jax.generate returns from it)."""
    from spec_jax import sharding

    out, counts, rounds = sharding.fetch(
        (state.out.tokens, state.out.num_generated, state.metrics.num_rounds)
    )
    return {"tokens": [out[i, : counts[i]].tolist() for i in range(num_rows)], "num_rounds": int(rounds)}


def spec_of(x) -> str:
    return str(tuple(x.sharding.spec))


def equivalence(pair: str, out_path: str):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax

    import spec_jax
    from spec_jax import api, executables, sharding

    target, draft = models_for(pair)
    result = {
        "num_devices": jax.device_count(),
        "threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
    }
    cases = []
    # The last run is on data:2,model:4: the facts below read its executable and state.
    # (Compiles dominate the time on 2 cores, so sampling runs on one mesh.)
    runs = [(0.0, "data:1,model:8"), (0.0, "data:2,model:4"), (1.0, "data:2,model:4")]
    refs = {}
    for temperature, mesh_spec in runs:
        kwargs = dict(draft=draft, gamma=3, max_new_tokens=MAX_NEW, temperature=temperature, seed=5)
        if temperature not in refs:
            refs[temperature] = spec_jax.generate(target, PROMPTS, **kwargs)
        mesh = sharding.make_mesh(mesh_spec)
        st, _ = api.run(target, PROMPTS, mesh=mesh, **kwargs)  # generate, keeping the final state
        gen = generation(st, len(PROMPTS))
        cases.append(
            {
                "temperature": temperature,
                "mesh": mesh_spec,
                "ref_tokens": refs[temperature].tokens,
                "tokens": gen["tokens"],
                "ref_rounds": refs[temperature].stats["num_rounds"],
                "rounds": gen["num_rounds"],
                "target_cache": spec_of(st.target_cache.k),
                "draft_cache": spec_of(st.draft_state.k),
                "out_tokens": spec_of(st.out.tokens),
            }
        )
    result["cases"] = cases

    mesh = sharding.make_mesh("data:2,model:4")
    placed = sharding.place(target, mesh)
    result["target_param_specs"] = sharding.describe(target.config, mesh)
    result["placed_param_specs"] = {
        "/".join(str(getattr(k, "key", k)) for k in path): spec_of(x)
        for path, x in jax.tree_util.tree_flatten_with_path(placed.params)[0]
    }
    # The executable of the speculative loop: its input shardings and its per-device HLO.
    loops = [(k, v) for k, v in executables._EXECUTABLES.items() if k[0] == "spec_loop"]
    key, loop = loops[-1]
    result["loop_input_specs"] = [str(tuple(s.spec)) for s in jax.tree.leaves(loop.input_shardings)]
    hlo = loop.as_text()
    cache_shape = [x for x in jax.tree.leaves(st.target_cache)][0].shape  # last run's state
    full = "f32[" + ",".join(map(str, cache_shape)) + "]"
    result["cache_shape"] = list(cache_shape)
    result["full_cache_in_hlo"] = full in hlo
    result["cache_local_shapes"] = sorted({str(s.data.shape) for s in st.target_cache.k.addressable_shards})
    result["num_all_reduce_in_loop"] = len(re.findall(r"\ball-reduce(?:-start)?\(", hlo))

    # Placement happens once: an unplaced model is placed on first use and cached; a placed one
    # is used as it is.
    before = len(sharding._PLACED)
    again = spec_jax.generate(placed, PROMPTS, mesh=mesh, **kwargs)  # same settings: no recompile
    result["placed_model_same_tokens"] = again.tokens == gen["tokens"]
    result["placed_model_compile_seconds"] = again.stats["compile_seconds"]
    result["placed_model_added_cache_entries"] = len(sharding._PLACED) - before
    result["draft_cached_params_reused"] = sharding.placed_params(draft, mesh) is sharding.placed_params(
        draft, mesh
    )
    result["is_placed"] = sharding.is_placed(placed.params, mesh)

    if pair == "divisible":  # plain autoregressive decoding goes through the same sharded machinery
        ref = spec_jax.generate(target, PROMPTS[:3], max_new_tokens=6, temperature=0.0)
        st, _ = api.run(target, PROMPTS[:3], max_new_tokens=6, temperature=0.0, mesh=mesh)
        tokens = generation(st, 3)["tokens"]
        result["ar"] = {"ref_tokens": ref.tokens, "tokens": tokens, "cache": spec_of(st.target_cache.k)}
    with open(out_path, "w") as f:
        json.dump(result, f)


def multihost(process_id: int, num_processes: int, port: int, out_path: str):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    from spec_jax import api, sharding

    target, draft = models_for("divisible")
    mesh = sharding.make_mesh("data:2,model:4")
    placed = sharding.place(target, mesh)
    state, _ = api.run(
        placed, PROMPTS, draft=draft, gamma=3, max_new_tokens=MAX_NEW, temperature=0.0, seed=5, mesh=mesh
    )

    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "num_devices": jax.device_count(),
        "num_local_devices": jax.local_device_count(),
        "tokens": generation(state, len(PROMPTS))["tokens"],
        "target_cache": spec_of(state.target_cache.k),
        "cache_fully_addressable": state.target_cache.k.is_fully_addressable,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "equivalence":
        equivalence(sys.argv[2], sys.argv[3])
    elif mode == "multihost":
        multihost(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(f"unknown mode {mode}")
