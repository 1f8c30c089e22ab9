"""Issue 39, item 1: the package installs from a wheel and runs from any folder. The wheel holds
every file the code opens beside itself (the kernels' C++ sources: a wheel without them failed
with `FileNotFoundError: .../models/kernels/cpu_matmul.cc`), its requirements are what the main
job imports (matplotlib and scipy in the `experiments` extra, huggingface_hub in `hub`), and the
random-model quickstart runs from the installed wheel outside the checkout.

The fast tests build the wheel (setuptools, no downloads) and run the quickstart in a fresh venv
that holds the wheel and borrows its dependencies from this environment (a .pth naming its
site-packages: that folder's own .pth files, the editable install's among them, are not read).
The slow test installs the wheel and its pinned dependencies from the registry into a fresh venv
(`pip install -c constraints.txt`), as a user would."""

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from conftest import cache_with_kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("spec_jax", "models", "training", "experiments", "launch")
QUICKSTART = [
    "-m",
    "launch.generate",
    "--target=random",
    "--draft=random-draft",
    "--prompt=x",
    "--max_new_tokens=4",
]


def _tracked(root: pathlib.Path) -> list[str]:
    """The files of the checkout a source distribution would hold (git's list where there is one)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if (root / line).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "dist", "__pycache__"}
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not skip & set(p.parts)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel, built from a copy of the checkout's files (no build/ or egg-info left here)."""
    src = tmp_path_factory.mktemp("src")
    for rel in _tracked(ROOT):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        str(src),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.glob("spec_jax-*.whl")
    return path


def _read_beside_code() -> set[str]:
    """The files the packages' code opens beside itself: each `pathlib.Path(__file__)...
    .with_name("NAME")` and every non-Python file tracked in a package folder but experiments'
    results (outputs, not inputs)."""
    names = set()
    for rel in _tracked(ROOT):
        if rel.split("/")[0] not in PACKAGES or rel.startswith("experiments/results/"):
            continue
        if not rel.endswith(".py"):
            names.add(rel)
            continue
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "with_name" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "." in arg.value:
                    names.add(str(pathlib.PurePosixPath(rel).with_name(arg.value)))
    return names


def test_the_wheel_holds_every_file_the_code_opens_beside_itself(wheel):
    held = set(zipfile.ZipFile(wheel).namelist())
    needed = _read_beside_code()
    assert "models/kernels/cpu_matmul.cc" in needed and "models/kernels/cpu_parallel.h" in needed
    assert not needed - held, sorted(needed - held)
    modules = {rel for rel in _tracked(ROOT) if rel.split("/")[0] in PACKAGES and rel.endswith(".py")}
    assert not modules - held, sorted(modules - held)


def test_the_wheel_has_the_command_that_builds_the_cpu_kernels_ahead_of_the_first_run(wheel):
    """Issue 53: `pip install .` users build the GGUF kernel at set-up as `make demo` does."""
    (name,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/entry_points.txt")]
    entries = zipfile.ZipFile(wheel).read(name).decode()
    assert "spec-jax-build-kernels = models.kernels.build:cli" in entries, entries


def test_the_wheel_requires_only_what_the_main_job_imports(wheel):
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    lines = zipfile.ZipFile(wheel).read(meta).decode().splitlines()
    requires = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    plain = {r.split(";")[0].split(">")[0].split("=")[0].strip() for r in requires if "extra ==" not in r}
    extras = {r.split("extra ==")[1].strip(" '\"") for r in requires if "extra ==" in r}
    assert not {"matplotlib", "scipy", "huggingface_hub", "torch", "transformers"} & plain, plain
    assert {"experiments", "hub", "test"} <= extras
    assert any(r.startswith("matplotlib") and "experiments" in r for r in requires)
    assert any(r.startswith("huggingface_hub") and "hub" in r for r in requires)


def _fresh_venv(folder: pathlib.Path, borrow: bool) -> pathlib.Path:
    """A new venv at folder (no pip); with `borrow`, this environment's site-packages on its path
    (through a .pth: the folder's own .pth files, such as an editable install's, are not read).
    Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    if borrow:
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        (pathlib.Path(site) / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _quickstart(python: pathlib.Path, where: pathlib.Path, cache: pathlib.Path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(JAX_PLATFORMS="cpu", SPEC_JAX_CACHE=str(cache), SPEC_JAX_COMPILATION_CACHE="0")
    return subprocess.run(
        [str(python), *QUICKSTART], cwd=where, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_quickstart_runs_from_the_installed_wheel_outside_the_checkout(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv", borrow=True)
    install = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        str(wheel),
    ]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    where = tmp_path / "elsewhere"
    where.mkdir()
    probe = subprocess.run(
        [str(python), "-c", "import models, launch, spec_jax; print(models.__file__)"],
        cwd=where, capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert str(tmp_path / "venv") in probe.stdout, (
        probe.stdout + probe.stderr
    )  # the wheel's, not the checkout's
    result = _quickstart(python, where, cache_with_kernels(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speculative (model): 4 tokens" in result.stdout, result.stdout


@pytest.mark.slow
def test_a_fresh_venv_installs_the_wheel_with_its_pinned_requirements_and_runs_the_quickstart(
    wheel, tmp_path
):
    """From the registry (pip's cache where it has the files): minutes, hence the slow tier."""
    folder = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
    python = folder / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheel)]
    result = subprocess.run(install, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    where = tmp_path / "elsewhere"
    where.mkdir()
    result = _quickstart(
        python, where, tmp_path / "cache"
    )  # an empty cache: the kernel is built from the wheel's source
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speculative (model): 4 tokens" in result.stdout, result.stdout
