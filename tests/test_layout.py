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
