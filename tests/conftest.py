"""Shared fixtures: tiny random models, built once per session.

The suite runs on the CPU backend. JAX_PLATFORMS=cpu (set before jax is imported, inherited by the
subprocesses the tests start) keeps it there: libtpu and the CUDA PJRT plugin, where installed,
would otherwise be tried as backends at start-up and log errors on a machine without a TPU or
CUDA. Their compile-only devices work under it (tests/test_compile_targets.py).
"""

import collections
import gc
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of small programs and runs each a few times: LLVM's optimizations
# cost more CPU than they save (tests/test_decode.py: 104 -> 60 CPU-seconds without them), and
# so do XLA:CPU's MLIR fusion emitters against its older elemental emitters (the tiny pair's
# speculative loops: 13.4 -> 9.0 s of compilation; tests/test_decode.py 28 -> 17 s), and so does
# splitting each program's LLVM module for parallel code generation (two workers already fill the
# two cores; with the collector settings below, 85 -> 70 CPU-seconds for three loop-heavy test
# files, and the suite 641-648 -> 594 s). The subprocesses the tests start inherit the flags.
# Numerics do not depend on them: every comparison in the suite is between programs compiled
# alike, or to a tolerance.
# (models.jax_compat: jax 0.11's XLA has no switch for the emitters; set below, once the path
# holds the compile-only backends.)
# JAX's persistent compilation cache, which the entry points turn on (launch.common), stays off
# for the CLI subprocesses the tests start: they would write into the user's $SPEC_JAX_CACHE, and
# a compilation cache shared by the workers was tried and did not pay (542 s against 552 s for
# the suite). tests/test_compilation_cache.py turns it on for its own subprocesses.
os.environ["SPEC_JAX_COMPILATION_CACHE"] = "0"
# The compile-only backends live outside the venv (`make test` installs them with pip --target):
# on the venv's path the CUDA plugin logs three lines at every jax start-up, even on
# JAX_PLATFORMS=cpu, which breaks the one-line-stderr checks of the CLI tests. Only this process
# (the tests that compile for TPUs / GPUs) sees them; the subprocesses the tests start do not.
COMPILE_DEPS = os.environ.get(
    "SPEC_JAX_COMPILE_DEPS",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-compile"),
)
if os.path.isdir(COMPILE_DEPS) and COMPILE_DEPS not in sys.path:
    sys.path.append(COMPILE_DEPS)

# XLA reads XLA_FLAGS when the first backend starts, so they may be set after jax is imported.
from models import jax_compat  # noqa: E402

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {jax_compat.fast_compile_xla_flags()}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import models  # noqa: E402

# Tracing a program makes millions of short-lived Python objects, and the cyclic garbage collector
# walked them about every 700 allocations: 4-5% of a test worker's CPU (perf). The objects of the
# imports above are frozen out of every collection, and the youngest generation is collected every
# 100,000 allocations (measured with the code generation flag above: tests/test_speculative.py,
# test_tree_loop.py and test_distribution.py in one process, 85 -> 78 CPU-seconds for this alone).
gc.freeze()
gc.set_threshold(100_000, 50, 100)

_forward = jax.jit(models.forward, static_argnums=0)


def apply(model: models.Model, tokens_bt, positions_bt, cache, logits_at=None):
    """models.forward's ForwardOutput for model's config and params, jit-compiled."""
    return _forward(model.config, model.params, tokens_bt, positions_bt, cache, logits_at)


def perturbed(model: models.Model, scale: float, seed: int) -> models.Model:
    """The same architecture with noise added to every weight: a draft that mostly agrees.

    Drawn with NumPy: jax.random on each weight's shape compiles a program per shape (about 14 s
    of CPU for the tiny pair), in every test process that builds the fixture."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(model.params)
    noisy = []
    for x in leaves:
        x = np.asarray(x)
        noise = scale * x.std() * rng.standard_normal(x.shape)
        noisy.append(jnp.asarray((x + noise).astype(x.dtype)))
    return model.replace(params=jax.tree.unflatten(treedef, noisy))


def _xdist_group(item) -> str:
    """The name xdist's loadgroup gives item's xdist_group marks ("" for none)."""
    names = {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """In `make test`'s workers (--dist=loadgroup, pyproject.toml), before xdist reads the groups:

    - a test with no xdist_group of its own joins its module's: each module runs in one worker,
      whose module fixtures and compiled programs all its tests share (a module split over the
      two workers built its fixtures and compiled its programs in both);
    - the groups named in the test files (each shares an expensive fixture: a dry run, a trained
      head, a compile for a pod slice) come first, then the modules, each kind largest first
      (xdist hands the groups out in this order: --no-loadscope-reorder), so that no worker is
      left alone with a long group at the end."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    keys = {}
    for item in items:
        name = _xdist_group(item)
        if not name:
            name = item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(name))
            keys[item] = (1, name)
        else:
            keys[item] = (0, name)
    sizes = collections.Counter(keys.values())
    items.sort(key=lambda item: (keys[item][0], -sizes[keys[item]], keys[item][1]))


