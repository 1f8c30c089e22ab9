"""The package layering, one way down: `models` (the model, its cache and its attention) imports
no other package of the project; `spec_jax` (the decoding algorithms built on it) imports only
`models`; `training` (the trained drafters' training) imports `models` and `spec_jax`, and neither
imports it. So there is no cycle between packages to work around.

Below, what belongs where: spec_jax/ is the inference library (no module of it that only
experiments/, scripts/ or training/ import; no optax), and the size limits (files of spec_jax/,
functions outside tests/) and the imports inside function bodies, with allow-lists that can only
shrink; and the order of spec_jax's own modules (SPEC_JAX_LAYERS)."""

import ast
import io
import pathlib
import subprocess
import sys
import tokenize

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


# Inside spec_jax the arrows run one way too. Its modules in layers, bottom first (a name is a
# module of spec_jax/ or a subpackage, all its modules; "__init__" is spec_jax/__init__.py): a
# module imports only spec_jax modules of its own layer or below, so the drafters import nothing
# of the gamma/tree policy (which uses them through Drafter), and the loop knows nothing of the
# caches of compiled programs. A new module takes its place here.
SPEC_JAX_LAYERS = (
    # the pieces: the warp and draws, the kept tokens' logprobs, the rule, prefill and commit,
    # metrics, closed forms, placement on a mesh, timing, a trained head's checkpoint
    (
        "sampling",
        "logprobs",
        "tree",
        "verify",
        "decode",
        "row_prefill",
        "metrics",
        "theory",
        "sharding",
        "timing",
        "head_checkpoint",
    ),
    ("prefix_cache",),  # prompt prefixes' keys and values, kept in blocks (decode reads them)
    ("drafting",),  # what proposes drafts (Drafter and every drafter)
    ("state",),  # the loop's state and static settings
    ("rounds",),  # a round's bodies: a chain or a tree
    ("speculative",),  # the loop
    ("autogamma", "executables"),  # gamma=auto (its costs, controllers and chunking); compiled programs
    # one request's checks and admission; a call's bounds; one call's compiled programs; the
    # engine's rows on the host and their operations on device memory
    ("request", "bounds", "runner", "rows", "row_ops"),
    ("updates", "chunks"),  # what the engine hands back; its chunks of rounds
    ("prefiller",),  # the engine's prefills (the prefix cache, kept rows, a long prompt's pieces)
    ("table",),  # the engine's table: the loop state over its busy rows
    ("plan",),  # what decides a run: options, the gamma policy, a call's and the engine's plan
    ("engine",),
    ("api", "__init__"),  # generate and stream (on an Engine)
)


def spec_jax_layer(module: str) -> int | None:
    """The index in SPEC_JAX_LAYERS of a spec_jax module (dotted), or None if it has no place."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return next((i for i, layer in enumerate(SPEC_JAX_LAYERS) if name in layer), None)


def spec_jax_imports(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    """The spec_jax modules the file imports, in any function too (`from spec_jax import tree`
    names spec_jax.tree; `from spec_jax import generate`, the package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "spec_jax")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "spec_jax"
        ):
            for alias in node.names:
                sub = root.joinpath(*node.module.split("."), alias.name)
                is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
                names.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return names


def spec_jax_order_offenders(root: pathlib.Path) -> dict[str, list[str]]:
    """{file: the spec_jax modules it imports from a layer above its own} over spec_jax/, and
    {file: ["no layer"]} for a module SPEC_JAX_LAYERS does not place."""
    found = {}
    for path in sorted((root / "spec_jax").rglob("*.py")):
        name = path.relative_to(root)
        layer = spec_jax_layer(".".join(name.with_suffix("").parts).removesuffix(".__init__"))
        imports = spec_jax_imports(path, root)
        found[str(name)] = (
            ["no layer"] if layer is None else sorted(m for m in imports if (spec_jax_layer(m) or 0) > layer)
        )
    return {name: above for name, above in found.items() if above}


