"""No import circles: the modules of models/, spec_jax/ and training/ import one another one way
(the graph of their import statements, read with ast and not run, function bodies included, has
no cycle), as tests/test_layering.py checks it between the packages."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("models", "spec_jax", "training")


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def import_graph(root: pathlib.Path, packages=PACKAGES) -> dict[str, set[str]]:
    """{module: the project modules its import statements name} over the packages' modules. `from
    a.b import c` names a.b.c where that is a module, else a.b; a package's own __init__ is not
    counted as imported by its submodules' imports of siblings."""
    modules = {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_models_spec_jax_or_training_imports_itself_through_others():
    found = [sorted(c) for c in cycles(import_graph(ROOT))]
    assert not found, f"import cycles (make the imports point one way): {found}"


def test_the_cycle_check_finds_a_cycle_through_a_function_body_import(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "a.py").write_text("from models import b\n")
    (tmp_path / "models" / "b.py").write_text("def f():\n    from models.c import x\n")
    (tmp_path / "models" / "c.py").write_text("import models.a\n")
    (tmp_path / "models" / "d.py").write_text("from models import a\n")
    graph = import_graph(tmp_path, ("models",))
    assert cycles(graph) == [frozenset({"models.a", "models.b", "models.c"})]