@pytest.fixture(autouse=True, scope="module")
def _release_jit_caches():
    """After each test module, jax's caches of traced and compiled programs are dropped
    (jax.clear_caches): a worker that kept every module's programs grew past 8 GB of memory in
    `make test`, and toward the kernel's limit of memory mappings, past which XLA's compiler
    segfaults (each compiled program holds a few hundred). spec_jax.executables' own cache of the
    loops, which the tiny_target group shares across modules, is kept: it bounds itself by
    count and by mappings (executables.map_budget)."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_target():
    return models.random_model(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """Agrees with the target often but not always, so rounds accept partially."""
    return perturbed(tiny_target, 0.1, seed=7)


def loop_by_hand(
    target, drafter, draft_params, prompts, gamma: int, max_new: int, width: int = 16, tree: int = 0
):
    """(state after prefill, step) of the greedy loop over prompts padded to `width`, one round per
    step(state) (spec_jax.speculative.stepper), for tests that inspect the state between rounds.
    tree: tree rounds of that many nodes (gamma must then equal it)."""
    from spec_jax import speculative
    from spec_jax.decode import PrefillInputs, pad_prompts
    from spec_jax.sampling import row_keys

    assert not tree or gamma == tree, "a tree round's gamma is its node count"
    static = speculative.SpecStatic(
        target.config, drafter, gamma, max_new, width + max_new + gamma, tree_nodes=tree
    )
    tokens, lens = pad_prompts(prompts, width)
    keys = row_keys(jax.random.key(0), list(range(len(prompts))))
    inputs = PrefillInputs(jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray([-1]), keys)
    return speculative.stepper(static, target.params, draft_params, inputs)


_CLI_CASE_RESULTS: dict = {}


# The quick draft-head training run of launch.train that tests/test_training.py (a killed run
# must resume to it) and tests/test_cli.py (its head drafts for launch.generate) share.
CLI_TRAINING_FLAGS = (
    "--config=launch/configs/draft_head.py:quick",
    "--config.target=random",
    "--config.steps=24",
    "--config.checkpoint_every=2",
    "--config.eval_every=6",
)


@pytest.fixture(scope="session")
def cli_trained_head(tmp_path_factory):
    """(workdir, output_dir) of one uninterrupted `python -m launch.train` run with
    CLI_TRAINING_FLAGS. The tests that use it are in the xdist group "cli_trained_head", so one
    worker trains it, once."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = tmp_path_factory.mktemp("cli_trained_head")
    workdir, output_dir = base / "head", base / "out"
    cmd = [sys.executable, "-m", "launch.train", *CLI_TRAINING_FLAGS]
    cmd += [f"--workdir={workdir}", f"--output_dir={output_dir}"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, output_dir


def cache_with_kernels(folder):
    """folder, made a model cache that holds this machine's CPU kernel library only (copied from
    the default cache, built there first if need be), for a CLI run into an empty cache: the
    cold build is seconds of g++ the test does not check (tests/test_cache_safety.py checks the
    build). Returns folder (a pathlib.Path)."""
    import pathlib
    import shutil

    from models.kernels import cpu_matmul

    folder = pathlib.Path(folder)
    library = cpu_matmul.build()  # the default cache's (verified, built once per machine)
    (folder / "kernels").mkdir(parents=True, exist_ok=True)
    for path in (library, library.with_name(library.name + ".sha256")):
        shutil.copy2(path, folder / "kernels" / path.name)
    return folder


def _case_key(case):
    """A cli_driver case (a list of arguments, or a dict with "args" and a "prelude") as a key."""
    if isinstance(case, dict):
        return (tuple(case["args"]), case.get("prelude"), json.dumps(case.get("extra", {}), sort_keys=True))
    return tuple(case)


def cli_case(module: str, cases, args, env=None):
    """`python -m module *args`'s result, for args one of `cases` (lists of arguments, or dicts
    with a prelude: tests/cli_driver.py): the first call runs every case in one Python process
    (tests/cli_driver.py: the module's cli() per case, absl's flags reset between them, stdout
    and stderr captured at the file descriptors) and keeps the results for the rest, so a
    parametrized test of bad input starts Python and imports jax once, not once per case. The
    tests reading one list of cases belong in one xdist group, so that one worker runs it.
    env: added to os.environ (part of the cache key). Returns a subprocess.CompletedProcess
    (returncode, stdout, stderr)."""
    import subprocess
    import tempfile

    key = (module, tuple(_case_key(c) for c in cases), tuple(sorted((env or {}).items())))
    if key not in _CLI_CASE_RESULTS:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with tempfile.TemporaryDirectory() as tmp:
            cases_path, results_path = os.path.join(tmp, "cases.json"), os.path.join(tmp, "results.json")
            with open(cases_path, "w") as f:
                json.dump([c if isinstance(c, dict) else list(c) for c in cases], f)
            proc = subprocess.run(
                [
                    sys.executable,
                    os.path.join(root, "tests", "cli_driver.py"),
                    module,
                    cases_path,
                    results_path,
                ],
                capture_output=True,
                text=True,
                cwd=root,
                env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu", **(env or {})},
                timeout=600,
            )
            assert proc.returncode == 0 and os.path.exists(results_path), proc.stderr[-3000:]
            with open(results_path) as f:
                results = json.load(f)
        _CLI_CASE_RESULTS[key] = {
            _case_key(c): subprocess.CompletedProcess(
                [module, *(c["args"] if isinstance(c, dict) else c)],
                r["returncode"],
                r["stdout"],
                r["stderr"],
            )
            for c, r in zip(cases, results, strict=True)
        }
    return _CLI_CASE_RESULTS[key][_case_key(args)]
