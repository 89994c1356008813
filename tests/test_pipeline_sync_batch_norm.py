"""Sync batch norm (PipelineOptions(batch_norm="sync")): a replicated stage normalizes with the statistics of
the whole micro-batch, so training equals one device fed the same micro-batches, moving averages included."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.rewrite.batch.batch_norm import BatchNormWarning
from dapple_tf.errors import DappleError
from tests.pipeline_harness import SESSION_CONFIG, cpu, split_options

DECAY, EPS, LR, C = 0.9, 1e-3, 0.5, 4
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS


def _variable(name, shape, seed, scale=0.7, trainable=True):
    value = (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)
    return tf.compat.v1.get_variable(name, initializer=tf.constant(value), trainable=trainable)


def fused_norm(h, name, seed, fused_average=False):
    """Batch norm as tf.compat.v1.nn.fused_batch_norm gives it, moving averages in UPDATE_OPS: computed by
    the op itself (exponential_avg_factor) if `fused_average`, else from its statistics."""
    channels = h.shape[-1]
    gamma = _variable(f"{name}/gamma", [channels], seed, 0.3) + 1.0
    beta = _variable(f"{name}/beta", [channels], seed + 1, 0.3)
    moving_mean = _variable(f"{name}/moving_mean", [channels], seed + 2, trainable=False)
    moving_var = tf.compat.v1.get_variable(f"{name}/moving_var", initializer=tf.ones([channels]), trainable=False)
    if fused_average:
        y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
            h, gamma, beta, moving_mean, moving_var, epsilon=EPS, is_training=True, exponential_avg_factor=1 - DECAY)
        for moving, value in ((moving_mean, mean), (moving_var, variance)):
            tf.compat.v1.add_to_collection(UPDATE_OPS, moving.assign(value))
        return y
    y, mean, variance = tf.compat.v1.nn.fused_batch_norm(h, gamma, beta, epsilon=EPS, is_training=True)
    for moving, value in ((moving_mean, mean), (moving_var, variance)):
        tf.compat.v1.add_to_collection(UPDATE_OPS, moving.assign_sub((moving - value) * (1 - DECAY)))
    return y


def conv_bn_model_fn(features, labels):
    """conv -> fused BN -> relu -> conv -> fused BN (two norms in the first stage), then a norm computing its
    own moving averages and the head."""
    with dapple_tf.layer("block1"):
        h = tf.nn.conv2d(features, _variable("w0", [1, 1, 3, C], 0), 1, "SAME")
        h = tf.nn.relu(fused_norm(h, "bn0", 10))
        h = fused_norm(tf.nn.conv2d(h, _variable("w1", [2, 2, C, C], 1), 1, "SAME"), "bn1", 20)
    with dapple_tf.layer("block2"):
        h = tf.nn.relu(fused_norm(tf.tanh(h), "bn2", 30, fused_average=True))
    with dapple_tf.layer("head"):
        logits = tf.matmul(tf.reshape(h, [-1, 4 * C]), _variable("w2", [4 * C, 3], 2))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def data(n, seed=3):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, 2, 2, 3) * 2 + 0.5).astype(np.float32), rng.randint(0, 3, n).astype(np.int32)


def _moving_averages():
    return [v for v in tf.compat.v1.global_variables() if not v.trainable and "moving" in v.op.name]


def _load(sess, variables, initial):
    for v in variables:
        if v.op.name in initial:
            v.load(initial[v.op.name], sess)


def reference(model_fn, x, y, steps, parts, initial=None):
    """One device, SGD: each step the mean of the gradients of `parts` equal micro-batches run alone, and the
    moving averages moved towards the mean of their statistics (the update is affine in the statistic).
    `initial`: values of trainable variables by name. Returns (weights, moving averages) by name."""
    with tf.Graph().as_default():
        xp = tf.compat.v1.placeholder(tf.float32, [None] + list(x.shape[1:]))
        yp = tf.compat.v1.placeholder(tf.int32, [None])
        loss = model_fn(xp, yp)
        variables = tf.compat.v1.trainable_variables()
        moving = _moving_averages()
        grads, updates = tf.gradients(loss, variables), tf.compat.v1.get_collection(UPDATE_OPS)
        size = len(x) // parts
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _load(sess, variables, initial or {})
            for _ in range(steps):
                old, per_part, new_moving = sess.run(variables), [], []
                old_moving = sess.run(moving)
                for p in range(parts):
                    feed = {xp: x[p * size:(p + 1) * size], yp: y[p * size:(p + 1) * size]}
                    per_part.append(sess.run(grads, feed))
                    for v, value in zip(moving, old_moving):
                        v.load(value, sess)
                    sess.run(updates, feed)
                    new_moving.append(sess.run(moving))
                for i, v in enumerate(variables):
                    v.load(old[i] - LR * np.mean([g[i] for g in per_part], axis=0), sess)
                for i, v in enumerate(moving):
                    v.load(np.mean([m[i] for m in new_moving], axis=0), sess)
            return (dict(zip([v.op.name for v in variables], sess.run(variables))),
                    dict(zip([v.op.name for v in moving], sess.run(moving))))


def pipelined(model_fn, x, y, stages, steps, num_micro_batches=1, initial=None, **build):
    """build_pipeline's SGD training for `steps` steps: (weights, moving averages) by name."""
    with tf.Graph().as_default():
        plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=num_micro_batches)
        options, rest = split_options(**build)
        handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y),
                                          tf.compat.v1.train.GradientDescentOptimizer(LR), plan, options, **rest)
        variables = [v for _, v in handle.grads_and_vars]
        moving = _moving_averages()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            if initial:
                _load(sess, variables, initial)
                sess.run(handle.local_init_op)
            for _ in range(steps):
                sess.run(handle.train_op)
            return (dict(zip([v.op.name for v in variables], sess.run(variables))),
                    dict(zip([v.op.name for v in moving], sess.run(moving))))


