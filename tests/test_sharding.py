"""Sharded generation: identical tokens on meshes of 8 CPU devices and across 2 processes.

jax must see 8 host devices before it initialises, and this pytest process already has
one, so the sharded runs happen in subprocesses (tests/sharding_worker.py), started together
by one fixture so their compiles overlap on the 2 cores; the tests then read their results.
Under pytest-xdist the first worker that needs them runs them and the others wait for its
results (a file lock), so they never run twice. The Qwen-shaped pair (head counts the model
axis does not divide) runs only in `make test-slow`; its placement rule is checked in-process
below (test_qwen_head_counts_replicate_in_the_rule_table).
"""

import json
import os
import shlex
import socket
import subprocess
import sys
import time

import jax
import pytest
from conftest import cli_case
from jax.sharding import AbstractMesh

import models
from models import registry
from spec_jax import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "sharding_worker.py")
TIMEOUT_S = 240


def _env(**extra):
    return {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path_factory, group: str, specs: dict) -> dict:
    """Runs `python sharding_worker.py ARGS OUT.json` for every spec at once, once per test
    session (across xdist workers: their base temp folders share one parent); returns {name:
    (exit code or None on timeout, output path, log path)}."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / f"sharding-{group}"
    out.mkdir(exist_ok=True)
    with registry.file_lock(out / ".lock"):
        status = out / "status.json"
        if not status.exists():
            procs = {}
            for name, args in specs.items():
                log = open(out / f"{name}.log", "w")  # noqa: SIM115 - closed below
                cmd = [sys.executable, WORKER, *args, str(out / f"{name}.json")]
                procs[name] = (subprocess.Popen(cmd, env=_env(), stdout=log, stderr=log, cwd=ROOT), log)
            deadline = time.monotonic() + TIMEOUT_S
            codes = {}
            for name, (proc, log) in procs.items():
                try:
                    codes[name] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    codes[name] = None
                log.close()
            status.write_text(json.dumps(codes))
        codes = json.loads(status.read_text())
    return {name: (codes[name], out / f"{name}.json", out / f"{name}.log") for name in specs}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The divisible pair on 8 devices, and the same pair across 2 processes of 4 devices."""
    port = _free_port()
    specs = {
        "divisible": ["equivalence", "divisible"],
        "host0": ["multihost", "0", "2", str(port)],
        "host1": ["multihost", "1", "2", str(port)],
    }
    return _run_workers(tmp_path_factory, "main", specs)


@pytest.fixture(scope="module")
def qwen_worker(tmp_path_factory):
    """The Qwen-shaped pair on 8 devices (slow tests only)."""
    return _run_workers(tmp_path_factory, "qwen", {"qwen": ["equivalence", "qwen"]})


def _result(workers, name):
    code, path, log = workers[name]
    if code is None:
        pytest.fail(f"worker {name} did not finish in {TIMEOUT_S} s")
    if code:
        pytest.fail(f"worker {name} exited {code}:\n{log.read_text()[-3000:]}")
    return json.loads(path.read_text())


@pytest.fixture
def pair_results(request):
    """The equivalence worker's results for the pair named by the test's `pair` parameter."""
    pair = request.param
    fixture = "qwen_worker" if pair == "qwen" else "workers"
    return _result(request.getfixturevalue(fixture), pair)


PAIRS = ["divisible", pytest.param("qwen", marks=pytest.mark.slow)]
# The tests that read the `workers` fixture: one xdist group, so one pytest worker computes it.
on_the_workers_worker = pytest.mark.xdist_group("sharding_workers")


@on_the_workers_worker
@pytest.mark.parametrize("pair_results", PAIRS, indirect=True)
def test_sharded_speculative_tokens_equal_unsharded(pair_results):
    result = pair_results
    assert result["num_devices"] == 8
    meshes = {(c["mesh"], c["temperature"]) for c in result["cases"]}
    assert {("data:2,model:4", 0.0), ("data:1,model:8", 0.0)} <= meshes
    for case in result["cases"]:
        assert case["tokens"] == case["ref_tokens"], case
        assert case["rounds"] == case["ref_rounds"], case
        assert all(len(t) == 10 for t in case["tokens"])