def test_spec_jax_modules_import_only_their_own_layer_or_below():
    offenders = spec_jax_order_offenders(ROOT)
    assert not offenders, f"imports against the order of SPEC_JAX_LAYERS: {offenders}"


def test_the_order_check_finds_a_drafter_importing_the_policy_and_the_loop_importing_executables(tmp_path):
    (tmp_path / "spec_jax" / "drafting").mkdir(parents=True)
    for name in ("sampling", "autogamma", "executables", "api"):
        (tmp_path / "spec_jax" / f"{name}.py").write_text("from spec_jax import sampling\n")
    (tmp_path / "spec_jax" / "drafting" / "base.py").write_text(
        "def f():\n    from spec_jax import autogamma\n"
    )
    (tmp_path / "spec_jax" / "drafting" / "ok.py").write_text("from spec_jax.sampling import warp\n")
    (tmp_path / "spec_jax" / "speculative.py").write_text(
        "import spec_jax.executables\nfrom spec_jax import api\n"
    )
    (tmp_path / "spec_jax" / "unplaced.py").write_text("")
    assert spec_jax_order_offenders(tmp_path) == {
        "spec_jax/drafting/base.py": ["spec_jax.autogamma"],
        "spec_jax/speculative.py": ["spec_jax.api", "spec_jax.executables"],
        "spec_jax/unplaced.py": ["no layer"],
    }


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
MAX_FILE_LINES = 300  # issue 54: split by concept, not by size
FILE_LINES_ALLOWED: dict[str, int] = {}
MAX_FUNCTION_LINES = 60
FUNCTION_LINES_ALLOWED: dict[str, int] = {}


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


def test_no_spec_jax_file_over_300_lines():
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


# Imports at the top of the module (issue 40), except where a measured start-up cost or an
# optional dependency needs a late one; then a comment on the import's line, or on the line just
# above it (or above the run of import lines it ends), says which. The ceilings are today's
# counts and may only shrink (issue 40's goal: under 30 in all, from 188).
LATE_IMPORT_CEILINGS = {
    "spec_jax": 3,
    "models": 2,
    "launch": 7,  # 6, and matplotlib's for a figure, moved with the results writer from experiments/
    "experiments": 0,
    "scripts": 1,
    "training": 0,
}


def late_imports(root: pathlib.Path, folders) -> dict[str, list[tuple[str, bool]]]:
    """{folder: [("path:line", whether a comment says why), ...]} for every import statement
    inside a function body (methods and nested functions too) in the .py files under `folders`."""
    found = {}
    for folder in folders:
        found[folder] = []
        for path in sorted((root / folder).rglob("*.py")):
            source = path.read_text()
            commented = {
                tok.start[0]
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT
            }
            lines = source.splitlines()
            comment_lines = {n for n in commented if lines[n - 1].lstrip().startswith("#")}
            imports = [
                node
                for function in ast.walk(ast.parse(source, filename=str(path)))
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                for node in ast.walk(function)
                if isinstance(node, (ast.Import, ast.ImportFrom))
            ]
            import_lines = {n for node in imports for n in range(node.lineno, node.end_lineno + 1)}
            for node in sorted(set(imports), key=lambda n: n.lineno):
                first = node.lineno
                while first - 1 in import_lines:  # the run of import lines this one ends
                    first -= 1
                says_why = first - 1 in comment_lines or any(
                    n in commented for n in range(node.lineno, node.end_lineno + 1)
                )
                found[folder].append((f"{path.relative_to(root)}:{node.lineno}", says_why))
    return found


def test_late_imports_are_few_and_each_says_why():
    found = late_imports(ROOT, LATE_IMPORT_CEILINGS)
    uncommented = [where for imports in found.values() for where, says_why in imports if not says_why]
    assert not uncommented, (
        f"late imports without a comment saying why (start-up cost or optional): {uncommented}"
    )
    assert sum(LATE_IMPORT_CEILINGS.values()) < 30
    over = {f: [w for w, _ in found[f]] for f, n in LATE_IMPORT_CEILINGS.items() if len(found[f]) > n}
    assert not over, f"more late imports than the ceilings {LATE_IMPORT_CEILINGS} (import at the top): {over}"


def test_the_late_import_check_finds_an_uncommented_one(tmp_path):
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "m.py").write_text(
        "import os  # module level: not counted\n"
        "\n"
        "def a():\n"
        "    import json\n"
        "\n"
        "def b():\n"
        "    # optional: torch\n"
        "    import torch\n"
        "    import transformers\n"
        "\n"
        "    import sys\n"
        "\n"
        "class C:\n"
        "    def m(self):\n"
        "        def inner():\n"
        "            from gguf import (  # optional: gguf\n"
        "                quants,\n"
        "            )\n"
        "        x = '# not a comment'; import csv\n"
    )
    assert late_imports(tmp_path, ["launch"]) == {
        "launch": [
            ("launch/m.py:4", False),
            ("launch/m.py:8", True),
            ("launch/m.py:9", True),
            ("launch/m.py:11", False),
            ("launch/m.py:16", True),
            ("launch/m.py:19", False),
        ]
    }


# Issue 54 item 4: a thin launch layer. launch/'s modules import one another one way (function
# bodies too: launch.common's late import of launch.runtime counts), the server shares
# launch.flags with launch.generate instead of importing it, training's command line reaches
# nothing of experiments/, and launch.generate reads as flags -> requests -> engine -> output.
from test_import_cycles import cycles  # noqa: E402

LAUNCH_GENERATE_MAX_LINES = 350


def reached_from(root: pathlib.Path, module: str, packages=("launch",)) -> set[str]:
    """The modules of `packages` under root that `module` imports, directly or through others
    (test_import_cycles.import_graph: any import statement, function bodies included)."""
    graph = import_graph(root, packages)
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen and name in graph:
            seen.add(name)
            todo += graph[name]
    return seen - {module}


def test_no_import_circle_among_launch_modules():
    found = [sorted(c) for c in cycles(import_graph(ROOT, ("launch",)))]
    assert not found, f"import circles in launch/ (make the imports point one way): {found}"


def test_the_launch_circle_check_finds_one_through_a_late_import(tmp_path):
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "common.py").write_text("def run():\n    from launch import runtime\n")
    (tmp_path / "launch" / "runtime.py").write_text("from launch import common\n")
    (tmp_path / "launch" / "usage.py").write_text("")
    assert cycles(import_graph(tmp_path, ("launch",))) == [frozenset({"launch.common", "launch.runtime"})]
    (tmp_path / "launch" / "runtime.py").write_text("from launch import usage\n")
    assert cycles(import_graph(tmp_path, ("launch",))) == []


def test_launch_serve_does_not_import_launch_generate():
    reached = reached_from(ROOT, "launch.serve")
    assert "launch.flags" in reached  # the walk works: the shared flags are reached
    assert "launch.generate" not in reached, "launch.serve reaches launch.generate"


def test_the_serve_check_finds_generate_reached_through_another_module(tmp_path):
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "serve.py").write_text("from launch import flags\n")
    (tmp_path / "launch" / "flags.py").write_text("def f():\n    from launch.generate import FLAGS\n")
    (tmp_path / "launch" / "generate.py").write_text("")
    assert "launch.generate" in reached_from(tmp_path, "launch.serve")
    (tmp_path / "launch" / "flags.py").write_text("")
    assert "launch.generate" not in reached_from(tmp_path, "launch.serve")


def experiments_reached(root: pathlib.Path, module: str) -> list[str]:
    """The modules of experiments/ that `module` reaches through any package of the project."""
    reached = reached_from(root, module, ("launch", "experiments", "training", "models", "spec_jax"))
    return sorted(m for m in reached if m.split(".")[0] == "experiments")


def test_launch_train_imports_nothing_of_experiments():
    assert "launch.common" in reached_from(ROOT, "launch.train")  # the walk works
    offenders = experiments_reached(ROOT, "launch.train")
    assert not offenders, f"launch.train reaches {offenders}"