def assert_close(want, got, rtol, atol):
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


def max_difference(want, got):
    return max(np.abs(want[name] - got[name]).max() for name in want)


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
def test_sync_with_one_micro_batch_equals_single_device_training(schedule, recwarn):
    x, y = data(7)  # slices of 4 and 3 samples
    stages = [("block1", "block1", [cpu(0), cpu(1)]), ("block2", "head", [cpu(2)])]
    want_weights, want_moving = reference(conv_bn_model_fn, x, y, 3, parts=1)
    weights, moving = pipelined(conv_bn_model_fn, x, y, stages, 3, schedule=schedule, batch_norm="sync")
    assert_close(want_weights, weights, rtol=2e-5, atol=2e-6)
    assert_close(want_moving, moving, rtol=2e-5, atol=2e-6)
    assert not [w for w in recwarn if issubclass(w.category, BatchNormWarning)]  # exact: nothing to warn about
    with pytest.warns(BatchNormWarning, match=r"normalizes each micro-batch slice with its own statistics \(micro-"
                                              r"batches of 7 samples, split further across a stage's replicas; "
                                              r"batch_norm='sync' joins the replicas' slices\)"):
        sliced_weights, _ = pipelined(conv_bn_model_fn, x, y, stages, 3, schedule=schedule)
    assert max_difference(want_weights, sliced_weights) > 1e-2  # per-slice statistics are another model


@pytest.mark.parametrize("schedule,recompute", [("dapple", False), ("gpipe", True)])
def test_sync_with_micro_batches_equals_accumulated_micro_batches(schedule, recompute):
    x, y = data(12)  # 2 micro-batches of 6, replicated stages: slices of 3
    stages = [("block1", "block1", [cpu(0), cpu(1)]), ("block2", "head", [cpu(2), cpu(3)])]
    want_weights, want_moving = reference(conv_bn_model_fn, x, y, 3, parts=2)
    with pytest.warns(BatchNormWarning, match=r"normalizes each micro-batch \(6 samples, all replicas of a stage "
                                              r"together \(batch_norm='sync'\)\) with its own statistics"):
        weights, moving = pipelined(conv_bn_model_fn, x, y, stages, 3, num_micro_batches=2, schedule=schedule,
                                    batch_norm="sync", recompute=recompute)
    assert_close(want_weights, weights, rtol=2e-5, atol=2e-6)
    assert_close(want_moving, moving, rtol=2e-5, atol=2e-6)


