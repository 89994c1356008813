"""tf-slim's networks, unmodified, pipelined through dapple_tf.layers_by_scope: the layers are their
own scopes, and pipelined training equals single-device training."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
import dapple_tf.rewrite.batch.batch_norm
from tests import slim_nets
from tests.pipeline_harness import assert_close_dicts, cpu, initial_weights, train_pipelined, train_single

pytestmark = pytest.mark.primary_only
SGD = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05)  # noqa: E731


def images(n, size, seed=0):
    rng = np.random.RandomState(seed)
    return rng.rand(n, size, size, 3).astype(np.float32), rng.randint(0, 5, n).astype(np.int32)


def layer_names(model_fn, size, spec):
    x, y = images(2, size)
    with tf.Graph().as_default():
        recorder = spec.recorder(tf.compat.v1.get_default_graph())
        with recorder.activate():
            loss = model_fn(tf.constant(x), tf.constant(y))
        recorder.drop_layers_unused_by(loss)
        return recorder.names


def test_vgg_a_and_alexnet_layers_are_their_scopes():
    assert layer_names(slim_nets.vgg_a, 224, dapple_tf.layers_by_scope(depth=2)) == [
        f"vgg_a/{name}" for name in
        ["conv1", "pool1", "conv2", "pool2", "conv3", "pool3", "conv4", "pool4", "conv5", "pool5",
         "fc6", "dropout6", "fc7", "dropout7", "fc8"]
    ]
    assert layer_names(slim_nets.alexnet_v2, 224, dapple_tf.layers_by_scope(depth=2)) == [
        f"alexnet_v2/{name}" for name in
        ["conv1", "pool1", "conv2", "pool2", "conv3", "conv4", "conv5", "pool5", "fc6", "dropout6", "fc7",
         "dropout7", "fc8"]
    ]


def test_resnet_v1_trains_like_single_device():
    model_fn = slim_nets.small_resnet_v1()
    x, y = images(8, 16)
    initial = initial_weights(model_fn, x, y)
    want_grads, want_weights, want_losses = train_single(model_fn, x, y, SGD, 2, initial=initial)
    plan = dapple_tf.Plan.from_stages(
        [("resnet/conv1", "resnet/block1", [cpu(0), cpu(1)]), ("resnet/block2", "resnet/logits", [cpu(2)])],
        num_micro_batches=2,
    )
    grads, weights, losses, handle, _ = train_pipelined(
        model_fn, x, y, SGD, plan, "dapple", 2, initial=initial, layers=dapple_tf.layers_by_scope(depth=2)
    )
    assert [s.layer_names for s in handle.stages] == [
        ("resnet/conv1", "resnet/pool1", "resnet/block1"), ("resnet/block2", "resnet/logits")
    ]
    assert_close_dicts(want_grads, grads, rtol=1e-4, atol=1e-6)
    assert_close_dicts(want_weights, weights, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.long
def test_inception_v3_by_patterns_trains_like_single_device():
    spec = dapple_tf.layers_by_scope(patterns=["InceptionV3/Conv2d_*", "InceptionV3/Mixed_*", "InceptionV3/Logits"])
    x, y = images(4, 75)
    names = layer_names(slim_nets.small_inception_v3, 75, spec)
    assert names[:2] == ["InceptionV3/Conv2d_1a_3x3", "InceptionV3/Conv2d_2a_3x3"]
    assert names[5:8] == ["InceptionV3/Mixed_5b", "InceptionV3/Mixed_5c", "InceptionV3/Mixed_5d"]
    assert names[-1] == "InceptionV3/Logits" and len(names) == 17
    initial = initial_weights(slim_nets.small_inception_v3, x, y)
    want_grads, _, _ = train_single(slim_nets.small_inception_v3, x, y, SGD, 0, initial=initial)
    plan = dapple_tf.Plan.from_stages(
        [(0, "InceptionV3/Mixed_5d", [cpu(0), cpu(1)]), ("InceptionV3/Mixed_6a", 16, [cpu(2)])], num_micro_batches=1
    )
    grads, _, _, _, _ = train_pipelined(slim_nets.small_inception_v3, x, y, SGD, plan, "dapple", 0, initial=initial,
                                        layers=spec)
    assert_close_dicts(want_grads, grads, rtol=1e-4, atol=1e-5)


def test_resnet_v1_batch_norm_in_training_mode_updates_moving_averages_once_per_step():
    model_fn = slim_nets.small_resnet_v1(is_training=True)
    x, y = images(8, 16)
    plan = dapple_tf.Plan.from_stages(
        [("resnet/conv1", "resnet/block1", [cpu(0), cpu(1)]), ("resnet/block2", "resnet/logits", [cpu(2)])],
        num_micro_batches=2,
    )
    with tf.Graph().as_default():
        with pytest.warns(dapple_tf.rewrite.batch.batch_norm.BatchNormWarning,
                          match=r"resnet/conv1/BatchNorm/FusedBatchNormV3"):
            handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), SGD(), plan,
                                              layers=dapple_tf.layers_by_scope(depth=2))
        means = [v for v in tf.compat.v1.global_variables() if v.op.name.endswith("BatchNorm/moving_mean")]
        assert len(handle.update_ops) == 2 * len(means) == 2 * 12  # conv1, 3 convs per unit x 3, 2 shortcuts
        with tf.compat.v1.Session() as sess:
            sess.run(handle.initializer)
            sess.run(handle.train_op)
            first = sess.run(means)
            sess.run(handle.train_op)
            second = sess.run(means)
    for a, b in zip(first, second):  # zero-initialized, decay 0.997: each step adds 0.3% of a batch mean
        assert np.all(np.isfinite(a)) and np.abs(a).max() > 0
        assert np.abs(b - a).max() > 0
