"""Cloud TPU VMs (single host or pod slice): create, copy + install, run on every worker, delete.

  python -m launch.tpu create --name=spec --zone=us-central2-b --accelerator_type=v4-32
  python -m launch.tpu setup  --name=spec --zone=us-central2-b
  python -m launch.tpu run    --name=spec --zone=us-central2-b \\
      --command="python -m launch.generate --mesh=auto --distributed --target=random --draft=random-draft"
  python -m launch.tpu delete --name=spec --zone=us-central2-b

Every command is a `gcloud compute tpus tpu-vm ...` call with `--worker=all` where it touches
the workers, so a pod slice runs the same thing on each host (launch.generate then calls
jax.distributed.initialize(), which finds its peers on a TPU VM). `--dry_run` prints the
exact commands instead of running them. See docs/pods.md.

setup copies the code to ~/REMOTE_DIR on every worker and runs one bash script there
(`set -euo pipefail`, safe to re-run): it installs python3.11 from the deadsnakes PPA if the
image lacks it (TPU images on Ubuntu 22.04 ship python3 3.10; setup.py needs 3.11+), makes
REMOTE_DIR/.venv with it, pip-installs the project with its tpu extra (jax[tpu] and libtpu,
pinned by `-c constraints.txt`), and fails unless `import jax; print(jax.devices())` finds the
TPU. run activates that .venv before the command, so `python` is its python 3.11.
"""

import os
import shlex
import shutil
import subprocess

from absl import flags

from launch import common

FLAGS = flags.FLAGS

flags.DEFINE_string("name", None, "TPU VM (or pod slice) name.")
flags.DEFINE_string("zone", None, "Zone, e.g. us-central2-b.")
flags.DEFINE_string("project", None, "Google Cloud project (default: gcloud's configured project).")
flags.DEFINE_string("accelerator_type", "v4-8", "Accelerator type for create, e.g. v4-32, v5litepod-16.")
flags.DEFINE_string(
    "runtime_version",
    "tpu-ubuntu2204-base",
    "TPU VM software version for create: tpu-ubuntu2204-base (v4), v2-alpha-tpuv5-lite (v5e), "
    "v2-alpha-tpuv5 (v5p), v2-alpha-tpuv6e (v6e); setup makes its own python 3.11 on any of them.",
)
flags.DEFINE_string(
    "command",
    None,
    "For run: the shell command every worker runs from the code directory, with the .venv that "
    "setup made activated (`python` is its python 3.11).",
)
flags.DEFINE_string(
    "remote_dir",
    "spec-jax",
    "Code directory on each worker, relative to the home directory; setup makes its .venv there.",
)
flags.DEFINE_bool("dry_run", False, "Print the gcloud commands instead of running them.")

SUBCOMMANDS = ("create", "setup", "run", "delete")
# What setup copies: the packages setup.py installs and the install files (not .venv, caches or
# results).
CODE_PATHS = (
    "setup.py",
    "constraints.txt",
    "pyproject.toml",
    "spec_jax",
    "models",
    "training",
    "experiments",
    "launch",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The interpreter setup makes the worker's .venv with (setup.py: python_requires >= 3.11). TPU VM
# images on Ubuntu 22.04 ship python3 3.10, and jammy's own python3.11 is a 3.11.0 release
# candidate, so it comes from the deadsnakes PPA (which also builds it for 24.04) where missing.
PYTHON = "python3.11"
VENV = ".venv"
_APT = "sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -y"


def _common() -> list[str]:
    return [f"--zone={FLAGS.zone}"] + ([f"--project={FLAGS.project}"] if FLAGS.project else [])


def _ssh(command: str) -> list[str]:
    base = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", FLAGS.name, *_common(), "--worker=all"]
    return base + [f"--command={command}"]


def setup_script(remote: str) -> str:
    """The bash script setup runs in ~/`remote` on every worker: python3.11 (installed where
    missing), a .venv made with it, the project and its tpu extra installed into it, and a check that
    jax sees the TPU. Every step is safe to re-run; the first failure stops it (non-zero exit)."""
    python = f"{VENV}/bin/python"
    steps = [
        "set -euo pipefail",
        f"cd {remote}",
        f'if ! {PYTHON} -c "import ensurepip, venv" 2>/dev/null; then '
        f"{_APT} update; {_APT} install software-properties-common; "
        "sudo add-apt-repository -y ppa:deadsnakes/ppa; "
        f"{_APT} install {PYTHON} {PYTHON}-venv; fi",
        f"{PYTHON} -m venv {VENV}",
        # setup.py's tpu extra: jax[tpu] and the libtpu that constraints.txt pins for its jax.
        f'{python} -m pip install -c constraints.txt -e ".[tpu]"',
        # JAX_PLATFORMS=tpu: without it jax falls back to the CPU when the TPU does not come up.
        f'JAX_PLATFORMS=tpu {python} -c "import jax; print(jax.devices())"',
    ]
    return "; ".join(steps)  # double quotes only inside, so that the dry run's quoting stays readable


def commands(subcommand: str) -> list[list[str]]:
    """The gcloud argv lists that a subcommand runs, in order."""
    vm = ["gcloud", "compute", "tpus", "tpu-vm"]
    if subcommand == "create":
        return [
            vm
            + [
                "create",
                FLAGS.name,
                *_common(),
                f"--accelerator-type={FLAGS.accelerator_type}",
                f"--version={FLAGS.runtime_version}",
            ]
        ]
    if subcommand == "delete":
        return [vm + ["delete", FLAGS.name, *_common(), "--quiet"]]
    remote = shlex.quote(FLAGS.remote_dir)
    if subcommand == "setup":
        sources = [p for p in CODE_PATHS if os.path.exists(os.path.join(ROOT, p))]
        return [
            _ssh(f"mkdir -p {remote}"),
            vm
            + ["scp", "--recurse", *sources, f"{FLAGS.name}:{FLAGS.remote_dir}/", *_common(), "--worker=all"],
            _ssh("bash -c " + shlex.quote(setup_script(remote))),
        ]
    if subcommand == "run":
        # `.` fails (and the command does not run) where setup has not made the .venv.
        return [_ssh(f"cd {remote} && . {VENV}/bin/activate && {FLAGS.command}")]
    raise AssertionError(subcommand)


def main(argv):
    if len(argv) != 2 or argv[1] not in SUBCOMMANDS:
        raise common.UsageError(f"expected one subcommand, one of {', '.join(SUBCOMMANDS)}; got {argv[1:]}")
    subcommand = argv[1]
    for flag in ("name", "zone"):
        if not FLAGS[flag].value:
            raise common.UsageError(f"--{flag} is required")
    if subcommand == "run" and not FLAGS.command:
        raise common.UsageError(
            "run needs --command, e.g. --command='python -m launch.generate --mesh=auto ...'"
        )
    argvs = commands(subcommand)
    if FLAGS.dry_run:
        for cmd in argvs:
            print(shlex.join(cmd))
        return
    if shutil.which("gcloud") is None:
        raise common.UsageError(
            "gcloud not found on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install) "
            "or pass --dry_run to print the commands"
        )
    for cmd in argvs:
        print(f"+ {shlex.join(cmd)}", flush=True)
        result = subprocess.run(cmd, cwd=ROOT)
        if result.returncode:
            raise SystemExit(result.returncode)


if __name__ == "__main__":
    common.run(main, compilation_cache=False)  # drives gcloud; compiles nothing here
