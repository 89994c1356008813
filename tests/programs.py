"""Runs the repository's command-line programs (`python -m scripts.<name>`) as a user would."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_program(name, *args, timeout=300, cwd=ROOT, env=None):
    """`python -m scripts.<name> args...` from `cwd` (the repository root), with `env` added to this process's
    environment (a None value removes the variable); returns the CompletedProcess."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-m", f"scripts.{name}", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )
