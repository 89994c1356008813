"""The docs (docs/*.md; README.md's example runs in test_readme.py) say what the code does.

- every ```python block runs, in a fresh interpreter and an empty folder (each sets up its own devices). A block
  whose first line is `# needs: tf.estimator` runs only where the estimator is installed; one whose first line is
  `# not run: WHY` (only where running is impossible) is compiled, its imports run and the dotted names it uses
  from imported modules must exist;
- every command in a ```bash block or an inline code span that runs a program of this repository names an existing
  program (`dapple_*`, `python -m scripts.bench.*`, `make` targets, files), its `--help` exits 0 and each `--flag`
  it passes is one the program defines (from `--helpfull`, which is cheap); the user guide's flag tables too;
- every relative link and image points to an existing file (and heading, for `#anchors`);
- README.md is at most 120 lines and WORKSPACE_NOTES.md at most 250; names that no longer exist are not used.
"""

import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "WORKSPACE_NOTES.md"] + DOCS
RUN_TIMEOUT_S = 300

NEEDS_ESTIMATOR = "# needs: tf.estimator"
NOT_RUN = "# not run:"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(path: Path, language: str):
    """(line number, text) of each ```language block of a page."""
    text = path.read_text()
    for match in re.finditer(r"^```" + language + r"\n(.*?)^```", text, re.S | re.M):
        yield text[:match.start()].count("\n") + 1, match.group(1)


def python_blocks():
    return [pytest.param(path, line, code, id=f"{rel(path)}:{line}")
            for path in DOCS for line, code in fenced_blocks(path, "python")]


def child_env(home: Path) -> dict:
    return {"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin", "HOME": str(home),
            "MPLBACKEND": "Agg"}


@pytest.mark.parametrize("path,line,code", python_blocks())
def test_python_block_runs(path, line, code, tmp_path):
    first = code.lstrip().splitlines()[0]
    if first.startswith(NOT_RUN):
        check_not_run_block(code, tmp_path)
        return
    if first.startswith(NEEDS_ESTIMATOR) and importlib.util.find_spec("tensorflow_estimator") is None:
        pytest.skip("tf.estimator is not installed in this environment (primary environment only)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, env=child_env(tmp_path))
    assert result.returncode == 0, f"{rel(path)}:{line} failed:\n{result.stderr[-3000:]}"


def check_not_run_block(code: str, tmp_path: Path):
    compile(code, "<doc block>", "exec")
    imports = [line for line in code.splitlines() if re.match(r"^(import|from) \S+", line)]
    modules = set()
    for line in imports:
        m = re.match(r"^import (\S+)(?: as (\w+))?$", line)
        if m:
            modules.add(m.group(2) or m.group(1).split(".")[0])
    names = sorted({n for n in re.findall(r"\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)", code)
                    if n.split(".")[0] in modules and not n.startswith(tuple(f"{i}." for i in ("horovod",)))})
    probe = "\n".join(imports) + "\n" + "".join(f"assert {name} is not None, {name!r}\n" for name in names)
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, env=child_env(tmp_path))
    if "No module named 'horovod'" in result.stderr:
        pytest.skip("horovod is not installed in this environment (primary environment only)")
    assert result.returncode == 0, f"imports or names of a block not run:\n{result.stderr[-3000:]}"


def test_horovod_names_in_the_user_guide_exist():
    from dapple_tf.frontends import horovod  # no horovod import at module level

    for method in ("local_slice", "build", "broadcast_hook"):
        assert hasattr(horovod.HorovodPipeline, method), method
    assert "horovod" in dapple_tf_trainer_parameters()


def dapple_tf_trainer_parameters():
    import inspect

    import dapple_tf

    return inspect.signature(dapple_tf.Trainer.__init__).parameters


# ----- commands -----

PROGRAM = re.compile(r"(?:^|\s)(?:\S*/)?(dapple_(?:profile|plan|simulate|train|launch|demo))(?=\s|$)|"
                     r"python -m (scripts\.bench\.\w+\.\w+|scripts\.bench\.\w+|scripts\.\w+)(?=\s|$)")
FLAG = re.compile(r"(?:^|[\s\[])--(?:\[no\])?([a-z][a-z0-9_]*)")


def commands():
    """(page:line, command) of each program invocation in ```bash blocks and inline code spans."""
    found = []
    for path in PAGES:
        for line, block in fenced_blocks(path, "bash"):
            joined = block.replace("\\\n", " ")
            for i, command in enumerate(joined.splitlines()):
                command = re.sub(r"\s+#.*$", "", command).strip()
                if command:
                    found.append((f"{rel(path)}:{line + i}", command))
        text = path.read_text()
        text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for match in re.finditer(r"`([^`]+)`", text):
            span = " ".join(match.group(1).split())
            if PROGRAM.search(span) or span.startswith("make "):
                found.append((f"{rel(path)}:{text[:match.start()].count(chr(10)) + 1}", span))
    return found


