"""The package layering: `models` (the model, its cache and its attention) imports nothing from
`spec_jax` (the decoding algorithms built on it), so there is no cycle to work around."""

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


def test_models_imports_nothing_from_spec_jax():
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] == "spec_jax"
        )
        for path in sorted((ROOT / "models").rglob("*.py"))
    }
    offenders = {path: mods for path, mods in offenders.items() if mods}
    assert not offenders, f"models/ must not import spec_jax: {offenders}"


def test_importing_every_model_module_loads_no_spec_jax_module():
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in sorted((ROOT / "models").rglob("*.py"))
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'spec_jax'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stdout


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
