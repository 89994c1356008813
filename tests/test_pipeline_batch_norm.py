"""Batch normalization: the model's UPDATE_OPS run once per step in the pipelined graph, from the mean of
the micro-batch slices' statistics; gradients are those of per-slice normalization; a build-time warning."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.rewrite.batch.batch_norm import BatchNormWarning
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, cpu

DECAY, EPS, N = 0.9, 1e-3, 8
VALUES = toy_models.initial_values()
STAGES = [("bn", "bn", [cpu(0), cpu(1)]), ("dense", "head", [cpu(2)])]  # M=2: 4 slices of 2 samples


def moments_bn_model_fn(features, labels):
    """Batch norm as slim writes it without fusion: tf.nn.moments, moving averages assigned in UPDATE_OPS."""
    with dapple_tf.layer("bn"):
        mean, variance = tf.nn.moments(features, [0])
        moving_mean = tf.compat.v1.get_variable("moving_mean", initializer=tf.zeros([toy_models.IN]), trainable=False)
        moving_var = tf.compat.v1.get_variable("moving_var", initializer=tf.ones([toy_models.IN]), trainable=False)
        for moving, value in ((moving_mean, mean), (moving_var, variance)):
            update = moving.assign_sub((moving - value) * (1 - DECAY))  # a tensor: read after the assign
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
        gamma = tf.compat.v1.get_variable("gamma", initializer=tf.fill([toy_models.IN], 1.5))
        h = (features - mean) * tf.math.rsqrt(variance + EPS) * gamma
    with dapple_tf.layer("dense"):
        h = tf.tanh(tf.matmul(h, tf.compat.v1.get_variable("w0", initializer=tf.constant(VALUES["w0"]))))
    with dapple_tf.layer("head"):
        w = tf.compat.v1.get_variable("w1", initializer=tf.constant(VALUES["w1"][:, : toy_models.CLASSES]))
        logits = tf.matmul(h, w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def slices(x, y, count=4):
    size = len(x) // count
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(count)]


def per_slice_gradients(model_fn, x, y):
    """Single device: the mean over the 4 slices of the gradients of the model run on each slice alone."""
    with tf.Graph().as_default():
        xp = tf.compat.v1.placeholder(tf.float32, [None, toy_models.IN])
        yp = tf.compat.v1.placeholder(tf.int32, [None])
        loss = model_fn(xp, yp)
        variables = tf.compat.v1.trainable_variables()
        grads = tf.gradients(loss, variables)
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            runs = [sess.run(grads, {xp: xs, yp: ys}) for xs, ys in slices(x, y)]
    return {v.op.name: np.mean([r[i] for r in runs], axis=0) for i, v in enumerate(variables)}


def pipelined(model_fn, x, y, stage_functions=None):
    with tf.Graph().as_default():
        plan = dapple_tf.Plan.from_stages(STAGES, num_micro_batches=2)
        with pytest.warns(BatchNormWarning, match=r"batch normalization in training mode \(.+\) normalizes each"):
            handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y),
                                              tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                              dapple_tf.PipelineOptions(stage_functions=stage_functions))
        assert not stage_functions or handle.function_fallbacks == {}
        moving = {v.op.name: v for v in tf.compat.v1.global_variables() if not v.trainable}
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            grads = dict(zip([v.op.name for _, v in handle.grads_and_vars], sess.run([g for g, _ in handle.grads_and_vars])))
            before = sess.run(moving)
            sess.run(handle.train_op)
            after = sess.run(moving)
            sess.run(handle.train_op)
            twice = sess.run(moving)
    return handle, grads, before, after, twice


def expected_moving(before, x, y, statistic):
    stats = np.mean([statistic(xs) for xs, _ in slices(x, y)], axis=0)
    return before - (before - stats) * (1 - DECAY)


@pytest.mark.parametrize("stage_functions", [False, True], ids=["clones", "functions"])
def test_moving_averages_follow_the_micro_batch_statistics_once_per_step(stage_functions):
    x, y = toy_models.batch(N)
    handle, grads, before, after, twice = pipelined(moments_bn_model_fn, x, y, stage_functions)
    assert len(handle.update_ops) == 2
    np.testing.assert_allclose(after["moving_mean"], expected_moving(before["moving_mean"], x, y, lambda s: s.mean(0)),
                               rtol=1e-5, atol=1e-6)
    want_var = expected_moving(before["moving_var"], x, y, lambda s: s.var(0))
    np.testing.assert_allclose(after["moving_var"], want_var, rtol=1e-5, atol=1e-6)
    global_var = before["moving_var"] - (before["moving_var"] - x.var(0)) * (1 - DECAY)
    assert np.abs(want_var - global_var).max() > 0.05  # micro-batch semantics, not the global batch's
    np.testing.assert_allclose(twice["moving_var"], expected_moving(after["moving_var"], x, y, lambda s: s.var(0)),
                               rtol=1e-5, atol=1e-6)  # once per step: a second step applies one more update
    want_grads = per_slice_gradients(moments_bn_model_fn, x, y)
    for name, value in want_grads.items():
        np.testing.assert_allclose(grads[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.primary_only
def test_keras_batch_normalization_updates():
    def keras_bn_model_fn(features, labels):
        with dapple_tf.layer("bn"):
            bn = tf.keras.layers.BatchNormalization(momentum=DECAY, epsilon=EPS)
            h = bn(features, training=True)
            for update in bn.updates:
                tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
        with dapple_tf.layer("dense"):
            h = tf.tanh(tf.matmul(h, tf.compat.v1.get_variable("w0", initializer=tf.constant(VALUES["w0"]))))
        with dapple_tf.layer("head"):
            w = tf.compat.v1.get_variable("w1", initializer=tf.constant(VALUES["w1"][:, : toy_models.CLASSES]))
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.matmul(h, w)))

    x, y = toy_models.batch(N)
    _, _, before, after, _ = pipelined(keras_bn_model_fn, x, y)
    mean_name = [n for n in before if n.endswith("moving_mean")][0]
    np.testing.assert_allclose(after[mean_name], expected_moving(before[mean_name], x, y, lambda s: s.mean(0)),
                               rtol=1e-5, atol=1e-6)
    var_name = [n for n in before if n.endswith("moving_variance")][0]
    np.testing.assert_allclose(after[var_name], expected_moving(before[var_name], x, y, lambda s: s.var(0)),
                               rtol=1e-5, atol=1e-6)