def test_the_train_check_finds_experiments_reached_through_launch(tmp_path):
    for package in ("launch", "experiments", "training", "models", "spec_jax"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "launch" / "train.py").write_text("from launch import runner\nimport training\n")
    (tmp_path / "launch" / "runner.py").write_text("def run():\n    from experiments import framework\n")
    (tmp_path / "experiments" / "framework.py").write_text("")
    assert experiments_reached(tmp_path, "launch.train") == ["experiments.framework"]
    (tmp_path / "launch" / "runner.py").write_text("import training\n")
    assert experiments_reached(tmp_path, "launch.train") == []


def generate_over(root: pathlib.Path) -> int | None:
    """launch/generate.py's line count where it is over LAUNCH_GENERATE_MAX_LINES, else None."""
    lines = len((root / "launch" / "generate.py").read_text().splitlines())
    return lines if lines > LAUNCH_GENERATE_MAX_LINES else None


def test_launch_generate_is_at_most_350_lines():
    assert generate_over(ROOT) is None, (
        f"launch/generate.py is {generate_over(ROOT)} lines: flags -> requests -> engine -> output "
        f"fits in {LAUNCH_GENERATE_MAX_LINES} (shared flags: launch/flags.py; the loader: launch/loading.py)"
    )


def test_the_generate_size_check_finds_a_long_file(tmp_path):
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "generate.py").write_text("x = 1\n" * LAUNCH_GENERATE_MAX_LINES)
    assert generate_over(tmp_path) is None
    (tmp_path / "launch" / "generate.py").write_text("x = 1\n" * (LAUNCH_GENERATE_MAX_LINES + 1))
    assert generate_over(tmp_path) == LAUNCH_GENERATE_MAX_LINES + 1


# Drafters say what gamma=auto times (Drafter.timed_call: their model call as data) and import
# nothing of gamma=auto or of the timing helpers: spec_jax.autogamma times and prices their calls.
COST_SIDE = ("spec_jax.autogamma", "spec_jax.timing")


def drafting_cost_imports(root: pathlib.Path) -> dict[str, list[str]]:
    """{file: the modules of gamma=auto or timing it imports (function bodies too)} over
    spec_jax/drafting/."""
    found = {}
    for path in sorted((root / "spec_jax" / "drafting").rglob("*.py")):
        names = spec_jax_imports(path, root) | imported_modules(path)
        bad = sorted(m for m in names if any(m == c or m.startswith(c + ".") for c in COST_SIDE))
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def test_no_drafter_imports_gamma_auto_or_timing():
    offenders = drafting_cost_imports(ROOT)
    assert not offenders, (
        f"drafters importing gamma=auto or timing (describe the call: timed_call): {offenders}"
    )


def test_the_drafter_check_finds_a_drafter_that_times_its_own_call(tmp_path):
    drafting = tmp_path / "spec_jax" / "drafting"
    (drafting / "sub").mkdir(parents=True)
    (tmp_path / "spec_jax" / "autogamma").mkdir()
    (tmp_path / "spec_jax" / "autogamma" / "costs.py").write_text("")
    (tmp_path / "spec_jax" / "timing.py").write_text("")
    (drafting / "model.py").write_text("from spec_jax import sharding, timing\n")
    (drafting / "head.py").write_text("def f():\n    from spec_jax.autogamma import costs\n")
    (drafting / "sub" / "x.py").write_text("import spec_jax.autogamma\n")
    (drafting / "ok.py").write_text("from spec_jax.drafting.base import TimedCall\nimport timing_lib\n")
    assert drafting_cost_imports(tmp_path) == {
        "spec_jax/drafting/head.py": ["spec_jax.autogamma", "spec_jax.autogamma.costs"],
        "spec_jax/drafting/model.py": ["spec_jax.timing"],
        "spec_jax/drafting/sub/x.py": ["spec_jax.autogamma"],
    }


# gamma=auto's face: spec_jax/ (outside the package) and launch/ import spec_jax.autogamma itself,
# never one of its modules, and the package exports only what they use.
FACE_CALLERS = ("spec_jax", "launch")


