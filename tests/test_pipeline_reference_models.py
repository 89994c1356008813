"""Every reference model (tiny config) trains through build_pipeline exactly like on one device."""

import pytest
import tensorflow as tf

import dapple_tf
import models
from tests.pipeline_harness import assert_close_dicts, cpu, initial_weights, train_pipelined, train_single

BATCH = 8


def sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_reference_model_two_stages(name):
    spec = models.get_model(name, config="tiny")
    x, y = spec.synthetic_batch(BATCH, seed=5)
    with tf.Graph().as_default():
        recorder = dapple_tf.LayerRecorder(tf.compat.v1.get_default_graph())
        with recorder.activate():
            spec.model_fn(*spec.placeholders(BATCH))
        num_layers = len(recorder.layers)
    assert num_layers >= 2
    cut = num_layers // 2
    if name == "resnet50":
        # Batch norm normalizes with the statistics of the batch a replica sees: only a pipeline that
        # keeps the whole batch together (one micro-batch, no replication) equals one device.
        plan = dapple_tf.Plan.from_stages([(0, cut - 1, [cpu(0)]), (cut, num_layers - 1, [cpu(1)])], num_micro_batches=1)
    else:
        plan = dapple_tf.Plan.from_stages(
            [(0, cut - 1, [cpu(0), cpu(1)]), (cut, num_layers - 1, [cpu(2)])], num_micro_batches=2
        )
    initial = initial_weights(spec.model_fn, x, y)  # the models' initializers are random
    want_grads, want_weights, _ = train_single(spec.model_fn, x, y, sgd, 2, initial=initial)
    grads, weights, _, _, _ = train_pipelined(spec.model_fn, x, y, sgd, plan, "dapple", 2, initial=initial)
    assert_close_dicts(want_grads, grads, rtol=1e-4, atol=1e-5)
    assert_close_dicts(want_weights, weights, rtol=1e-4, atol=1e-5)
