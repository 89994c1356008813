"""The code's layout keeps its rules: dependencies point one way, no function grows past ~80 lines."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dapple_tf", "planner", "profiler", "models", "scripts")
MAX_FUNCTION_LINES = 80
# package (or folder) -> top-level names its modules must not import
FORBIDDEN = {
    "planner": ("dapple_tf", "profiler", "scripts", "tensorflow", "models"),
    "planner/formats": ("planner.planning", "planner.simulation"),
    "dapple_tf": ("scripts", "profiler", "models"),
    "profiler": ("scripts",),
    "models": ("profiler", "scripts"),
}


def _modules(folder: str, root: pathlib.Path = ROOT):
    return sorted((root / folder).rglob("*.py"))


def _imported(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def _long_functions(folder: str, root: pathlib.Path = ROOT):
    for path in _modules(folder, root):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    yield f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_the_limit(package):
    assert list(_long_functions(package)) == []


def test_the_limit_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert list(_long_functions("pkg", tmp_path)) == [f"pkg/mod.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_dependencies_point_one_way(folder):
    bad = []
    for path in _modules(folder):
        for name in _imported(ast.parse(path.read_text())):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_every_module_says_what_it_is_for():
    missing = [str(p.relative_to(ROOT)) for package in PACKAGES for p in _modules(package)
               if not p.name.endswith("_pb2.py") and p.stat().st_size
               and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert missing == []


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: pathlib.Path = ROOT, packages=PACKAGES):
    """Module -> the project's modules it imports, at its top or inside its functions (`from a.b import c` names
    a.b.c where that is a module, else a.b; relative imports resolved)."""
    paths = {_module_name(p, root): p for package in packages for p in _modules(package, root)}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(kept + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.update([full] if full in paths else [base] if base in paths else [])
        graph[name] = found - {name}
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (each an import cycle), sorted."""
    order, low, stack, on_stack, components, counter = {}, {}, [], set(), [], [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        order[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in order:
                    order[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], order[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return sorted(components)


def test_no_import_cycle_among_the_projects_modules():
    """Function-level imports included (issue 60): the planner had one through six modules (dapple_planner ->
    plan_eval -> ties -> report -> schedule_choice -> interleave -> dapple_planner)."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "pkg" / "a.py").write_text('"""a."""\nfrom pkg import b\n')
    (tmp_path / "pkg" / "b.py").write_text('"""b."""\n\n\ndef f():\n    from . import c\n')
    (tmp_path / "pkg" / "c.py").write_text('"""c."""\nimport pkg.a\n')
    (tmp_path / "pkg" / "d.py").write_text('"""d."""\nfrom pkg.a import b\n')
    assert _cycles(_import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]
