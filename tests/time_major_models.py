"""Toy sequence models written time-major, as TF1 Transformer-XL and GNMT code is: batch-major features transposed to
[len, batch], activations [len, batch, d], an attention mask [q, k, batch, 1] built once before the first block,
per-block biases sliced from one variable. For tests/test_pipeline_batch_axis.py."""

import numpy as np
import tensorflow as tf

import dapple_tf

LENGTH, DIM, VOCAB, BLOCKS, CLASSES = 5, 4, 13, 3, 3


def _variable(name, shape, seed):
    rng = np.random.RandomState(seed)
    return tf.compat.v1.get_variable(name, initializer=tf.constant((rng.randn(*shape) * 0.5).astype(np.float32)))


def attention_model_with_outputs_fn(features, labels):
    """(loss, {"states": the last block's [len, batch, dim], "logits"}) of three attention blocks on [len, batch, dim] activations. The `embed` layer builds, from the inputs alone, the
    mask [q, k, batch, 1] every block reads (computed again by each stage), and a learned copy of it that depends on a
    variable (sent across every boundary, split along axis 2); each block adds its row of the shared `bias`."""
    bias = _variable("bias", [BLOCKS, DIM], 7)  # read by every block: bias[i]
    with dapple_tf.layer("embed"):
        table = _variable("table", [VOCAB, DIM], 1)
        ids = tf.transpose(features["ids"], [1, 0])  # [len, batch]
        h = tf.nn.embedding_lookup(table, ids)  # [len, batch, dim]
        keep = tf.cast(tf.transpose(features["mask"], [1, 0]), tf.float32)  # [len, batch]
        mask = (1.0 - keep)[None, :, :, None] * tf.ones([LENGTH, 1, 1, 1])  # [q, k, batch, 1]
        gate = tf.compat.v1.get_variable("gate", initializer=tf.constant(2.0))
        learned_mask = mask * gate
    for i in range(BLOCKS):
        with dapple_tf.layer(f"block{i}"):
            w = _variable(f"w{i}", [DIM, DIM], 10 + i)
            scores = tf.einsum("ibd,jbd->ijb", h, h)[:, :, :, None] * 0.5 - 5.0 * (mask + learned_mask)
            attention = tf.nn.softmax(scores, axis=1)  # over the keys
            context = tf.einsum("ijbn,jbd->ibd", attention, h)
            h = tf.tanh(tf.einsum("ibd,de->ibe", context, w) + bias[i])
    with dapple_tf.layer("head"):
        out = _variable("out", [DIM, CLASSES], 20)
        logits = tf.matmul(h[-1], out)  # the last position: [batch, classes]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        return loss, {"states": h, "logits": logits}


def attention_model_fn(features, labels):
    return attention_model_with_outputs_fn(features, labels)[0]


def batch(n, seed=3):
    """(features, labels) of n samples: token ids, a mask keeping each sequence's first 2-5 positions."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, VOCAB, size=(n, LENGTH)).astype(np.int32)
    lengths = rng.randint(2, LENGTH + 1, size=n)
    mask = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.int32)
    return {"ids": ids, "mask": mask}, rng.randint(0, CLASSES, size=n).astype(np.int32)
