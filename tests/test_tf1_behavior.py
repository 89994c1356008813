"""TF1 scripts run on TF 2 after tf.compat.v1.disable_v2_behavior(): v1 TensorShapes, control flow v1 while loops
(dynamic_rnn, tf.while_loop, re-computed too) inside stages, and reference variables refused with the fix
(tests/tf1_behavior_probe.py, in a process of its own: the switch is process-wide)."""

import json
import os
import subprocess
import sys

import pytest

from tests import script_models
from tests.programs import ROOT

pytestmark = pytest.mark.slow  # ~40 s: one process, five pipelines and their single-device runs


@pytest.fixture(scope="module")
def probe():
    result = subprocess.run([sys.executable, "-m", "tests.tf1_behavior_probe"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["bert 2:1 dapple", "bert straight zb-h1 functions", "dynamic_rnn straight",
                                  "dynamic_rnn 2:1 gpipe", "while_loop 1:2 recompute"])
def test_trains_as_on_one_device_under_tf1_behavior(probe, case):
    weights, norms, global_step, smallest_norm = probe[case]
    assert weights < 1e-5 and norms < 1e-5, (weights, norms)
    assert global_step == 3
    assert smallest_norm > (0.5 if case.startswith("bert") else 0.05)  # clipping acted in every step


@pytest.mark.parametrize("idiom", script_models.IDIOMS + script_models.SPARSE_IDIOMS)
def test_scripts_own_training_steps_train_as_on_one_device_under_tf1_behavior(probe, idiom):
    """tests/test_script_training.py's idioms (minimize with UPDATE_OPS, loss scaling, clipping, EMA, gathered rows)
    as the probe builds them under TF1 behavior: all global variables within 1e-5 of the script on one device."""
    difference, global_step = probe[f"script {idiom}"]
    assert difference < 1e-5
    assert global_step == 3


def test_reference_variables_are_refused_with_the_fix(probe):
    assert probe["reference variables"].endswith(
        "is a reference variable; dapple_tf needs resource variables (call "
        "tf.compat.v1.enable_resource_variables() before building the model)")
