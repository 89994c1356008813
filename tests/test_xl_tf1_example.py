"""examples/xl_tf1: a TF1 Transformer-XL / XLNet classifier fine-tuning script (time-major activations, the
attention mask, segment matrix and relative position encoding built once before the first layer and read by every
layer, per-layer biases sliced from one variable, Adam with warmup and polynomial decay, clipping, layer-wise
learning-rate decay by variable name), ported by the user guide's 3-line diff with nothing changed in its model_fn,
trains pipelined inside its encoder at M=4 (straight and 2:1) as the unported script does on one device."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tests import ported_examples
from tests.programs import ROOT

pytestmark = [pytest.mark.primary_only, pytest.mark.slow]  # tf.estimator; ~60 s: three Estimator runs

EXAMPLE = os.path.join(ROOT, "examples", "xl_tf1")
STEPS = 4
# 7 layers: model/transformer/word_embedding, model/transformer/layer_0..3, model/sequence_summary,
# model/classification_pairs; the stage boundary is between layer_1 and layer_2
STRAIGHT = [(0, 2, [0]), (3, 6, [1])]
TWO_ONE = [(0, 2, [0, 1]), (3, 6, [2])]


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """The example with the guide's diff applied (git apply, as a user would patch it)."""
    return ported_examples.ported("xl_tf1", tmp_path_factory.mktemp("ported"))


def initial_checkpoint(path) -> float:
    """Pre-trained weights, larger than the example's initializer gives (so that clipping at 1.0 acts); returns
    the first batch's global gradient norm there."""
    modeling, run_classifier = ported_examples.example_modules("xl_tf1", "modeling", "run_classifier")
    x, y = run_classifier.examples(0, 16)
    return ported_examples.saved_initial_weights(path, lambda: run_classifier.get_classification_loss(
            {k: tf.constant(v) for k, v in x.items()}, tf.constant(y), dict(modeling.CONFIG, initializer_range=0.2),
            2)[0])


def run_script(folder, model_dir, *args):
    """Adam's epsilon 1e-3, not the script's 1e-8: the position encoding's lowest-frequency cosines are nearly the
    same at every position, so the softmax ignores them and the rows of each layer's r/kernel reading them get
    gradients of 1e-7 to 4e-9, at the rounding noise of their sum (4e-9 between the whole batch and its 4 parts
    summed, in plain TF on one device). Adam divides by |g| + epsilon: with 1e-8 that noise moves those rows by
    up to 1e-4 (1% of the learning rate), with 1e-3 by under 1e-7."""
    return ported_examples.run_script(os.path.join(folder, "run_classifier.py"), model_dir, f"--train_steps={STEPS}",
                                      "--learning_rate=0.01", "--warmup_steps=1", "--adam_epsilon=1e-3",
                                      "--num_cpu_devices=3", *args)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The unported script's checkpoint after STEPS steps from the initial checkpoint, and that checkpoint."""
    root = tmp_path_factory.mktemp("one_device")
    norm = initial_checkpoint(root / "init" / "model.ckpt")
    assert norm > 1.0  # clipping at 1.0 acts
    init = f"--init_checkpoint={root / 'init' / 'model.ckpt'}"
    return run_script(EXAMPLE, root / "single", init), init


def test_the_port_is_three_lines_none_in_model_fn():
    changed = ported_examples.changed_lines(ported_examples.port_diff("xl_tf1"))
    assert len(changed) <= 3 and all(line.startswith("+") for line in changed), changed
    assert not any("minimize" in line or "model_fn(" in line for line in changed)


@pytest.mark.parametrize("stages", [pytest.param(STRAIGHT, marks=pytest.mark.long), TWO_ONE], ids=["straight", "2:1"])
def test_ported_script_trains_pipelined_inside_the_encoder_as_on_one_device(ported, one_device, tmp_path, stages):
    want, init = one_device
    plan = ported_examples.plan_file(tmp_path / "plan.json", stages, 4)  # M=4, global batch 16
    got = run_script(str(ported), tmp_path / "pipelined", init, f"--plan={plan}")
    assert sorted(want) == sorted(got)  # the single-device variables, Adam's slots included: no copies
    assert int(want["global_step"]) == int(got["global_step"]) == STEPS
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=2e-6, err_msg=name)
