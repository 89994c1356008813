"""Sync batch norm on batch norms nobody here wrote: tf-slim's resnet_v1 (slim.batch_norm, fused) and a keras
BatchNormalization layer, in replicated stages, train like one device fed the same micro-batches."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from tests import slim_nets
from tests.pipeline_harness import cpu, initial_weights
from tests.test_pipeline_sync_batch_norm import assert_close, max_difference, pipelined, reference

pytestmark = pytest.mark.primary_only


def images(n, size, seed=0):
    rng = np.random.RandomState(seed)
    return rng.rand(n, size, size, 3).astype(np.float32), rng.randint(0, 5, n).astype(np.int32)


@pytest.mark.slow  # ~25-30 s: slim's 12 norms make a large gradient graph; built twice
def test_slim_resnet_with_sync_batch_norm_trains_like_single_device():
    model_fn = slim_nets.small_resnet_v1(is_training=True)
    x, y = images(6, 8)
    initial = initial_weights(model_fn, x, y)
    stages = [("resnet/conv1", "resnet/block1", [cpu(0), cpu(1)]), ("resnet/block2", "resnet/logits", [cpu(2), cpu(3)])]
    want_weights, want_moving = reference(model_fn, x, y, 2, parts=1, initial=initial)
    assert len(want_moving) == 2 * 12  # every slim batch norm's moving mean and variance
    weights, moving = pipelined(model_fn, x, y, stages, 2, initial=initial, schedule="gpipe", batch_norm="sync",
                                layers=dapple_tf.layers_by_scope(depth=2))
    # float32 through 12 norms: 3.4e-5 apart (float64: 5e-14). Loss gradients jump where two max-pool inputs
    # tie; initial_weights' fixed seed keeps them 4e-4 (relative) apart, 40 times the weights' round-off
    # (another seed, one in 16, put two within 9e-6 after a step: 1.5e-3 in resnet/conv1/weights).
    assert_close(want_weights, weights, rtol=1e-4, atol=2e-4)
    assert_close(want_moving, moving, rtol=1e-4, atol=2e-4)
    sliced, _ = pipelined(model_fn, x, y, stages, 2, initial=initial, schedule="gpipe", batch_norm="per_slice",
                          layers=dapple_tf.layers_by_scope(depth=2))
    assert max_difference(want_weights, sliced) > 1e-2


def keras_bn_model_fn(features, labels):
    with dapple_tf.layer("conv"):
        h = tf.keras.layers.Conv2D(4, 1, kernel_initializer=tf.constant_initializer(
            np.random.RandomState(0).randn(1, 1, 3, 4) * 0.7))(features)
        bn = tf.keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-3, beta_initializer="ones")
        h = tf.nn.relu(bn(h, training=True))
        for update in bn.updates:
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
    with dapple_tf.layer("head"):
        dense = tf.keras.layers.Dense(3, kernel_initializer=tf.constant_initializer(
            np.random.RandomState(1).randn(16, 3) * 0.5))
        logits = dense(tf.reshape(h, [-1, 16]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_keras_batch_normalization_with_sync_trains_like_accumulated_micro_batches():
    rng = np.random.RandomState(4)
    x, y = (rng.randn(8, 2, 2, 3) * 2).astype(np.float32), rng.randint(0, 3, 8).astype(np.int32)
    stages = [("conv", "conv", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])]
    want_weights, want_moving = reference(keras_bn_model_fn, x, y, 3, parts=2)
    assert len(want_moving) == 2
    with pytest.warns(dapple_tf.BatchNormWarning, match="all replicas of a stage together"):
        weights, moving = pipelined(keras_bn_model_fn, x, y, stages, 3, num_micro_batches=2, batch_norm="sync")
    assert_close(want_weights, weights, rtol=2e-5, atol=2e-6)
    assert_close(want_moving, moving, rtol=2e-5, atol=2e-6)
    with pytest.warns(dapple_tf.BatchNormWarning, match="split further across a stage's replicas"):
        sliced_weights, _ = pipelined(keras_bn_model_fn, x, y, stages, 3, num_micro_batches=2)
    assert max_difference(want_weights, sliced_weights) > 1e-2


def test_estimator_model_fn_forwards_batch_norm():
    pytest.importorskip("tensorflow_estimator")
    from dapple_tf.frontends import estimator as dapple_estimator

    plan = dapple_tf.Plan.from_stages([("conv", "conv", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])], 1)
    with pytest.raises(dapple_tf.DappleError, match=r"batch_norm must be one of \('per_slice', 'sync'\)"):
        dapple_estimator.model_fn(keras_bn_model_fn, lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                  batch_norm="global")