def moments_model_fn(features, labels, update_ops=True):
    """A non-fused batch norm (tf.nn.moments), with or without moving averages in UPDATE_OPS."""
    with dapple_tf.layer("block1"):
        mean, variance = tf.nn.moments(features, [0, 1, 2])
        moving = tf.compat.v1.get_variable("moving_mean", initializer=tf.zeros([3]), trainable=False)
        if update_ops:
            tf.compat.v1.add_to_collection(UPDATE_OPS, moving.assign_sub((moving - mean) * (1 - DECAY)))
        h = (features - mean) * tf.math.rsqrt(variance + EPS) * _variable("gamma", [3], 0)
    with dapple_tf.layer("head"):
        logits = tf.matmul(tf.reshape(h, [-1, 12]), _variable("w", [12, 3], 1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def update_op_reading_a_mean_model_fn(features, labels):
    """The moving average of a statistic that no batch norm computes (a plain mean over the batch)."""
    with dapple_tf.layer("block1"):
        moving = tf.compat.v1.get_variable("moving_mean", initializer=tf.zeros([]), trainable=False)
        mean = tf.reduce_mean(features)
        tf.compat.v1.add_to_collection(UPDATE_OPS, moving.assign(mean))
        h = (features - mean) * _variable("gamma", [3], 0)
    with dapple_tf.layer("head"):
        logits = tf.matmul(tf.reshape(h, [-1, 12]), _variable("w", [12, 3], 1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


@pytest.mark.parametrize("update_ops", [True, False])
def test_sync_synchronizes_a_non_fused_batch_norm_in_a_replicated_stage(update_ops, recwarn):
    """tf.nn.moments' means over the batch axis become all-reduced means: one device's training, M=1."""
    x, y = data(7)  # slices of 4 and 3 samples
    stages = [("block1", "block1", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])]
    model_fn = lambda f, l: moments_model_fn(f, l, update_ops)  # noqa: E731
    want_weights, want_moving = reference(model_fn, x, y, 3, parts=1)
    weights, moving = pipelined(model_fn, x, y, stages, 3, batch_norm="sync")
    assert_close(want_weights, weights, rtol=2e-5, atol=2e-6)
    assert_close(want_moving, moving, rtol=2e-5, atol=2e-6)
    assert not [w for w in recwarn if issubclass(w.category, BatchNormWarning)]
    with pytest.warns(BatchNormWarning, match=r"\(block1/moments/mean, block1/moments/variance\) normalizes each "
                                              r"micro-batch slice"):
        sliced_weights, _ = pipelined(model_fn, x, y, stages, 3)
    assert max_difference(want_weights, sliced_weights) > 1e-2


def test_sync_refuses_update_ops_reading_other_statistics_and_unknown_modes():
    x, y = data(4)
    stages = [("block1", "block1", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])]
    with pytest.raises(DappleError, match=r"but an update op reads block1/Mean:0 \(Mean\) from stage 0, which is "
                                          r"replicated: it is computed from the replica's own slice, not from "
                                          r"synchronized statistics") as refused:
        pipelined(update_op_reading_a_mean_model_fn, x, y, stages, 0, batch_norm="sync")
    assert "4-D" not in str(refused.value) and "fused" in str(refused.value)
    with pytest.raises(DappleError, match=r"batch_norm must be one of \('per_slice', 'sync'\), got 'global'"):
        pipelined(conv_bn_model_fn, x, y, stages, 0, batch_norm="global")


def summed_statistics_model_fn(features, labels):
    """A batch mean written as a sum over the batch axis divided by the slice's own sample count."""
    with dapple_tf.layer("block1"):
        count = tf.cast(tf.shape(features)[0], tf.float32)
        h = (features - tf.reduce_sum(features, [0], keepdims=True) / count) * _variable("gamma", [3], 0)
    with dapple_tf.layer("head"):
        logits = tf.matmul(tf.reshape(h, [-1, 12]), _variable("w", [12, 3], 1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_sync_refuses_a_sum_over_the_batch_in_a_replicated_stage():
    x, y = data(4)
    stages = [("block1", "block1", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])]
    with pytest.raises(DappleError, match=r"but stage 0, which is replicated, sums over the batch in block1/Sum "
                                          r"\(a Sum keeping dims\): what the sum is divided by cannot be told"):
        pipelined(summed_statistics_model_fn, x, y, stages, 0, batch_norm="sync")
    with pytest.warns(BatchNormWarning, match=r"\(block1/Sum\) normalizes each micro-batch slice"):
        pipelined(summed_statistics_model_fn, x, y, stages, 0)


def test_trainer_forwards_batch_norm_to_build_pipeline():
    from dapple_tf.frontends.trainer import Trainer

    x, y = data(4)
    plan = dapple_tf.Plan.from_stages([("block1", "block1", [cpu(0), cpu(1)]), ("block2", "head", [cpu(2)])], 1)
    with pytest.raises(DappleError, match=r"batch_norm must be one of \('per_slice', 'sync'\), got 'global'"):
        Trainer(conv_bn_model_fn, lambda step: (tf.constant(x), tf.constant(y)),
                tf.compat.v1.train.GradientDescentOptimizer(LR), plan, batch_norm="global")


def cond_bn_model_fn(features, labels):
    """A fused batch norm inside a tf.cond branch (a function body)."""
    with dapple_tf.layer("block1"):
        gamma, beta = _variable("gamma", [3], 0), _variable("beta", [3], 1)
        h = tf.cond(tf.reduce_all(tf.equal(tf.shape(features)[1:3], 2)),
                    lambda: tf.compat.v1.nn.fused_batch_norm(features, gamma, beta, is_training=True)[0],
                    lambda: features)
    with dapple_tf.layer("head"):
        logits = tf.matmul(tf.reshape(h, [-1, 12]), _variable("w", [12, 3], 1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_sync_refuses_a_fused_batch_norm_inside_control_flow():
    x, y = data(4)
    stages = [("block1", "block1", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])]
    with pytest.raises(DappleError, match=r"batch_norm='sync': stage 0 runs batch norm FusedBatchNormV3 inside "
                                          r"function .+ \(a tf.cond or loop body\), which cannot be synchronized"):
        pipelined(cond_bn_model_fn, x, y, stages, 0, batch_norm="sync")
