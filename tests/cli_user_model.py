"""A user's own model, not registered anywhere, for the command-line programs (tests/test_user_model_cli.py):
plain name scopes, no dapple_tf markers."""

import numpy as np
import tensorflow as tf

IN, HIDDEN, CLASSES = 12, 16, 4


def model_fn(features, labels):
    rng = np.random.RandomState(7)

    def dense(x, n_in, n_out, name):
        with tf.compat.v1.variable_scope(name):
            w = tf.compat.v1.get_variable("w", initializer=tf.constant(rng.randn(n_in, n_out).astype(np.float32) * 0.3))
            return tf.matmul(x, w)

    with tf.compat.v1.variable_scope("mine"):
        h = tf.tanh(dense(features, IN, HIDDEN, "hidden1"))
        h = tf.tanh(dense(h, HIDDEN, HIDDEN, "hidden2"))
        logits = dense(h, HIDDEN, CLASSES, "logits")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def input_fn(batch_size, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(batch_size, IN).astype(np.float32), rng.randint(0, CLASSES, batch_size).astype(np.int32)