def autogamma_face_offenders(root: pathlib.Path) -> tuple[dict[str, list[str]], list[str]]:
    """({file: the modules of spec_jax.autogamma it imports past the package's __init__} over
    FACE_CALLERS' files outside the package, [the names of the package's __all__ none of them
    uses: `from spec_jax.autogamma import X` or `autogamma.X`])."""
    package = root / "spec_jax" / "autogamma"
    reach_ins, used = {}, set()
    for folder in FACE_CALLERS:
        for path in sorted((root / folder).rglob("*.py")):
            if package in path.parents:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            inner = sorted(m for m in imported_modules(path) if m.startswith("spec_jax.autogamma."))
            inner += sorted(
                f"spec_jax.autogamma.{a.name}"
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "spec_jax.autogamma"
                for a in node.names
                if (package / f"{a.name}.py").is_file()
            )
            if inner:
                reach_ins[str(path.relative_to(root))] = inner
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "spec_jax.autogamma":
                    used.update(a.name for a in node.names)
                elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "autogamma":
                    used.add(node.attr)
    exported = ast.literal_eval(
        next(
            node.value
            for node in ast.parse((package / "__init__.py").read_text()).body
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__"
        )
    )
    return reach_ins, sorted(set(exported) - used)


def test_gamma_auto_is_called_through_its_face_only():
    reach_ins, unused = autogamma_face_offenders(ROOT)
    assert not reach_ins, f"callers importing spec_jax.autogamma's modules (use the package): {reach_ins}"
    assert not unused, f"spec_jax.autogamma exports names no caller uses: {unused}"


def test_the_face_check_finds_a_reach_in_and_an_unused_export(tmp_path):
    package = tmp_path / "spec_jax" / "autogamma"
    package.mkdir(parents=True)
    (tmp_path / "launch").mkdir()
    (package / "__init__.py").write_text('from spec_jax.autogamma.costs import a, b\n__all__ = ["a", "b"]\n')
    (package / "costs.py").write_text("from spec_jax.autogamma import controller\n")  # inside: allowed
    (package / "controller.py").write_text("")
    (tmp_path / "spec_jax" / "plan.py").write_text("from spec_jax import autogamma\nx = autogamma.a\n")
    (tmp_path / "launch" / "serve.py").write_text("def f():\n    from spec_jax.autogamma import costs\n")
    reach_ins, unused = autogamma_face_offenders(tmp_path)
    assert reach_ins == {"launch/serve.py": ["spec_jax.autogamma.costs"]}
    assert unused == ["b"]
    (tmp_path / "launch" / "serve.py").write_text("from spec_jax.autogamma import b\n")
    assert autogamma_face_offenders(tmp_path) == ({}, [])


def row_ops_importers(root: pathlib.Path) -> set[str]:
    """The project files (tests aside) that import spec_jax.row_ops, the table's row operations
    on device memory."""
    found = set()
    for folder in sorted(PROJECT - {"tests"}):
        for path in sorted((root / folder).rglob("*.py")):
            names = imported_modules(path)
            if "spec_jax.row_ops" in names or ("spec_jax" in names and "row_ops" in _from_spec_jax(path)):
                found.add(str(path.relative_to(root)))
    return found


def _from_spec_jax(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "spec_jax"
        for a in n.names
    }


def test_every_row_operation_on_device_memory_is_a_table_method():
    """Issue 54's one admission: only spec_jax/table.py imports spec_jax.row_ops (its methods
    are the row operations: resize, move, write, free, keep, counters)."""
    assert row_ops_importers(ROOT) == {"spec_jax/table.py"}


def test_the_row_ops_check_finds_another_importer(tmp_path):
    (tmp_path / "spec_jax").mkdir()
    (tmp_path / "spec_jax" / "table.py").write_text("from spec_jax import row_ops\n")
    (tmp_path / "spec_jax" / "engine.py").write_text("from spec_jax.row_ops import resize_jit\n")
    assert row_ops_importers(tmp_path) == {"spec_jax/table.py", "spec_jax/engine.py"}
