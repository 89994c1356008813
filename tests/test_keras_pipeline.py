"""Marker-free Keras models (Keras 2 on TF 2.15, Keras 3 on TF 2.21) built from the layers users use,
pipelined with layers_by_scope(depth=1): straight and replicated stages, M in {1, 4}, equal to
single-device training (same initial weights)."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from tests.pipeline_harness import assert_close_dicts, cpu, initial_weights, train_pipelined, train_single

K = tf.keras
SGD = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
NAMES = ["emb", "mha", "ln", "conv", "d0", "d1"]


def xent(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def attention_model_fn(x, y):
    tokens = tf.cast(tf.abs(x[:, :4]) * 3, tf.int32) % 10
    e = K.layers.Embedding(10, 8, name="emb")(tokens)
    h = K.layers.LayerNormalization(name="ln")(K.layers.MultiHeadAttention(2, 4, name="mha")(e, e) + e)
    c = K.layers.Conv2D(2, 2, name="conv")(tf.reshape(h, [-1, 4, 8, 1]))
    h = K.layers.Dense(8, activation="tanh", name="d0")(tf.reshape(c, [-1, 3 * 7 * 2]))
    return xent(y, K.layers.Dense(4, name="d1")(h))


def lstm_model_fn(x, y):
    return xent(y, K.layers.Dense(4, name="d1")(K.layers.LSTM(5, name="lstm")(tf.reshape(x, [-1, 3, 2]))))


def batch(n=8, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, 6).astype(np.float32), rng.randint(0, 4, n).astype(np.int32)


@pytest.mark.parametrize("stages, m", [
    ([(0, 2, [cpu(0)]), (3, 5, [cpu(1)])], 4),
    ([(0, 3, [cpu(0), cpu(1)]), (4, 5, [cpu(2)])], 1),
    ([(0, 1, [cpu(0)]), (2, 5, [cpu(1), cpu(2)])], 4),
], ids=["straight-M4", "replicated-M1", "replicated-M4"])
def test_keras_attention_conv_model_trains_like_single_device(stages, m):
    x, y = batch()
    initial = initial_weights(attention_model_fn, x, y)  # Keras initializers are random: the same start for both
    want_grads, want_weights, want_losses = train_single(attention_model_fn, x, y, SGD, 2, initial=initial)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=m)
    grads, weights, losses, handle, _ = train_pipelined(attention_model_fn, x, y, SGD, plan, "dapple", 2,
                                                        initial=initial, layers=dapple_tf.layers_by_scope(depth=1))
    assert [name for stage in handle.stages for name in stage.layer_names] == NAMES  # one per Keras layer
    # atol 5e-6: the 8 slices' gradients summed in another order than the whole batch's, an order that moves with
    # the machine's load (AddN adds inputs as they arrive); mha/value/bias came out 1.45e-6 off once under the full
    # TF 2.21 suite (0.0414166 vs 0.0414181: terms that largely cancel), never in isolation. A lost micro-batch or
    # slice is off by 10% or more.
    assert_close_dicts(want_grads, grads, atol=5e-6)
    assert_close_dicts(want_weights, weights, atol=5e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def test_keras_lstm_in_a_replicated_stage_trains_like_single_device():
    x, y = batch()
    initial = initial_weights(lstm_model_fn, x, y)
    want_grads, want_weights, _ = train_single(lstm_model_fn, x, y, SGD, 2, initial=initial)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)])], num_micro_batches=4)
    grads, weights, _, handle, _ = train_pipelined(lstm_model_fn, x, y, SGD, plan, "dapple", 2, initial=initial,
                                                   layers=dapple_tf.layers_by_scope(depth=1))
    assert [s.layer_names for s in handle.stages] == [("lstm",), ("d1",)]
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