@on_the_workers_worker
@pytest.mark.parametrize("pair_results", PAIRS, indirect=True)
def test_sampling_at_temperature_1_same_seed_same_tokens_sharded(pair_results):
    result = pair_results
    assert result["threefry_partitionable"]
    (case,) = [c for c in result["cases"] if c["temperature"] == 1.0]
    assert case["tokens"] == case["ref_tokens"]
    # Not vacuous: sampled output differs from greedy output.
    greedy = [c for c in result["cases"] if c["temperature"] == 0.0][0]
    assert case["tokens"] != greedy["tokens"]


# The Qwen2.5 head counts of tests/sharding_worker.py: target 12 q / 2 kv heads on model=4.
QWEN_TARGET_SPECS = {
    "layers/attn/wq": "(None, 'model', None, None)",
    "layers/attn/wo": "(None, None, 'model', None)",
    "layers/attn/wk": "(None, None, None, None)",
    "layers/mlp/w_gate": "(None, 'model', None)",
    "layers/mlp/w_down": "(None, None, 'model')",
    "lm_head/embedding": "('model', None)",
    "embed/embedding": "('model', None)",
}


def test_qwen_head_counts_replicate_in_the_rule_table():
    """In-process: the Qwen-shaped target's placement on data:2,model:4 (an abstract mesh) shards
    its 12 q heads, replicates its 2 kv heads and its KV cache over model; the cache stays split
    over data. (The placed arrays themselves: the slow test below.)"""
    from sharding_worker import models_for

    target, _ = models_for("qwen")
    mesh = AbstractMesh((2, 4), ("data", "model"))
    described = sharding.describe(target.config, mesh)
    for path, spec in QWEN_TARGET_SPECS.items():
        assert described[path] == "P" + spec, path
    cache = models.init_cache(target.config, 4, 32)
    assert tuple(sharding.partition_spec(sharding.CACHE_AXES, cache.k.shape, mesh)) == (
        None,
        "data",
        None,
        None,
        None,
    )


@pytest.mark.slow
def test_qwen_head_counts_replicate_what_the_model_axis_does_not_divide(qwen_worker):
    specs = _result(qwen_worker, "qwen")["placed_param_specs"]
    # target: 12 q heads (divisible by 4) sharded, 2 kv heads replicated, MLP and vocab sharded.
    for path, spec in QWEN_TARGET_SPECS.items():
        assert specs[path] == spec, path


