"""The primary environment has what the design needs beside TF: the estimator API and Horovod."""

import subprocess
import sys

import pytest


@pytest.mark.primary_only
def test_estimator_and_horovod_import():
    code = (
        "import tensorflow as tf, tensorflow_estimator, horovod.tensorflow as hvd;"
        "print(tf.__version__, tensorflow_estimator.__version__ if hasattr(tensorflow_estimator, '__version__') else '',"
        " hvd.__name__, hasattr(tf, 'estimator'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "2.15.1"
    assert result.stdout.strip().endswith("horovod.tensorflow True")
