"""TensorFlow models of the random equivalence harness's grammar (fuzz_grammar.py): one variable scope per layer
(`l<i>_<kind>`, cut by layers_by_scope(depth=1)), weights from fixed seeds, and the batch's inputs.

The same model_fn builds the pipelined model and its single-device reference. Where the pipeline normalizes a
slice of the batch (a batch norm in a stage that runs on slices: each micro-batch, or each replica's part of it
with batch_norm="per_slice"), the reference normalizes the same rows together: `groups` gives, per batch-norm
layer, each sample's group (runs of consecutive rows), and the reference's statistics are per group. Training the
reference on the whole batch then computes what the pipeline computes, whatever the plan.
"""

from typing import Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

WIDTH = 12
CLASSES = 3
VOCAB = 20
SEQ = 5
IMAGE = (6, 6, 3)
FILTERS = 4
v1 = tf.compat.v1


def batch(kind: str, size: int, seed: int):
    """(features, labels) numpy values of a batch of `size` samples of input `kind`."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, CLASSES, size).astype(np.int32)
    if kind == "image":
        return rng.randn(size, *IMAGE).astype(np.float32), labels
    if kind in ("tokens", "time_tokens"):
        ids = rng.randint(1, VOCAB, (size, SEQ)).astype(np.int32)
        ids[:, -1] *= rng.randint(0, 2, size)  # some padding (id 0), masked out of attention
        return ids, labels
    if kind == "flat":
        return rng.randn(size, WIDTH).astype(np.float32), labels
    raise ValueError(f"unknown input kind {kind!r}: flat, image, tokens or time_tokens")


def _init(seed: int):
    return v1.glorot_uniform_initializer(seed=seed)


def _dense(x, units: int, seed: int, activation=tf.tanh):
    w = v1.get_variable("w", [int(x.shape[-1]), units], initializer=_init(seed))
    b = v1.get_variable("b", [units], initializer=v1.zeros_initializer())
    y = tf.matmul(x, w) + b
    return activation(y) if activation is not None else y


def _moments(x, axes: Sequence[int], group: Optional[np.ndarray]):
    """Mean and variance over `axes` (axis 0 among them): of the whole batch, or per group of consecutive rows
    (broadcast back to each row). Each group's statistics are tf.nn.moments of its rows, as the pipeline computes
    them for its slice: an ulp here decides a ReLU's gradient at an exact 0 (a one-row group normalizes to exactly
    beta), which segment means under grappler's constant folding missed (long-run case 586)."""
    if group is None:
        return tf.nn.moments(x, axes, keepdims=True)
    if np.any(np.diff(group) < 0):
        raise ValueError(f"batch-norm groups must be runs of consecutive rows, got {group.tolist()}")
    parts = tf.split(x, np.bincount(group).tolist(), axis=0)
    stats = [tf.nn.moments(part, axes, keepdims=True) for part in parts]
    return tuple(tf.concat([tf.broadcast_to(s[k], tf.shape(part)) for s, part in zip(stats, parts)], 0)
                 for k in (0, 1))


def _batch_norm(x, axes, group, moving: bool):
    channels = int(x.shape[-1])
    gamma = v1.get_variable("gamma", [channels], initializer=v1.ones_initializer())
    beta = v1.get_variable("beta", [channels], initializer=v1.zeros_initializer())
    mean, variance = _moments(x, axes, group)
    if moving and group is None:  # moving statistics in UPDATE_OPS (the pipeline averages the slices')
        moving_mean = v1.get_variable("moving_mean", [channels], initializer=v1.zeros_initializer(), trainable=False)
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS,
                             v1.assign(moving_mean, 0.9 * moving_mean + 0.1 * tf.reshape(mean, [channels])))
    return (x - mean) * tf.math.rsqrt(variance + 1e-3) * gamma + beta


def _attention(x, ids, seed: int):
    with v1.variable_scope("q"):
        q = _dense(x, WIDTH, seed, None)
    with v1.variable_scope("k"):
        k = _dense(x, WIDTH, seed + 1, None)
    with v1.variable_scope("v"):
        v = _dense(x, WIDTH, seed + 2, None)
    scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(WIDTH)
    scores += (1.0 - tf.cast(tf.not_equal(ids, 0), tf.float32))[:, None, :] * -1e4
    return x + tf.matmul(tf.nn.softmax(scores), v)