@on_the_workers_worker
def test_arrays_are_sharded_inside_the_compiled_loop(workers):
    result = _result(workers, "divisible")
    case = [c for c in result["cases"] if c["mesh"] == "data:2,model:4"][-1]
    assert case["target_cache"] == "(None, 'data', None, 'model', None)"
    assert case["draft_cache"] == "(None, 'data', None, 'model', None)"
    assert case["out_tokens"] == "('data', None)"
    # Per-layer layout: Megatron column/row parallel.
    specs = result["placed_param_specs"]
    assert specs["layers_0/attn/wq"] == "('model', None, None)"
    assert specs["layers_1/attn/wk"] == "('model', None, None)"
    assert specs["layers_0/attn/wo"] == "(None, 'model', None)"
    assert specs["layers_1/mlp/w_down"] == "(None, 'model')"
    # The executable of the loop takes sharded params and caches ...
    loop_specs = result["loop_input_specs"]
    assert "(None, 'data', None, 'model', None)" in loop_specs
    assert "('model', None, None)" in loop_specs
    # ... and its per-device program never holds the full [L, B, S, KVH, Dh] cache.
    assert not result["full_cache_in_hlo"]
    L, B, S, KVH, Dh = result["cache_shape"]
    assert result["cache_local_shapes"] == [str((L, B // 2, S, KVH // 4, Dh))]
    assert result["num_all_reduce_in_loop"] > 0


@pytest.mark.slow
def test_qwen_kv_cache_is_replicated_over_model_inside_the_loop(qwen_worker):
    # The Qwen-like KV cache (2 kv heads, model=4) is replicated over model, split over data.
    qwen = _result(qwen_worker, "qwen")
    assert not qwen["full_cache_in_hlo"]
    assert [c for c in qwen["cases"] if c["mesh"] == "data:2,model:4"][0]["target_cache"] == (
        "(None, 'data', None, None, None)"
    )


@on_the_workers_worker
def test_params_are_placed_once(workers):
    result = _result(workers, "divisible")
    assert result["is_placed"]
    assert result["placed_model_added_cache_entries"] == 0
    assert result["placed_model_same_tokens"]
    assert result["placed_model_compile_seconds"] == 0.0
    assert result["draft_cached_params_reused"]


@on_the_workers_worker
def test_sharded_autoregressive_tokens_equal_unsharded(workers):
    ar = _result(workers, "divisible")["ar"]
    assert ar["tokens"] == ar["ref_tokens"]
    assert ar["cache"] == "(None, 'data', None, 'model', None)"


@on_the_workers_worker
def test_two_processes_produce_the_single_process_tokens(workers):
    hosts = [_result(workers, f"host{i}") for i in range(2)]
    single = _result(workers, "divisible")
    (ref,) = [c for c in single["cases"] if c["mesh"] == "data:2,model:4" and c["temperature"] == 0.0]
    for i, host in enumerate(hosts):
        assert host["process_index"] == i and host["process_count"] == 2
        assert host["num_devices"] == 8 and host["num_local_devices"] == 4
        assert not host["cache_fully_addressable"]
        assert host["target_cache"] == "(None, 'data', None, 'model', None)"
        assert host["tokens"] == ref["ref_tokens"]


# In-process (1 device): the rule table, the logical axes, mesh errors.


def test_logical_axes_cover_both_layouts():
    for scan in (True, False):
        model = models.random_model(vocab_size=32, num_layers=2, d_model=32, num_heads=4, scan_layers=scan)
        axes = sharding.param_logical_axes(model.params)
        if scan:
            assert axes["layers"]["attn"]["wq"] == ("layers", "heads", "head_dim", "embed")
            assert axes["layers"]["mlp"]["w_down"] == ("layers", "embed", "mlp")
        else:
            assert axes["layers_1"]["attn"]["wo"] == ("embed", "heads", "head_dim")
            assert axes["layers_0"]["attn"]["bk"] == ("kv_heads", "head_dim")
        assert axes["lm_head"]["embedding"] == ("vocab", "embed")


@pytest.mark.parametrize(
    "heads, model_axis, expected",
    [(12, 4, "model"), (14, 4, None), (12, 8, None), (2, 4, None), (8, 8, "model"), (12, 1, None)],
)
def test_dimension_not_divisible_by_the_model_axis_is_replicated(heads, model_axis, expected):
    mesh = AbstractMesh((1, model_axis), ("data", "model"))
    spec = sharding.partition_spec(("embed", "heads", "head_dim"), (96, heads, 8), mesh)
    assert tuple(spec) == (None, expected, None)


def test_cache_batch_on_data_kv_heads_on_model():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    assert tuple(sharding.partition_spec(sharding.CACHE_AXES, (2, 4, 64, 8, 16), mesh)) == (
        None,
        "data",
        None,
        "model",
        None,
    )


@pytest.mark.parametrize("spec", ["data=2", "data:0", "data:2,data:2", "model:x", "pipe:2", "data:2;model:4"])
def test_malformed_mesh_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="malformed mesh"):
        sharding.make_mesh(spec)


def test_mesh_needing_more_devices_names_both_numbers():
    with pytest.raises(ValueError, match=rf"needs 8 devices but only {jax.device_count()} exist"):
        sharding.make_mesh("data:2,model:4")


def test_mesh_defaults():
    assert dict(sharding.make_mesh(None).shape) == {"data": 1, "model": 1}
    assert dict(sharding.make_mesh("").shape) == {"data": 1, "model": 1}
    assert dict(sharding.make_mesh("auto").shape) == {"data": 1, "model": jax.device_count()}
    assert dict(sharding.make_mesh("model:1").shape) == {"data": 1, "model": 1}


# The command lines.


def _cli(*args, module="launch.generate", timeout=120, env=None):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env or _env(),
        timeout=timeout,
    )
    return result, time.monotonic() - start


def _one_line_error(result, message):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr


BAD_MESHES = [("data:2,model:4", "needs 8 devices but only 1 exist"), ("data=2", "malformed mesh")]
ONE_DEVICE_MESH = [
    "--target=random",
    "--draft=random-draft",
    "--mesh=auto",
    "--gamma=4",
    "--max_new_tokens=3",
]
ONE_DEVICE_MESH += ["--temperature=0", "--prompt=ab"]


def _bad_mesh_args(mesh):
    return ["--target=random", "--draft=random-draft", f"--mesh={mesh}", "--max_new_tokens=2"]


def _mesh_case(args):
    """`python -m launch.generate *args`'s result, the bad meshes' and the one-device mesh's runs
    in one process (conftest.cli_case)."""
    return cli_case("launch.generate", [*(_bad_mesh_args(m) for m, _ in BAD_MESHES), ONE_DEVICE_MESH], args)


@pytest.mark.parametrize("mesh, message", BAD_MESHES)
def test_cli_bad_mesh_exits_2_with_one_line(mesh, message):
    _one_line_error(_mesh_case(_bad_mesh_args(mesh)), message)


def test_cli_unreachable_coordinator_fails_within_the_timeout():
    port = _free_port()  # nothing listens there
    result, seconds = _cli(
        "--target=random",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--process_id=1",
        "--initialization_timeout=3",
        timeout=60,
    )
    _one_line_error(result, f"coordinator 127.0.0.1:{port} unreachable after 3 s")
    assert seconds < 30


def test_cli_runs_on_a_one_device_mesh():
    result = _mesh_case(ONE_DEVICE_MESH)
    assert result.returncode == 0, result.stderr
    assert "speculative (model): 3 tokens" in result.stdout


TPU = ["--name=spec", "--zone=us-central2-b", "--dry_run"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["create", "--accelerator_type=v4-32", "--runtime_version=tpu-ubuntu2204-base", "--project=proj"],
            [
                "gcloud compute tpus tpu-vm create spec --zone=us-central2-b --project=proj "
                "--accelerator-type=v4-32 --version=tpu-ubuntu2204-base"
            ],
        ),
        (
            ["run", "--command=python -m launch.generate --mesh=auto --distributed"],
            [
                "gcloud compute tpus tpu-vm ssh spec --zone=us-central2-b --worker=all "
                "'--command=cd spec-jax && . .venv/bin/activate && python -m launch.generate --mesh=auto --distributed'"
            ],
        ),
        (["delete"], ["gcloud compute tpus tpu-vm delete spec --zone=us-central2-b --quiet"]),
    ],
)
def test_tpu_dry_run_prints_the_exact_commands(args, expected):
    result, _ = _cli(*TPU, *args, module="launch.tpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == expected


def _tpu_dry_run(*args) -> list[list[str]]:
    result, _ = _cli(*TPU, *args, module="launch.tpu")
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines()]


SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "spec", "--zone=us-central2-b", "--worker=all"]
APT = "sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -y"
JAX_VERSION = "0.10.2"  # constraints.txt's pin (checked below)


def test_tpu_setup_dry_run_sends_the_exact_commands():
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        assert f"jax=={JAX_VERSION}\n" in f.read()
    script = (
        "set -euo pipefail; cd spec-jax; "
        f'if ! python3.11 -c "import ensurepip, venv" 2>/dev/null; then {APT} update; '
        f"{APT} install software-properties-common; sudo add-apt-repository -y ppa:deadsnakes/ppa; "
        f"{APT} install python3.11 python3.11-venv; fi; "
        "python3.11 -m venv .venv; "
        '.venv/bin/python -m pip install -c constraints.txt -e ".[tpu]"; '
        'JAX_PLATFORMS=tpu .venv/bin/python -c "import jax; print(jax.devices())"'
    )
    assert _tpu_dry_run("setup") == [
        [*SSH, "--command=mkdir -p spec-jax"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", "setup.py", "constraints.txt",
         "pyproject.toml", "spec_jax", "models", "training", "experiments", "launch", "spec:spec-jax/",
         "--zone=us-central2-b", "--worker=all"],
        [*SSH, "--command=bash -c " + shlex.quote(script)],
    ]  # fmt: skip


