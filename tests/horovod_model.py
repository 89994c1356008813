"""tests.user_model's model with initial weights that differ per Horovod rank: training can only match
one device if every process starts from rank 0's weights (Horovod's broadcast, then the copies)."""

import os

import tensorflow as tf

import dapple_tf
from tests.user_model import input_fn  # noqa: F401  (dapple_train --input_fn=tests.horovod_model:input_fn)


def model_fn(features, labels):
    offset = 100 * int(os.environ.get("HOROVOD_RANK", "0"))
    with dapple_tf.layer("encode"):
        w = tf.compat.v1.get_variable("encode_w", [6, 16],
                                      initializer=tf.compat.v1.glorot_uniform_initializer(seed=1 + offset))
        h = tf.nn.relu(tf.matmul(features, w))
    with dapple_tf.layer("decode"):
        w = tf.compat.v1.get_variable("decode_w", [16, 1],
                                      initializer=tf.compat.v1.glorot_uniform_initializer(seed=2 + offset))
        return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))
