"""Small models for runtime tests: plain TF ops, deterministic initial values, a skip connection."""

import numpy as np
import tensorflow as tf

import dapple_tf

IN, HIDDEN, CLASSES = 6, 8, 3
LAYERS = ["dense0", "dense1", "dense2", "dense3", "head"]


def initial_values(seed=0):
    rng = np.random.RandomState(seed)
    shapes = {
        "w0": (IN, HIDDEN), "b0": (HIDDEN,), "w1": (HIDDEN, HIDDEN), "b1": (HIDDEN,),
        "w2": (HIDDEN, HIDDEN), "w3": (HIDDEN, HIDDEN), "skip": (HIDDEN, HIDDEN), "b3": (HIDDEN,),
        "wo": (HIDDEN, CLASSES),
    }
    return {k: (rng.randn(*s) * 0.5).astype(np.float32) for k, s in shapes.items()}


def skip_model_fn(values):
    """A 5-layer model; dense3 also reads dense0's output (a skip over two boundaries in 4 stages)."""

    def var(name):
        return tf.compat.v1.get_variable(name, initializer=tf.constant(values[name]), use_resource=True)

    def model_fn(features, labels):
        with dapple_tf.layer("dense0"):
            h0 = tf.tanh(tf.matmul(features, var("w0")) + var("b0"))
        with dapple_tf.layer("dense1"):
            h1 = tf.tanh(tf.matmul(h0, var("w1")) + var("b1"))
        return _dense2_to_head(h0, h1, labels, var)[2]

    return model_fn


def _dense2_to_head(h0, h1, labels, var, accuracy=False):
    """Layers dense2, dense3 (reading dense0's output too) and head: (dense2's output, logits, loss, the batch's
    accuracy if asked for, else None)."""
    with dapple_tf.layer("dense2"):
        h2 = tf.tanh(tf.matmul(h1, var("w2")))
    with dapple_tf.layer("dense3"):
        h3 = tf.tanh(tf.matmul(h2, var("w3")) + tf.matmul(h0, var("skip")) + var("b3"))
    with dapple_tf.layer("head"):
        logits = tf.matmul(h3, var("wo"))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels) if accuracy else None
        share = tf.reduce_mean(tf.cast(correct, tf.float32)) if accuracy else None
    return h2, logits, loss, share


def batch(n, seed=1):
    rng = np.random.RandomState(seed)
    return rng.randn(n, IN).astype(np.float32), rng.randint(0, CLASSES, size=n).astype(np.int32)


def tied_model_fn(values):
    """Weights shared across stages: dense0's matrix is also the output projection (tied), and a
    scale variable is created outside any layer, on no device."""

    def model_fn(features, labels):
        scale = tf.compat.v1.get_variable("scale", initializer=tf.constant(1.5))
        with dapple_tf.layer("dense0"):
            w0 = tf.compat.v1.get_variable("w0", initializer=tf.constant(values["w0"]))
            h0 = tf.tanh(tf.matmul(features, w0) * scale)
        with dapple_tf.layer("dense1"):
            h1 = tf.tanh(tf.matmul(h0, tf.compat.v1.get_variable("w1", initializer=tf.constant(values["w1"]))))
        with dapple_tf.layer("head"):
            logits = tf.matmul(h1, w0, transpose_b=True)  # [batch, IN] logits; labels < CLASSES <= IN
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    return model_fn


def _resource_variables(values):
    """get_variable(name, initializer=None, trainable=True) of resource variables, initialized from `values`."""

    def var(name, initializer=None, trainable=True):
        initializer = tf.constant(values[name]) if initializer is None else initializer
        return tf.compat.v1.get_variable(name, initializer=initializer, trainable=trainable, use_resource=True)

    return var


def _moving_averages(var, mean, variance):
    """A batch norm's moving mean and variance, updated in UPDATE_OPS."""
    for name, value, start in (("moving_mean", mean, tf.zeros([HIDDEN])),
                               ("moving_variance", variance, tf.ones([HIDDEN]))):
        moving = var(name, start, trainable=False)
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, moving.assign_sub((moving - value) * 0.1))


def batch_norm_model_fn(values):
    """skip_model_fn's layers with a batch norm in dense1 (moving averages in UPDATE_OPS), the model's summaries
    (a scalar mean, a histogram of activations) and extra outputs (logits, accuracy): what is combined over the
    clones once per step."""

    var = _resource_variables(values)

    def model_fn(features, labels):
        with dapple_tf.layer("dense0"):
            h0 = tf.tanh(tf.matmul(features, var("w0")) + var("b0"))
        with dapple_tf.layer("dense1"):
            mean, variance = tf.nn.moments(h0, [0])
            _moving_averages(var, mean, variance)
            h1 = tf.tanh(tf.matmul((h0 - mean) * tf.math.rsqrt(variance + 1e-3), var("w1")) + var("b1"))
            tf.compat.v1.summary.histogram("h1", h1)
        h2, logits, loss, accuracy = _dense2_to_head(h0, h1, labels, var, accuracy=True)
        tf.compat.v1.summary.scalar("loss", loss)
        tf.compat.v1.summary.scalar("h2_mean", tf.reduce_mean(h2))
        return loss, {"logits": logits, "accuracy": accuracy}

    return model_fn


