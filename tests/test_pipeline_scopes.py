"""Layers from the model's own name scopes (dapple_tf.layers_by_scope): no markers in the model, and
pipelined training equal to single-device training."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf import LayerMarkerError
from tests import toy_models
from tests.pipeline_harness import assert_close_dicts, cpu, train_pipelined, train_single

SGD = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
VALUES = toy_models.initial_values()


def scoped_model_fn(features, labels):
    """The toy skip model written with plain name scopes; preprocessing and the loss outside them."""

    def var(name):
        return tf.compat.v1.get_variable(name, initializer=tf.constant(VALUES[name]), use_resource=True)

    features = features * 0.5  # outside every scope: joins the first layer consuming it
    with tf.compat.v1.variable_scope("net"):
        with tf.compat.v1.variable_scope("dense0"):  # variables "net/dense0/w0", ... placed with the layer
            h0 = tf.tanh(tf.matmul(features, var("w0")) + var("b0"))
        with tf.name_scope("dense1"):  # get_variable here makes "net/w1": placed by no layer, read by dense1
            h1 = tf.tanh(tf.matmul(h0, var("w1")) + var("b1"))
        with tf.name_scope("dense2"):
            h2 = tf.tanh(tf.matmul(h1, var("w2")))
        with tf.name_scope("dense3"):
            h3 = tf.tanh(tf.matmul(h2, var("w3")) + tf.matmul(h0, var("skip")) + var("b3"))
        with tf.name_scope("head"):
            logits = tf.matmul(h3, var("wo"))
        squeezed = tf.reshape(logits, [-1, toy_models.CLASSES])  # in "net" only: joins "net/head"
    ce = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=squeezed))
    return ce + 0.01 * tf.reduce_mean(tf.square(h3))  # the loss, outside every scope: joins the last layer


NAMES = ["net/dense0", "net/dense1", "net/dense2", "net/dense3", "net/head"]


def recorded(spec):
    x, y = toy_models.batch(4)
    with tf.Graph().as_default():
        recorder = spec.recorder(tf.compat.v1.get_default_graph())
        with recorder.activate():
            loss = scoped_model_fn(tf.constant(x), tf.constant(y))
        return recorder, loss


@pytest.mark.parametrize(
    "spec",
    [dapple_tf.layers_by_scope(depth=2), dapple_tf.layers_by_scope(patterns=["net/dense*", "net/head"])],
    ids=["depth", "patterns"],
)
def test_layers_are_the_scopes_in_creation_order(spec):
    recorder, loss = recorded(spec)
    assert recorder.names == NAMES
    layer_of = recorder.layer_of_op()
    assert layer_of[loss.op.name] == 4  # the loss joins the layer producing its inputs
    assert layer_of["mul"] == 0  # preprocessing joins the first layer consuming it
    assert layer_of["net/Reshape"] == 4


@pytest.mark.parametrize(
    "stages",
    [[(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2)])], [("net/dense0", "net/dense2", [cpu(0)]), (3, 4, [cpu(1), cpu(2)])]],
    ids=["2:1", "1:2 by name"],
)
def test_scoped_model_trains_like_single_device(stages):
    x, y = toy_models.batch(8)
    want_grads, want_weights, want_losses = train_single(scoped_model_fn, x, y, SGD, 3)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    grads, weights, losses, handle, _ = train_pipelined(
        scoped_model_fn, x, y, SGD, plan, "dapple", 3, layers=dapple_tf.layers_by_scope(depth=2)
    )
    assert [name for stage in handle.stages for name in stage.layer_names] == NAMES
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    devices = {v.op.name: v.device for _, v in handle.grads_and_vars}
    assert devices["net/dense0/w0"] == handle.stages[0].devices[0]  # placed on its layer's stage
    assert devices["net/w1"] == ""


def test_bad_specs_and_unmatched_scopes_are_refused():
    with pytest.raises(LayerMarkerError, match="exactly one of depth= or patterns="):
        dapple_tf.layers_by_scope()
    with pytest.raises(LayerMarkerError, match=r"depth=\.\.\.\) must be an integer >= 1, got 0"):
        dapple_tf.layers_by_scope(depth=0)
    with pytest.raises(LayerMarkerError, match=r"layers_by_scope\(patterns=\['model/\*'\]\): no op was created inside"):
        recorded(dapple_tf.layers_by_scope(patterns=["model/*"]))


@pytest.mark.primary_only
def test_keras_sequential_trains_like_single_device():
    rng = np.random.RandomState(5)
    kernels = [rng.randn(toy_models.IN, 8).astype(np.float32) * 0.5, rng.randn(8, toy_models.CLASSES).astype(np.float32)]

    def keras_model_fn(features, labels):
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(8, activation="tanh", kernel_initializer=tf.constant_initializer(kernels[0])),
            tf.keras.layers.Dense(toy_models.CLASSES, kernel_initializer=tf.constant_initializer(kernels[1])),
        ])
        logits = model(features)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    x, y = toy_models.batch(8)
    want_grads, want_weights, _ = train_single(keras_model_fn, x, y, SGD, 3)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)])], num_micro_batches=2)
    grads, weights, _, handle, _ = train_pipelined(
        keras_model_fn, x, y, SGD, plan, "dapple", 3, layers=dapple_tf.layers_by_scope(depth=2)
    )
    assert [s.layer_names for s in handle.stages] == [("sequential/dense",), ("sequential/dense_1",)]
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
