"""Models written as TF1 training scripts write them, for tests/test_training_scripts.py and tf1_behavior_probe.py:
the BERT of examples/bert_tf1 (a variable scope per layer, the batch size from tf.shape, an attention mask from
the input mask, AdamW with weight-decay exclusions, warmup + polynomial decay), GNMT's pattern (two
tf.compat.v1.nn.dynamic_rnn LSTM layers in their own variable scopes and a head) and a tf.while_loop layer.
"""

import os
import sys

import numpy as np
import tensorflow as tf

from tests.programs import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples", "bert_tf1"))
import modeling  # noqa: E402
import optimization  # noqa: E402
import run_classifier  # noqa: E402

v1 = tf.compat.v1
BERT_CONFIG = dict(modeling.CONFIG, hidden_size=16, num_hidden_layers=2, intermediate_size=32)
BERT_LAYERS = ["bert/embeddings", "bert/encoder/layer_*", "bert/pooler", "loss"]  # layers_by_scope(patterns=...)
CLIP = 0.5  # below the gradients' global norm on these models, so clipping acts in every step


def bert_batch(n: int):
    return run_classifier.examples(0, n)


def bert_loss(features, labels):
    return run_classifier.create_model(features, labels, BERT_CONFIG)[0]


def adamw():
    """The example's AdamW at a learning rate from global_step: linear warmup over 2 steps, then decay."""
    return optimization.AdamWeightDecayOptimizer(optimization.learning_rate(0.01, 10, 2), weight_decay_rate=0.01,
                                                 exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"])


class LSTMCell:
    """An LSTM cell with the interface tf.compat.v1.nn.dynamic_rnn calls (Keras 3 has no v1 cells)."""

    def __init__(self, units: int):
        self.units = units
        self.state_size = (units, units)
        self.output_size = units

    def zero_state(self, batch_size, dtype):
        return tf.zeros([batch_size, self.units], dtype), tf.zeros([batch_size, self.units], dtype)

    def __call__(self, inputs, state, scope=None):
        c, h = state
        kernel = v1.get_variable("kernel", [int(inputs.shape[-1]) + self.units, 4 * self.units],
                                 initializer=v1.glorot_uniform_initializer(seed=1))
        bias = v1.get_variable("bias", [4 * self.units], initializer=v1.zeros_initializer())
        i, j, f, o = tf.split(tf.matmul(tf.concat([inputs, h], 1), kernel) + bias, 4, axis=1)
        c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(j)
        h = tf.sigmoid(o) * tf.tanh(c)
        return h, (c, h)


def seq2seq_loss(features, labels):
    """GNMT's pattern: two dynamic_rnn LSTM layers (lstm_0, lstm_1) and a head predicting every step."""
    x = features
    for i in range(2):
        with v1.variable_scope(f"lstm_{i}"):
            x, _ = v1.nn.dynamic_rnn(LSTMCell(8), x, dtype=tf.float32)
    with v1.variable_scope("head"):
        w = v1.get_variable("w", [8, 1], initializer=v1.glorot_uniform_initializer(seed=2))
        prediction = tf.reshape(tf.matmul(tf.reshape(x, [-1, 8]), w), tf.shape(labels))
        return tf.reduce_mean(tf.square(prediction - labels))


def seq_batch(n: int):
    rng = np.random.RandomState(0)
    return rng.randn(n, 5, 4).astype(np.float32), rng.randn(n, 5, 1).astype(np.float32)


def while_loop_loss(features, labels):
    """A layer that runs tf.compat.v1.while_loop over the time steps, then a head."""
    with v1.variable_scope("loop"):
        w = v1.get_variable("w", [4, 4], initializer=v1.glorot_uniform_initializer(seed=3))

        def body(t, h):
            return t + 1, tf.tanh(tf.matmul(features[:, t, :], w) + h)

        _, h = v1.while_loop(lambda t, h: t < 5, body, [tf.constant(0), tf.zeros_like(features[:, 0, :])])
    with v1.variable_scope("head"):
        w = v1.get_variable("w", [4, 1], initializer=v1.glorot_uniform_initializer(seed=4))
        return tf.reduce_mean(tf.square(tf.matmul(h, w) - labels[:, 0, :]))