def _time_attention(x, ids, seed: int):
    """_attention on time-major [seq, batch, width] activations, as TF1 Transformer-XL code writes it."""
    with v1.variable_scope("q"):
        q = _dense(tf.reshape(x, [-1, WIDTH]), WIDTH, seed, None)
    with v1.variable_scope("k"):
        k = _dense(tf.reshape(x, [-1, WIDTH]), WIDTH, seed + 1, None)
    with v1.variable_scope("v"):
        v = _dense(tf.reshape(x, [-1, WIDTH]), WIDTH, seed + 2, None)
    q, k, v = (tf.reshape(t, [SEQ, -1, WIDTH]) for t in (q, k, v))
    padding = 1.0 - tf.cast(tf.not_equal(tf.transpose(ids), 0), tf.float32)  # [k, batch]
    scores = tf.einsum("ibd,jbd->ijb", q, k) / np.sqrt(WIDTH) + padding[None] * -1e4  # [q, k, batch]
    return x + tf.einsum("ijb,jbd->ibd", tf.nn.softmax(scores, axis=1), v)


def model_fn(layers: Sequence[str], groups: Optional[Dict[int, np.ndarray]] = None):
    """model_fn(features, labels) -> mean loss of the layers; `groups`: the reference's batch-norm groups."""
    groups = groups or {}

    def build(features, labels):
        x, ids, flat_outputs, batch_size = features, features, [], None
        for i, kind in enumerate(layers):
            with v1.variable_scope(f"l{i}_{kind}"):
                if i == 0:
                    batch_size = tf.shape(features)[0]  # read once, used by later layers (TF1 style)
                seed = 100 + i
                if kind == "dense":
                    x = _dense(x if x.dtype == tf.float32 else tf.cast(x, tf.float32), WIDTH, seed)
                elif kind == "keras_dense":
                    x = tf.keras.layers.Dense(WIDTH, activation="relu", kernel_initializer=_init(seed), name="keras")(x)
                elif kind == "layer_norm":
                    mean, variance = tf.nn.moments(x, [-1], keepdims=True)
                    x = (x - mean) * tf.math.rsqrt(variance + 1e-3) * v1.get_variable(
                        "gamma", [WIDTH], initializer=v1.ones_initializer())
                elif kind == "batch_norm":
                    x = _batch_norm(x, [0], groups.get(i), moving=True)
                elif kind == "skip":
                    x = _dense(x, WIDTH, seed) + flat_outputs[0]
                elif kind == "shape_rows":
                    rows = tf.reshape(x, [batch_size * 2, WIDTH // 2])  # two rows per sample
                    rows = rows * v1.get_variable("w", [WIDTH // 2], initializer=v1.ones_initializer()) + 0.1
                    x = tf.reshape(rows, [batch_size, WIDTH])
                elif kind == "conv":
                    w = v1.get_variable("w", [3, 3, int(x.shape[-1]), FILTERS], initializer=_init(seed))
                    x = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))
                elif kind == "batch_norm4d":
                    x = _batch_norm(x, [0, 1, 2], groups.get(i), moving=False)
                elif kind == "flatten":
                    x = _dense(tf.reshape(x, [-1, int(np.prod(x.shape.as_list()[1:]))]), WIDTH, seed)
                elif kind == "embedding":
                    table = v1.get_variable("table", [VOCAB, WIDTH], initializer=_init(seed))
                    x = tf.gather(table, features)
                elif kind == "time_embedding":
                    table = v1.get_variable("table", [VOCAB, WIDTH], initializer=_init(seed))
                    x = tf.gather(table, tf.transpose(features))  # [seq, batch, width]
                elif kind == "time_attention":
                    x = _time_attention(tf.reshape(x, [SEQ, -1, WIDTH]), ids, seed)
                elif kind == "time_pool":
                    x = tf.reduce_mean(x, axis=0)
                elif kind == "attention":
                    x = _attention(tf.reshape(x, [-1, SEQ, WIDTH]), ids, seed)
                elif kind == "rows":  # [batch * seq, width]: what crosses the next boundary has 5 rows a sample
                    x = _dense(tf.reshape(x, [-1, WIDTH]), WIDTH, seed)
                elif kind == "pool":
                    x = tf.reduce_mean(tf.reshape(x, [-1, SEQ, WIDTH]), axis=1)
                elif kind == "head":
                    logits = _dense(x, CLASSES, seed, None)
                    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                                         logits=logits))
                else:
                    raise ValueError(f"unknown layer kind {kind!r}")
                if kind in ("dense", "flatten", "pool", "time_pool"):  # [batch, width]: what skip layers add
                    flat_outputs.append(x)
        raise ValueError("the layers end without a head")

    return build
