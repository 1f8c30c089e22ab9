"""The package layering, one way down: `models` (the model, its cache and its attention) imports
no other package of the project; `spec_jax` (the decoding algorithms built on it) imports only
`models`; `training` (the trained drafters' training) imports `models` and `spec_jax`, and neither
imports it. So there is no cycle between packages to work around.

Below, what belongs where: spec_jax/ is the inference library (no module of it that only
experiments/, scripts/ or training/ import; no optax), and the size limits (files of spec_jax/,
functions outside tests/) and the imports inside function bodies, with allow-lists that can only
shrink."""

import ast
import pathlib
import subprocess
import sys

from test_import_cycles import import_graph

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
    drafters' data (models.corpora; VocabTrim counts and suffix tables, spec_jax.drafting.tables;
    trained heads) is the library's."""
    reached = transitive_imports("launch.generate")
    assert "spec_jax.api" in reached and "launch.common" in reached  # the walk works
    offenders = sorted(m for m in reached if m.split(".")[0] == "experiments")
    assert not offenders, f"launch.generate reaches {offenders}"


# spec_jax/ is the inference library (models in, tokens out): what only experiments, scripts or
# training use lives there, and nothing in it trains.
LIBRARY_USERS = ("models", "spec_jax", "launch")  # importers that make a spec_jax module the library's
SIDE_USERS = ("experiments", "scripts", "training")


def side_only_modules(root: pathlib.Path) -> list[str]:
    """The modules of spec_jax/ that nothing in LIBRARY_USERS imports (function bodies too) but
    something in SIDE_USERS does: they belong in experiments/ or training/."""
    graph = import_graph(root, LIBRARY_USERS + SIDE_USERS)
    importers: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            importers.setdefault(target, set()).add(module.split(".")[0])
    return sorted(
        m
        for m in graph
        if m.split(".")[0] == "spec_jax" and importers.get(m) and not importers[m] & set(LIBRARY_USERS)
    )


def test_no_spec_jax_module_serves_only_experiments_scripts_or_training():
    offenders = side_only_modules(ROOT)
    assert not offenders, f"spec_jax modules only experiments/, scripts/ or training/ import: {offenders}"


def test_the_side_use_check_finds_a_module_only_an_experiment_imports(tmp_path):
    for package in LIBRARY_USERS + SIDE_USERS:
        (tmp_path / package).mkdir()
    (tmp_path / "spec_jax" / "loop.py").write_text("")
    (tmp_path / "spec_jax" / "bench_only.py").write_text("")
    (tmp_path / "launch" / "generate.py").write_text("from spec_jax import loop\n")
    (tmp_path / "experiments" / "table.py").write_text("def f():\n    import spec_jax.bench_only\n")
    assert side_only_modules(tmp_path) == ["spec_jax.bench_only"]


def test_spec_jax_imports_no_optimizer():
    """Training (optax) lives in training/; the inference library never imports it."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.split(".")[0] == "optax")
        for path in sorted((ROOT / "spec_jax").rglob("*.py"))
    }
    assert not {k: v for k, v in offenders.items() if v}


# Size limits. Each allow-list names today's offenders in files other work owns (issue 40's
# restructuring of autogamma, api, speculative, gguf_loader and launch/generate), with today's
# size as a ceiling: an offender may shrink, not grow, and no new one may join. Delete an entry
# when its file is split; never add one.
MAX_FILE_LINES = 400
FILE_LINES_ALLOWED: dict[str, int] = {}
MAX_FUNCTION_LINES = 60
FUNCTION_LINES_ALLOWED = {
    "spec_jax/speculative.py:spec_round": 77,
    "spec_jax/speculative.py:tree_round": 61,
}


def long_functions(root: pathlib.Path, folders=PROJECT - {"tests"}) -> dict[str, int]:
    """{"path:qualified.name": lines} of every function or method over MAX_FUNCTION_LINES lines
    (decorators not counted, its docstring counted) in the .py files under `folders`."""
    found = {}
    for folder in sorted(folders):
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            stack = [(node, "") for node in tree.body]
            while stack:
                node, prefix = stack.pop()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{node.name}"
                    stack += [(child, f"{name}.") for child in node.body]
                    lines = node.end_lineno - node.lineno + 1
                    if not isinstance(node, ast.ClassDef) and lines > MAX_FUNCTION_LINES:
                        found[f"{path.relative_to(root)}:{name}"] = lines
    return found


def _over(found: dict[str, int], allowed: dict[str, int]) -> dict[str, int]:
    return {k: n for k, n in found.items() if n > allowed.get(k, 0)}


def test_no_function_over_60_lines_outside_tests():
    """`python -c 'import tests.test_layering as t; print(t.long_functions(t.ROOT))'` lists them."""
    offenders = _over(long_functions(ROOT), FUNCTION_LINES_ALLOWED)
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (split them into steps): {offenders}"


def test_no_spec_jax_file_over_400_lines():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "spec_jax").rglob("*.py")
    }
    offenders = _over({k: n for k, n in sizes.items() if n > MAX_FILE_LINES}, FILE_LINES_ALLOWED)
    assert not offenders, f"spec_jax files over {MAX_FILE_LINES} lines (split them by job): {offenders}"


def test_the_size_checks_find_a_long_function_and_a_grown_offender(tmp_path):
    (tmp_path / "models").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "models" / "m.py").write_text(
        f"class C:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    )
    (tmp_path / "models" / "n.py").write_text(f"def short():\n{body[: -len(body.splitlines()[-1]) - 1]}")
    found = long_functions(tmp_path, {"models"})
    assert found == {"models/m.py:C.f": MAX_FUNCTION_LINES + 1}
    assert _over(found, {"models/m.py:C.f": MAX_FUNCTION_LINES + 1}) == {}
    assert _over(found, {"models/m.py:C.f": MAX_FUNCTION_LINES}) == found


# Imports inside function bodies, per folder: at most this many, each with a comment on its
# line saying why it is late (an optional dependency, a measured start-up cost, a cycle). models/:
# models.load's import of models.convert (run as `python -m models.convert`, which warns when
# the package imported it already) and models.sources' optional huggingface_hub.
LATE_IMPORTS_ALLOWED = {"models": 2}


def late_imports(root: pathlib.Path, folder: str) -> dict[str, str]:
    """{"path:line": the line} of every import statement inside a function body under `folder`."""
    found = {}
    for path in sorted((root / folder).rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        found[f"{path.relative_to(root)}:{node.lineno}"] = lines[node.lineno - 1]
    return found


def test_models_imports_at_the_top_except_a_few_late_imports_each_saying_why():
    for folder, allowed in LATE_IMPORTS_ALLOWED.items():
        found = late_imports(ROOT, folder)
        assert len(found) <= allowed, f"{folder}/: {len(found)} imports in function bodies: {found}"
        silent = [k for k, line in found.items() if "#" not in line]
        assert not silent, f"late imports without a comment saying why: {silent}"


def test_the_late_import_check_finds_an_import_in_a_nested_function(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.py").write_text(
        "import os\n\n\ndef f():\n    def g():\n        import json  # why\n\n    from os import path\n"
    )
    assert late_imports(tmp_path, "models") == {
        "models/m.py:6": "        import json  # why",
        "models/m.py:8": "    from os import path",
    }
