"""The README: its Quick start, its picture, and its example, which runs as written (in a fresh interpreter: it
sets up its own devices). The docs pages' examples, commands and links: tests/test_docs.py."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def example() -> str:
    section = README[README.index("## Example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_has_one_python_example():
    assert len(re.findall(r"^```python$", README, re.M)) == 1


def test_quick_start_is_the_two_make_commands():
    section = README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start"))]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    assert block.splitlines() == [
        "make demo    # installs the primary environment and runs the end-to-end demo",
        "make test    # installs the primary environment (Horovod included, ~6 min to compile) and runs the tests",
    ]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_readme_shows_a_picture_that_exists():
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert pictures
    for picture in pictures:
        assert (ROOT / picture).is_file(), picture


def test_readme_example_trains(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", example()], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = re.findall(r"step (\d+): loss ([\d.]+)", result.stdout)
    assert [s for s, _ in steps] == ["0", "99"], result.stdout
    (_, first_loss), (_, last_loss) = steps
    assert float(last_loss) < 0.7 * float(first_loss)  # 256 random samples: the MLP memorizes them
