"""RandomOpsWarning: random ops (dropout) in a stage whose batch is split draw per micro-batch slice."""

import warnings

import pytest
import tensorflow as tf

import dapple_tf
from tests.pipeline_harness import cpu


def _build(num_micro_batches, devices, keras):
    def model_fn(features, labels):
        with dapple_tf.layer("body"):
            w = tf.compat.v1.get_variable("w", [4, 3])
            h = tf.matmul(features, w)
            h = tf.keras.layers.Dropout(0.5)(h, training=True) if keras else tf.nn.dropout(h, rate=0.5)
        with dapple_tf.layer("head"):
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h))

    plan = dapple_tf.Plan.from_stages([("body", "head", devices)], num_micro_batches=num_micro_batches)
    with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dapple_tf.build_pipeline(model_fn, tf.zeros([8, 4]), tf.zeros([8], tf.int32),
                                 tf.compat.v1.train.GradientDescentOptimizer(0.1), plan)
    return [w for w in caught if issubclass(w.category, dapple_tf.RandomOpsWarning)]


@pytest.mark.parametrize("keras", [False, True], ids=["tf.nn.dropout", "keras Dropout"])
def test_split_batches_warn_about_random_ops(keras):
    for m, devices in ((2, [cpu(0)]), (1, [cpu(0), cpu(1)])):
        found = _build(m, devices, keras)
        assert len(found) == 1, (m, devices)
        message = str(found[0].message)
        assert message.startswith("random ops (body/") and "draw their values for each micro-batch slice" in message
    assert _build(1, [cpu(0)], keras) == []  # one slice: the same draws as one device
