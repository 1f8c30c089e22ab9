"""The package layering, one way down: `models` (the model, its cache and its attention) imports
no other package of the project; `spec_jax` (the decoding algorithms built on it) imports only
`models`; `training` (the trained drafters' training) imports `models` and `spec_jax`, and neither
imports it. So there is no cycle between packages to work around."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (function bodies too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


# package -> the project's packages it may import (besides itself)
MAY_IMPORT = {"models": set(), "spec_jax": {"models"}, "training": {"models", "spec_jax"}}
PROJECT = {"models", "spec_jax", "training", "experiments", "launch", "scripts", "tests"}


def layering_offenders(root: pathlib.Path) -> dict[str, list[str]]:
    """{file: the project modules it imports that its package may not} over MAY_IMPORT's packages."""
    offenders = {}
    for package, allowed in MAY_IMPORT.items():
        for path in sorted((root / package).rglob("*.py")):
            bad = sorted(
                m for m in imported_modules(path) if m.split(".")[0] in PROJECT - allowed - {package}
            )
            if bad:
                offenders[str(path.relative_to(root))] = bad
    return offenders


def test_each_package_imports_only_the_packages_below_it():
    offenders = layering_offenders(ROOT)
    assert not offenders, f"imports against the layering {MAY_IMPORT}: {offenders}"


def test_the_layering_check_finds_an_upward_import(tmp_path):
    for package in MAY_IMPORT:
        (tmp_path / package).mkdir()
    (tmp_path / "spec_jax" / "x.py").write_text("def f():\n    from training import head\n")
    (tmp_path / "models" / "y.py").write_text("import spec_jax.api\n")
    assert layering_offenders(tmp_path) == {
        "models/y.py": ["spec_jax.api"],
        "spec_jax/x.py": ["training"],
    }


def test_importing_every_model_and_spec_jax_module_loads_no_module_above_it():
    """What the imports do when run (not only what the files say): importing all of models/
    loads no spec_jax or training module, and importing all of spec_jax/ loads no training one."""
    code = "import importlib, pathlib, sys\n"
    for package in ("models", "spec_jax"):
        modules = [
            ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for path in sorted((ROOT / package).rglob("*.py"))
        ]
        above = sorted(PROJECT - MAY_IMPORT[package] - {package})
        code += (
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {above!r}))\n"
        )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.split() == ["[]", "[]"], out.stdout


def test_spec_jax_has_no_lazy_import_workaround():
    tree = ast.parse((ROOT / "spec_jax" / "__init__.py").read_text())
    functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert "__getattr__" not in functions


def _module_file(name: str) -> pathlib.Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def transitive_imports(module: str) -> set[str]:
    """The modules of this repository that `module` imports, directly or through others, from
    any import statement (function bodies too; `from a import b` counts a.b where b is a module)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages' __init__
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return seen


def test_the_main_job_imports_nothing_from_experiments():
    """launch.generate (and what it imports, in any function) never reaches experiments/: the
    drafters' data (corpora, VocabTrim counts, suffix tables, trained heads) is spec_jax's."""
    reached = transitive_imports("launch.generate")
    assert "spec_jax.api" in reached and "launch.common" in reached  # the walk works
    offenders = sorted(m for m in reached if m.split(".")[0] == "experiments")
    assert not offenders, f"launch.generate reaches {offenders}"