def fused_batch_norm_model_fn(values):
    """batch_norm_model_fn's layers with a fused batch norm (FusedBatchNormV3, trainable scale and offset) in
    dense1 and its moving averages in UPDATE_OPS."""

    var = _resource_variables(values)

    def model_fn(features, labels):
        with dapple_tf.layer("dense0"):
            h0 = tf.tanh(tf.matmul(features, var("w0")) + var("b0"))
        with dapple_tf.layer("dense1"):
            normalized, mean, variance = tf.compat.v1.nn.fused_batch_norm(
                tf.reshape(h0, [-1, 1, 1, HIDDEN]), var("scale", tf.ones([HIDDEN]) * 1.5),
                var("offset", tf.fill([HIDDEN], 0.1)), epsilon=1e-3, is_training=True)
            _moving_averages(var, mean, variance)
            h1 = tf.tanh(tf.matmul(tf.reshape(normalized, [-1, HIDDEN]), var("w1")) + var("b1"))
        return _dense2_to_head(h0, h1, labels, var)[2]

    return model_fn


STEPS_IN_SEQUENCE, STATE = 5, 4


def control_flow_model_fn(features, labels):
    """An RNN layer built with tf.while_loop and a tf.cond layer: functional control flow in stages.

    features: [batch, STEPS_IN_SEQUENCE, STATE] floats; labels: [batch, STATE] floats.
    """
    with dapple_tf.layer("rnn"):
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(np.eye(STATE, dtype=np.float32) * 0.5))
        u = tf.compat.v1.get_variable("u", initializer=tf.constant(np.full((STATE, STATE), 0.1, np.float32)))
        steps = tf.transpose(features, [1, 0, 2])

        def body(t, h):
            return t + 1, tf.tanh(tf.matmul(steps[t], w) + tf.matmul(h, u))

        _, h = tf.while_loop(lambda t, h: t < STEPS_IN_SEQUENCE, body, [tf.constant(0), tf.zeros_like(steps[0])])
    with dapple_tf.layer("gate"):
        h = tf.cond(tf.reduce_sum(w) > 0.0, lambda: h * 2.0, lambda: h)
    with dapple_tf.layer("head"):
        return tf.reduce_mean(tf.square(h - labels))


def sequence_batch(n, seed=2):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, STEPS_IN_SEQUENCE, STATE).astype(np.float32)
    return x, rng.randn(n, STATE).astype(np.float32)


VOCAB, EMBED, TOKENS = 11, 4, 3


def embedding_model_fn(features, labels):
    """Dict features, an embedding lookup (sparse gradients), and an integer tensor crossing stages."""
    rng = np.random.RandomState(3)
    with dapple_tf.layer("embed"):
        table = tf.compat.v1.get_variable("table", initializer=tf.constant(rng.randn(VOCAB, EMBED).astype(np.float32)))
        vectors = tf.nn.embedding_lookup(table, features["ids"])  # [batch, TOKENS, EMBED]
        mask = tf.cast(features["ids"] > 0, tf.int32)  # an int tensor for the next stage
    with dapple_tf.layer("pool"):
        weights = tf.cast(mask, tf.float32)[:, :, None]
        pooled = tf.reduce_sum(vectors * weights, axis=1) + features["dense"]
    with dapple_tf.layer("head"):
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(rng.randn(EMBED, 2).astype(np.float32)))
        logits = tf.matmul(pooled, w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def tied_embedding_model_fn(features, labels):
    """embedding_model_fn with its table also the output projection (tied, as language models tie them): gathered
    rows in the first stage, a dense gradient in the last."""
    rng = np.random.RandomState(3)
    with dapple_tf.layer("embed"):
        table = tf.compat.v1.get_variable("table", initializer=tf.constant(rng.randn(VOCAB, EMBED).astype(np.float32)))
        vectors = tf.nn.embedding_lookup(table, features["ids"])
    with dapple_tf.layer("pool"):
        pooled = tf.reduce_mean(vectors, axis=1) + features["dense"]
    with dapple_tf.layer("head"):
        logits = tf.matmul(pooled, table, transpose_b=True)  # labels < 2 <= VOCAB
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def embedding_batch(n, seed=4):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, VOCAB, size=(n, TOKENS)).astype(np.int32)
    dense = rng.randn(n, EMBED).astype(np.float32)
    return {"ids": ids, "dense": dense}, rng.randint(0, 2, size=n).astype(np.int32)
