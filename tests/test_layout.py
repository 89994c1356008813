"""The code's layout keeps its rules: dependencies point one way, no function grows past ~80 lines, every package
says what it owns, and the rewrite's sub-packages keep their private names and import only what they declare."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dapple_tf", "planner", "profiler", "models", "scripts")
MAX_FUNCTION_LINES = 80
REWRITE = "dapple_tf.rewrite"  # its sub-packages keep their private names to themselves and say what they import
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


def _packages_without_a_docstring(folder: str, root: pathlib.Path = ROOT):
    """Packages (folders with an `__init__.py`) whose docstring is not at least one sentence: three words or more
    ending in a full stop."""
    sentence = re.compile(r"[A-Za-z]\w*(\W+\w+){2,}[^.]*\.(\s|$)")
    return [str(init.parent.relative_to(root)) for init in sorted((root / folder).rglob("__init__.py"))
            if not sentence.search(ast.get_docstring(ast.parse(init.read_text())) or "")]


def test_every_package_says_what_it_owns():
    assert _packages_without_a_docstring("dapple_tf") == []


def test_the_package_check_sees_a_package_that_says_nothing(tmp_path):
    for name, text in [("pkg", '"""Owns the samples."""\n'), ("pkg/empty", ""), ("pkg/word", '"""Things."""\n'),
                       ("pkg/code", 'X = "Owns nothing at all."\n'),
                       ("pkg/said", '"""A package: owns a, b and c."""\n')]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text)
    assert _packages_without_a_docstring("pkg", tmp_path) == ["pkg/code", "pkg/empty", "pkg/word"]


def _sub_package(module: str, prefix: str) -> str:
    """The sub-package of `prefix` a module is in ("" for a module directly in `prefix`)."""
    rest = module[len(prefix) + 1:].split(".")
    return rest[0] if len(rest) > 1 else ""


def _dotted(node: ast.AST):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def _private_uses_across(root: pathlib.Path = ROOT, prefix: str = REWRITE):
    """Where a module of one sub-package of `prefix` uses a private name (`_x`, not `__x__`) of a module of another
    (the modules directly in `prefix` count as one more): `from m import _x`, or `alias._x` / `a.b.m._x` with m
    imported as a module, at the top or inside functions."""
    paths = {_module_name(p, root): p for p in _modules(prefix.replace(".", "/"), root)}
    private = lambda name: name.startswith("_") and not name.endswith("__")  # noqa: E731
    found = []
    for name, path in sorted(paths.items()):
        tree, aliases, uses = ast.parse(path.read_text()), {}, []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in paths})
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in paths:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif node.module in paths and private(alias.name):
                        uses.append((node.lineno, node.module, alias.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                owner = aliases.get(_dotted(node.value), _dotted(node.value))
                if owner in paths:
                    uses.append((node.lineno, owner, node.attr))
        found += [f"{path.relative_to(root)}:{line} uses {owner}.{attr}" for line, owner, attr in sorted(uses)
                  if _sub_package(owner, prefix) != _sub_package(name, prefix)]
    return found


def test_no_rewrite_package_uses_anothers_private_names():
    assert _private_uses_across() == []


def test_the_private_name_check_sees_a_use_across_packages(tmp_path):
    files = {
        "__init__.py": "", "top.py": "_hidden = 1\n", "a/__init__.py": "", "b/__init__.py": "",
        "a/own.py": "_mine = 1\n__version__ = 1\n",
        "a/user.py": "from rw.a import own\nx = own._mine + own.__version__\n",  # one package: fine
        "b/from_import.py": "def f():\n    from rw.a.own import _mine\n",
        "b/alias.py": "from rw.a import own as o\nimport rw.a.user as u\nx = o._mine + u.x\n",
        "b/dotted.py": "import rw.a.own\nx = rw.a.own._mine\n",
        "b/top_user.py": "from rw import top\nx = top._hidden\n",
        "b/local.py": "class C:\n    _mine = 1\n\n\nx = C._mine\n",  # not a module: fine
    }
    for name, text in files.items():
        (tmp_path / "rw" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "rw" / name).write_text(text)
    assert _private_uses_across(tmp_path, "rw") == [
        "rw/b/alias.py:3 uses rw.a.own._mine", "rw/b/dotted.py:2 uses rw.a.own._mine",
        "rw/b/from_import.py:2 uses rw.a.own._mine", "rw/b/top_user.py:2 uses rw.top._hidden"]


def _undeclared_package_imports(root: pathlib.Path = ROOT, prefix: str = REWRITE):
    """Imports of one sub-package of `prefix` from another that its `__init__.py` docstring's `May import:` line
    does not name (the line's words that are sub-packages' names)."""
    folder = root / prefix.replace(".", "/")
    names = sorted(p.parent.name for p in folder.glob("*/__init__.py"))
    declared = {}
    for name in names:
        doc = ast.get_docstring(ast.parse((folder / name / "__init__.py").read_text())) or ""
        line = next((text for text in doc.splitlines() if text.startswith("May import:")), "")
        declared[name] = set(re.findall(r"\w+", line)) & set(names)
    found = []
    for module, targets in _import_graph(root, (prefix.replace(".", "/"),)).items():
        home = _sub_package(module, prefix)
        for target in targets:
            there = _sub_package(target, prefix)
            if home in declared and there in declared and there not in declared[home] | {home}:
                found.append(f"{module} imports {target}")
    return sorted(found)


def test_rewrite_packages_import_only_what_their_docstrings_name():
    assert _undeclared_package_imports() == []


def test_the_declared_imports_check_sees_an_undeclared_import(tmp_path):
    files = {"__init__.py": "", "main.py": "from rw.a import x\n",
             "a/__init__.py": '"""Owns x.\n\nMay import: b.\n"""\n',
             "a/x.py": "from rw.b import y\nfrom rw.c import z\n",
             "b/__init__.py": '"""Owns y.\n\nMay import: no other package.\n"""\n', "b/y.py": "from rw.a import x\n",
             "c/__init__.py": '"""Owns z."""\n', "c/z.py": "from rw import main\n"}  # main: not a sub-package
    for name, text in files.items():
        (tmp_path / "rw" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "rw" / name).write_text(text)
    assert _undeclared_package_imports(tmp_path, "rw") == ["rw.a.x imports rw.c.z", "rw.b.y imports rw.a.x"]


# What asks whether a device is this task's (issue 60 item 1): only the lowering and the per-host modules, in hosts/
HOST_QUESTIONS = ("is_local", "per_host", "InGraph", "HostPart", "host_part")


def _identifiers(node: ast.AST):
    """The names a node of code spells: names, attributes, arguments and keywords, definitions, imported modules."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.keyword) and node.arg:
        yield node.arg
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.alias):
        yield from node.name.split(".")
        yield from [node.asname] if node.asname else []
    elif isinstance(node, ast.ImportFrom) and node.module:
        yield from node.module.split(".")


def _host_questions(root: pathlib.Path = ROOT, prefix: str = REWRITE, allowed: str = "hosts"):
    """Where a module of `prefix` outside its sub-package `allowed` mentions one of HOST_QUESTIONS in its code (not in
    its comments or strings)."""
    folder = root / prefix.replace(".", "/")
    found = set()
    for path in _modules(prefix.replace(".", "/"), root):
        if path.relative_to(folder).parts[0] == allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for word in _identifiers(node):
                if word in HOST_QUESTIONS:
                    found.add(f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)} {word}")
    return sorted(found)


def test_only_the_lowering_asks_whether_a_device_is_this_tasks():
    """The builders of stages, reductions, transforms and the apply get the lowered program (hosts/lowering.py) and
    build for the devices it lists; they never ask whether a device is local, nor which kind of graph they build."""
    assert _host_questions() == []


def test_the_host_question_check_sees_a_builder_asking(tmp_path):
    files = {
        "__init__.py": "", "hosts/__init__.py": "", "a/__init__.py": "",
        "hosts/part.py": "class HostPart:\n    per_host = True\n\n    def is_local(self, d):\n        return True\n",
        "a/branch.py": "def f(host, d):\n    # is_local in a comment, and a string: fine\n    x = 'HostPart'\n"
                       "    return host.is_local(d)\n",
        "a/imports.py": "from rw.hosts import part as host_part\nimport rw.hosts.host_part\n",
        "a/argument.py": "def g(per_host=False):\n    return per_host\n\n\ng(per_host=True)\n",
        "top.py": "from rw.hosts.part import HostPart\n\n\nclass InGraph(HostPart):\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / "rw" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "rw" / name).write_text(text)
    assert _host_questions(tmp_path, "rw") == [
        "rw/a/argument.py:1 per_host", "rw/a/argument.py:2 per_host", "rw/a/argument.py:5 per_host",
        "rw/a/branch.py:4 is_local", "rw/a/imports.py:1 host_part", "rw/a/imports.py:2 host_part",
        "rw/top.py:1 HostPart", "rw/top.py:4 HostPart", "rw/top.py:4 InGraph"]


MAX_MODULES_PER_FOLDER = 15  # issue 60: a folder of more reads as a heap, not a room


def _crowded_folders(top: str, root: pathlib.Path = ROOT):
    """(folder, modules) of each folder under `top` holding more than MAX_MODULES_PER_FOLDER modules side by side
    (`__init__.py` not counted)."""
    folders = [root / top] + [p for p in (root / top).rglob("*") if p.is_dir() and p.name != "__pycache__"]
    for folder in folders:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_MODULES_PER_FOLDER:
            yield str(folder.relative_to(root)), count


@pytest.mark.parametrize("top", ["dapple_tf", "scripts"])
def test_no_folder_holds_more_than_fifteen_modules(top):
    assert list(_crowded_folders(top)) == []


def test_the_folder_check_sees_a_crowded_folder(tmp_path):
    crowded = tmp_path / "pkg" / "heap"
    crowded.mkdir(parents=True)
    for i in range(MAX_MODULES_PER_FOLDER + 1):
        (crowded / f"m{i}.py").write_text('"""A module."""\n')
    (tmp_path / "pkg" / "few.py").write_text('"""A module."""\n')
    assert list(_crowded_folders("pkg", tmp_path)) == [("pkg/heap", 16)]
