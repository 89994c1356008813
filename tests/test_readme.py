"""The README's runtime example runs as written (in a fresh interpreter: it sets up its own devices)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def runtime_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using the runtime"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_runtime_example_trains():
    result = subprocess.run(
        [sys.executable, "-c", runtime_example()], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = re.findall(r"step (\d+): loss ([\d.]+), accuracy ([\d.]+)", result.stdout)
    assert [s for s, _, _ in steps] == ["0", "99"], result.stdout
    (_, first_loss, first_acc), (_, last_loss, last_acc) = steps
    assert float(last_loss) < 0.7 * float(first_loss)  # 256 random samples: the MLP memorizes them
    assert float(last_acc) > float(first_acc) + 0.2
