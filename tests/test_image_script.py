"""examples/resnet_tf1: a TF1 image training script (tf.compat.v1.layers conv + fused batch norm, l2 over every
variable, Momentum with a tf.cond warmup, tf.group(minimize_op, update_ops), moving averages of the weights,
metrics and image summaries, TF1 behavior), ported by the user guide's 3-line diff with nothing changed in its
model_fn, trains pipelined at M=1 (straight and 2:1, cut inside the residual blocks) as the script does on one
device: every checkpointed variable and every scalar summary, through its own Estimator and through dapple_train."""

import os

import numpy as np
import pytest

from tests import ported_examples
from tests.programs import ROOT, run_program

pytestmark = [pytest.mark.primary_only, pytest.mark.slow]  # tf.estimator, tf.compat.v1.layers; ~40 s

EXAMPLE = os.path.join(ROOT, "examples", "resnet_tf1")
STEPS = 4  # through the warmup (2 steps) and the learning rate's boundary (step 2)
# 13 layers by scope (depth 2): resnet_model/conv2d, resnet_model/batch_normalization, ..., resnet_model/dense;
# layer 6 ends inside the first residual block
STRAIGHT = [(0, 6, [0]), (7, 12, [1])]
TWO_ONE = [(0, 6, [0, 1]), (7, 12, [2])]
SCALARS = ("cross_entropy", "l2_loss", "learning_rate", "loss", "train_accuracy")


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    return ported_examples.ported("resnet_tf1", tmp_path_factory.mktemp("ported"))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("one_device")
    return ported_examples.run_script(os.path.join(EXAMPLE, "resnet_main.py"), model_dir, f"--train_steps={STEPS}",
                                      "--num_cpu_devices=3"), ported_examples.scalar_summaries(model_dir)


def test_the_port_is_three_lines_none_in_model_fn():
    changed = ported_examples.changed_lines(ported_examples.port_diff("resnet_tf1"))
    assert len(changed) <= 3 and all(line.startswith("+") for line in changed), changed
    assert not any("minimize" in line or "model_fn(" in line for line in changed)


@pytest.mark.parametrize("stages", [STRAIGHT, TWO_ONE], ids=["straight", "2:1-sync"])
def test_ported_script_trains_as_on_one_device(ported, one_device, tmp_path, stages):
    want, want_summaries = one_device
    plan = ported_examples.plan_file(tmp_path / "plan.json", stages, 1)
    got = ported_examples.run_script(os.path.join(ported, "resnet_main.py"), tmp_path / "run",
                                     f"--train_steps={STEPS}", "--num_cpu_devices=3", f"--plan={plan}")
    assert any(name.endswith("/ExponentialMovingAverage") for name in got)
    assert any(name.endswith("/moving_mean") for name in got) and any(name.endswith("/Momentum") for name in got)
    assert ported_examples.largest_difference(want, got) < 1e-5
    assert int(got["global_step"]) == STEPS
    summaries = ported_examples.scalar_summaries(tmp_path / "run")
    assert sorted(summaries) == sorted(want_summaries)  # images included
    for tag in SCALARS:
        assert sorted(summaries[tag]) == list(range(1, STEPS + 1)), tag
        np.testing.assert_allclose([summaries[tag][s] for s in range(1, STEPS + 1)],
                                   [want_summaries[tag][s] for s in range(1, STEPS + 1)], rtol=1e-5, err_msg=tag)
    assert len(set(summaries["learning_rate"].values())) == 3  # warmup, base, after the boundary


def test_ported_model_fn_trains_through_dapple_train(ported, tmp_path):
    def train(name, stages, devices):
        result = run_program("dapple_train", "--model_fn=resnet_main:model_fn", "--input_fn=resnet_main:input_fn",
                             "--scope_depth=2", "--batch_norm=sync",
                             f"--plan={ported_examples.plan_file(tmp_path / f'{name}.json', stages, 1)}",
                             f"--steps={STEPS}", "--log_every=2", f"--num_devices={devices}",
                             f"--save_checkpoints_steps={STEPS}", f"--model_dir={tmp_path / name}", cwd=ported,
                             timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"done: step {STEPS}" in result.stdout
        return ported_examples.checkpoint(tmp_path / name)

    want = train("one", [(0, 12, [0])], 1)
    got = train("two", TWO_ONE, 3)
    assert ported_examples.largest_difference(want, got) < 1e-5
