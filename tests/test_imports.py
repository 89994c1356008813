"""The packages import in this environment, and planner/ never imports TensorFlow."""

import subprocess
import sys

import pytest

from tests.programs import run_program

CHECK_PLANNER = """
import pkgutil, sys, importlib, planner
names = [m.name for m in pkgutil.walk_packages(planner.__path__, "planner.")]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m == "tensorflow" or m.startswith("tensorflow."))
print(len(names), "modules;", "tensorflow modules:", bad[:3])
sys.exit(1 if bad else 0)
"""


def test_planner_imports_no_tensorflow():
    result = subprocess.run([sys.executable, "-c", CHECK_PLANNER], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tensorflow modules: []" in result.stdout


def test_planner_modules_found():
    import pkgutil

    import planner

    names = {m.name for m in pkgutil.walk_packages(planner.__path__, "planner.")}
    assert {"planner.formats.schedule", "planner.formats", "planner.formats.io"} <= names


def test_all_packages_import():
    result = subprocess.run(
        [sys.executable, "-c", "import dapple_tf, planner, profiler, models; print('ok')"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize(
    "name", ["dapple_profile", "dapple_plan", "dapple_simulate", "dapple_train", "dapple_launch", "dapple_demo"]
)
def test_cli_help(name):
    result = run_program(name, "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert name in result.stdout
    assert "--" in result.stdout  # lists its flags