def invocations(command: str):
    """(program, flags) of each program a command runs: `dapple_launch ... -- dapple_train ...` runs two."""
    for part in re.split(r"\s--\s", " " + command + " "):
        match = PROGRAM.search(part)
        if not match:
            continue
        program = match.group(1) or match.group(2)
        yield program, FLAG.findall(part[match.end():])


@functools.lru_cache(maxsize=None)
def helpfull(program: str) -> str:
    if program.startswith("dapple_"):
        installed = Path(sys.executable).parent / program
        argv = [str(installed)] if installed.exists() else [sys.executable, "-m", f"scripts.{program}"]
    else:
        argv = [sys.executable, "-m", program]
    result = subprocess.run(argv + ["--helpfull"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**child_env(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, f"{program} --helpfull exited {result.returncode}:\n{result.stderr[-2000:]}"
    return result.stdout


def defines_flag(program: str, flag: str) -> bool:
    return bool(re.search(r"^\s+--(?:\[no\])?" + re.escape(flag) + r":", helpfull(program), re.M))


@pytest.mark.parametrize("where,command", commands(), ids=[w for w, _ in commands()])
def test_command_names_a_program_and_its_flags(where, command):
    if command.startswith("make "):
        makefile = (ROOT / "Makefile").read_text()
        for target in shlex.split(command)[1:]:
            if "=" not in target and not target.startswith("-"):
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{where}: no make target {target}"
        return
    ran = list(invocations(command))
    assert ran, f"{where}: no program found in {command!r}"
    for program, flags in ran:
        if program.startswith("scripts.bench."):
            assert (ROOT / (program.replace(".", "/") + ".py")).is_file(), f"{where}: no module {program}"
        unknown = [f for f in flags if not defines_flag(program, f) and not defines_flag(program, f.removeprefix("no"))]
        assert not unknown, f"{where}: {program} has no flag(s) {unknown}: {command!r}"


def test_examples_named_in_commands_exist():
    for path in PAGES:
        for name in re.findall(r"python (examples/\S+\.py)", path.read_text()):
            assert (ROOT / name).is_file(), f"{rel(path)}: {name}"


def test_user_guide_flag_tables_match_the_programs():
    text = (ROOT / "docs" / "user_guide.md").read_text()
    sections = re.split(r"^### `(dapple_\w+)`\n", text, flags=re.M)
    checked = 0
    for program, body in zip(sections[1::2], sections[2::2]):
        for flag in re.findall(r"^\| `--(\w+)` \|", body, re.M):
            assert defines_flag(program, flag), f"user_guide.md: {program} has no --{flag}"
            checked += 1
    assert checked > 50


# ----- links, sizes, stale names -----

def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_relative_links_point_to_existing_files_and_headings():
    broken = []
    for path in PAGES:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{rel(path)}: {target} (no file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{rel(path)}: {target} (no heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in DOCS:
        assert f"]({rel(page)})" in readme, rel(page)


@pytest.mark.parametrize("name,limit", [("README.md", 120), ("WORKSPACE_NOTES.md", 250)])
def test_page_length(name, limit):
    lines = (ROOT / name).read_text().count("\n")
    assert lines <= limit, f"{name} has {lines} lines (at most {limit})"


@pytest.mark.parametrize("old", ["scripts.bench_", "scripts/bench_", "dapple_tf/pipeline.py", "planner/schemas",
                                 "planner.schemas", "build_pipeline(..., schedule="])
def test_docs_use_current_names(old):
    users = [rel(p) for p in PAGES if old in p.read_text()]
    assert not users, f"{old!r} no longer exists but {users} mention it"


def test_benchmarks_named_in_the_docs_exist():
    """Benchmarks live in sub-packages of scripts/bench/ (`python -m scripts.bench.<folder>.<name>`): every dotted or
    slashed name under scripts.bench in the pages, code spans or not, is a module or a folder there."""
    missing = []
    for path in PAGES:
        for sep, name in set(re.findall(r"scripts([./])bench\1(\w+(?:\1\w+)*)", path.read_text())):
            target = ROOT / "scripts" / "bench" / name.replace(sep, "/")
            if not (target.with_suffix(".py").is_file() or target.is_dir()):
                missing.append(f"{rel(path)}: scripts{sep}bench{sep}{name}")
    assert not missing, "\n".join(sorted(missing))


def test_python_modules_named_in_the_docs_exist():
    missing = []
    for path in PAGES:
        for name in set(re.findall(r"`((?:dapple_tf|planner|profiler|scripts|models|examples|tests)/[\w/]+\.py)`",
                                   path.read_text())):
            if not (ROOT / name).is_file():
                missing.append(f"{rel(path)}: {name}")
    assert not missing, "\n".join(missing)
