"""The model's own summaries in pipelined training (dapple_tf/rewrite/template/summaries.py): scalar means, a streaming
metric's update, inputs as images equal to one device's every step; histograms of activations from the first
micro-batch; a summary of a batch statistic dropped with a warning naming it. Through the Estimator:
tests/test_image_script.py."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from tests.pipeline_harness import SESSION_CONFIG, cpu

v1 = tf.compat.v1
IN, HIDDEN, CLASSES, N, M = 6, 8, 3, 16, 2
STAGES = [("in", "in", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])]  # 2:1, M=2: slices of 4 samples


def model_fn(features, labels):
    with dapple_tf.layer("in"):
        mean = tf.reduce_mean(features, 0)  # a batch statistic (neither batch-leading nor a scalar), used as 0 * it
        w_in = v1.get_variable("w_in", [IN, HIDDEN])
        h = tf.tanh(tf.matmul(features + 0.0 * mean, w_in))
    with dapple_tf.layer("head"):
        logits = tf.matmul(h, v1.get_variable("w_out", [HIDDEN, CLASSES]))
        cross_entropy = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    _, accuracy = v1.metrics.accuracy(labels, tf.argmax(logits, 1, output_type=tf.int32))
    v1.summary.scalar("cross_entropy", cross_entropy)
    v1.summary.scalar("train_accuracy", accuracy)
    v1.summary.scalar("input_mean", tf.reduce_mean(features))
    v1.summary.image("inputs", tf.reshape(features, [-1, 2, 3, 1]), max_outputs=2)
    v1.summary.histogram("hidden", h)
    v1.summary.histogram("feature_mean", mean)
    v1.summary.scalar("w_norm", tf.norm(w_in))  # reads no batch: as it is
    return cross_entropy


def batch():
    rng = np.random.RandomState(0)
    return rng.randn(N, IN).astype(np.float32), rng.randint(0, CLASSES, N).astype(np.int32)


def values(serialized):
    summary = v1.Summary.FromString(serialized)
    out = {}
    for v in summary.value:
        kind = v.WhichOneof("value")
        out[v.tag] = v.simple_value if kind == "simple_value" else getattr(v, kind)
    return out


def run(train_op, merged, init, steps=3):
    with v1.Session(config=SESSION_CONFIG) as sess:
        sess.run(init)
        return [values(sess.run([merged, train_op])[0]) for _ in range(steps)]


def one_device(x, y):
    with tf.Graph().as_default():
        v1.set_random_seed(0)
        loss = model_fn(tf.constant(x), tf.constant(y))
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        return run(train_op, v1.summary.merge_all(), [v1.global_variables_initializer(),
                                                      v1.local_variables_initializer()])


def pipelined(x, y):
    with tf.Graph().as_default():
        v1.set_random_seed(0)
        plan = dapple_tf.Plan.from_stages(STAGES, num_micro_batches=M)
        with pytest.warns(UserWarning, match=r"summaries \['feature_mean \(it reads in/Mean:0 of shape \(6,\), neither "
                                             r"a scalar mean nor batch-leading\)'\] read the batch"):
            handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y),
                                              v1.train.GradientDescentOptimizer(0.5), plan)
        return run(handle.train_op, v1.summary.merge_all(), handle.initializer)


def test_summaries_read_what_the_pipeline_computes_once_per_step():
    x, y = batch()
    want, got = one_device(x, y), pipelined(x, y)
    for step, (w, g) in enumerate(zip(want, got)):
        assert sorted(g) == sorted(set(w) - {"feature_mean"}), step
        images = [tag for tag in w if tag.startswith("inputs/image")]
        assert len(images) == 2 and all(g[tag].encoded_image_string == w[tag].encoded_image_string for tag in images)
        for tag in ("cross_entropy", "train_accuracy", "input_mean", "w_norm"):
            np.testing.assert_allclose(g[tag], w[tag], rtol=1e-5, err_msg=f"{tag} at step {step}")
        assert w["hidden"].num == N * HIDDEN and g["hidden"].num == N // M * HIDDEN  # the first micro-batch
    assert len({round(s["train_accuracy"], 6) for s in got}) > 1  # the metric streams over steps
