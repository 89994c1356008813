"""A user's own model and input for dapple_train --model_fn/--input_fn (not a reference model)."""

import tensorflow as tf

import dapple_tf


def model_fn(features, labels):
    with dapple_tf.layer("encode"):
        w = tf.compat.v1.get_variable("encode_w", [6, 16], initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
        h = tf.nn.relu(tf.matmul(features, w))
    with dapple_tf.layer("decode"):
        w = tf.compat.v1.get_variable("decode_w", [16, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
        return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))


def input_fn(step, batch_size):
    """A regression batch that depends on the step alone."""
    key = tf.stack([tf.constant(7, tf.int64), tf.cast(step, tf.int64)])
    x = tf.random.stateless_normal([batch_size, 6], key)
    return x, tf.reduce_sum(x, axis=1) * 0.5


def batch_norm_model_fn(features, labels):
    """model_fn with a batch norm between its layers (moving averages in UPDATE_OPS) and a summary of a batch mean:
    what a pipeline combines over every clone once per step (tests/test_per_host_training.py)."""
    with dapple_tf.layer("encode"):
        w = tf.compat.v1.get_variable("encode_w", [6, 16], initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
        h = tf.tanh(tf.matmul(features, w))
    with dapple_tf.layer("norm"):
        mean, variance = tf.nn.moments(h, [0])
        for name, value, start in (("moving_mean", mean, 0.0), ("moving_variance", variance, 1.0)):
            moving = tf.compat.v1.get_variable(name, initializer=tf.fill([16], start), trainable=False)
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, moving.assign_sub((moving - value) * 0.1))
        h = (h - mean) * tf.math.rsqrt(variance + 1e-3)
        tf.compat.v1.summary.scalar("normalized_mean", tf.reduce_mean(h))
    with dapple_tf.layer("decode"):
        w = tf.compat.v1.get_variable("decode_w", [16, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
        return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))


def task_dependent_input_fn(step, batch_size):
    """input_fn's batch, shifted by the task index of TF_CONFIG: what an input pipeline shuffled without a seed does
    to per-host training (every task reads another batch)."""
    import json  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel

    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    x, y = input_fn(step, batch_size)
    return x + float(task), y