def _fake_worker(tmp_path, have_python311: bool, failing: str = ""):
    """A home folder with spec-jax/ and a bin/ of stubs for sudo, python3, python3.11 and the
    .venv's python, which log each call (with JAX_PLATFORMS) to log.txt and exit 0, except a
    call whose arguments contain `failing`, which exits 3."""
    home = tmp_path / "home"
    (home / "spec-jax").mkdir(parents=True, exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "log.txt"
    stub = (
        "#!/bin/bash\n"
        f'echo "$(basename "$0") JAX_PLATFORMS=${{JAX_PLATFORMS:-}} $*" >> {log}\n'
        f'if [ -n "{failing}" ] && [[ "$*" == *"{failing}"* ]]; then exit 3; fi\n'
    )
    python311 = stub + (
        f'if [ "$1" = -c ] && [ ! -e {tmp_path}/installed ]; then exit 1; fi\n'
        'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0.venv" "$3/bin/python"; fi\n'
    )
    scripts = {"sudo": stub + f'[[ "$*" == *python3.11-venv* ]] && touch {tmp_path}/installed\nexit 0\n',
               "python3": stub, "python3.11": python311, "python3.11.venv": stub}  # fmt: skip
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if have_python311:
        (tmp_path / "installed").touch()
    return home, bin_dir, log


def _run_on_fake_worker(tmp_path, ssh_argv, have_python311=True, failing=""):
    """Runs a dry-run ssh command's --command the way sshd does (`bash -c COMMAND` in the home
    folder) on a fake worker; returns (exit code, the logged calls)."""
    home, bin_dir, log = _fake_worker(tmp_path, have_python311, failing)
    command = ssh_argv[-1].removeprefix("--command=")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home)}
    result = subprocess.run(["bash", "-c", command], cwd=home, env=env, capture_output=True, text=True)
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return result.returncode, calls


def test_tpu_setup_installs_python311_makes_a_venv_installs_into_it_and_checks_jax(tmp_path):
    install = _tpu_dry_run("setup")[-1]
    code, calls = _run_on_fake_worker(tmp_path, install, have_python311=False)
    assert code == 0
    assert calls == [
        "python3.11 JAX_PLATFORMS= -c import ensurepip, venv",
        f"sudo JAX_PLATFORMS= {APT.removeprefix('sudo ')} update",
        f"sudo JAX_PLATFORMS= {APT.removeprefix('sudo ')} install software-properties-common",
        "sudo JAX_PLATFORMS= add-apt-repository -y ppa:deadsnakes/ppa",
        f"sudo JAX_PLATFORMS= {APT.removeprefix('sudo ')} install python3.11 python3.11-venv",
        "python3.11 JAX_PLATFORMS= -m venv .venv",
        "python JAX_PLATFORMS= -m pip install -c constraints.txt -e .[tpu]",
        "python JAX_PLATFORMS=tpu -c import jax; print(jax.devices())",  # the .venv's python, last
    ]


def test_tpu_setup_rerun_skips_apt_and_reinstalls_into_the_same_venv(tmp_path):
    install = _tpu_dry_run("setup")[-1]
    assert _run_on_fake_worker(tmp_path, install, have_python311=False)[0] == 0
    code, calls = _run_on_fake_worker(tmp_path, install, have_python311=True)
    assert code == 0
    assert not [c for c in calls if c.startswith("sudo")], calls
    assert calls[1:] == [
        "python3.11 JAX_PLATFORMS= -m venv .venv",
        "python JAX_PLATFORMS= -m pip install -c constraints.txt -e .[tpu]",
        "python JAX_PLATFORMS=tpu -c import jax; print(jax.devices())",
    ]


@pytest.mark.parametrize("failing", ["jax.devices()", "python3.11-venv"])
def test_tpu_setup_fails_at_the_first_failing_step(tmp_path, failing):
    install = _tpu_dry_run("setup")[-1]
    code, calls = _run_on_fake_worker(tmp_path, install, have_python311=False, failing=failing)
    assert code == 3, calls
    assert failing in calls[-1], calls  # nothing ran after it


def test_tpu_run_uses_the_venv_python_and_refuses_without_one(tmp_path):
    home = tmp_path / "home"
    (home / "spec-jax").mkdir(parents=True)
    [run] = _tpu_dry_run("run", "--command=python -c 'import sys; print(sys.prefix)'")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    command = run[-1].removeprefix("--command=")
    missing = subprocess.run(["bash", "-c", command], cwd=home, env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and missing.stdout == ""  # no .venv: the command never ran
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(home / "spec-jax" / ".venv")], check=True
    )
    result = subprocess.run(["bash", "-c", command], cwd=home, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(home / "spec-jax" / ".venv")


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--name=a", "--zone=b", "--dry_run"], "run needs --command"),
        (["frob", "--name=a", "--zone=b"], "expected one subcommand"),
        (["create", "--zone=b"], "--name is required"),
        (["delete", "--name=a", "--zone=b"], "gcloud not found on PATH"),
    ],
)
def test_tpu_bad_input_exits_2_with_one_line(args, message):
    result, _ = _cli(*args, module="launch.tpu", env=_env(PATH=""))  # no gcloud on an empty PATH
    _one_line_error(result, message)
