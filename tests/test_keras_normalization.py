"""Normalization layers as Keras users write them (Keras 2 on TF 2.15, Keras 3 on TF 2.21), pipelined.

Per-sample normalizations (LayerNormalization, which Keras 2 computes with FusedBatchNormV3 over a
reshaped tensor, GroupNormalization, instance norms) are no batch norms: no BatchNormWarning, untouched
by batch_norm="sync", equal to single-device training. BatchNormalization (2-D and 4-D: Keras 2 fused on
4-D, moments on 2-D; Keras 3 moments on both) trains in replicated and straight stages in both modes
like one device fed the micro-batches (sync) or the slices (per_slice), moving statistics included.
"""

import functools
import warnings

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.rewrite.batch import normalization
from dapple_tf.rewrite.batch.batch_norm import BatchNormWarning, MovingStatisticsWarning
from dapple_tf.rewrite.batch import sync_batch_norm
from dapple_tf.errors import DappleError
from dapple_tf.rewrite.graphs.graph_defs import StageGraphDef
from tests.pipeline_harness import assert_close_dicts, cpu, initial_weights, train_pipelined, train_single
from tests.test_pipeline_sync_batch_norm import assert_close, max_difference, pipelined, reference

layers = tf.keras.layers
KERAS_MAJOR = int(str(getattr(tf.keras, "__version__", "2")).split(".")[0])
IN, HIDDEN, CLASSES = 6, 8, 3


def _init(seed, scale=0.5):
    def initializer(shape, dtype=None, **_):
        return tf.constant(np.random.RandomState(seed).randn(*shape).astype(np.float32) * scale)
    return initializer


def _xent(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def per_sample_model_fn(features, labels):
    """Dense -> LayerNormalization -> tanh -> GroupNormalization, then the head."""
    with dapple_tf.layer("norm"):
        h = layers.Dense(HIDDEN, kernel_initializer=_init(0), name="d0")(features)
        h = tf.tanh(layers.LayerNormalization(epsilon=1e-3, beta_initializer=_init(1, 0.3), name="ln")(h))
        h = layers.GroupNormalization(groups=2, epsilon=1e-3, gamma_initializer=_init(2, 0.3), name="gn")(h)
    with dapple_tf.layer("head"):
        return _xent(labels, layers.Dense(CLASSES, kernel_initializer=_init(3), name="out")(h))


def _batch(n, seed=5):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, IN) * 2 + 0.3).astype(np.float32), rng.randint(0, CLASSES, n).astype(np.int32)


@pytest.mark.parametrize("batch_norm", ["per_slice", "sync"])
@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_layer_and_group_normalization_train_like_one_device(batch_norm, num_micro_batches):
    x, y = _batch(16)  # M=4: micro-batches of 4, slices of 2 on the replicated stage
    plan = dapple_tf.Plan.from_stages([("norm", "norm", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])],
                                      num_micro_batches=num_micro_batches)
    optimizer = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5)  # noqa: E731
    _, want, want_losses = train_single(per_sample_model_fn, x, y, optimizer, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, got, losses, handle, _ = train_pipelined(per_sample_model_fn, x, y, optimizer, plan, "dapple", 3,
                                                    batch_norm=batch_norm)
    assert not [w for w in caught if issubclass(w.category, BatchNormWarning)], [str(w.message) for w in caught]
    assert handle.update_ops == []
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=2e-6)
    assert_close_dicts(want, got, rtol=2e-5, atol=2e-6)
    assert want_losses[-1] < want_losses[0] - 1e-2  # it trains


def bn_model_fn(rank, collect=True):
    """Dense (2-D) or Conv2D (4-D) -> BatchNormalization (moving statistics in UPDATE_OPS through
    dapple_tf.collect_updates, unless `collect` is False) -> relu, then the head."""

    def model_fn(features, labels):
        with dapple_tf.layer("body"):
            if rank == 4:
                h = layers.Conv2D(4, 1, kernel_initializer=_init(0, 0.7), name="conv")(features)
            else:
                h = layers.Dense(4, kernel_initializer=_init(0, 0.7), name="dense")(features)
            bn = layers.BatchNormalization(momentum=0.9, epsilon=1e-3, beta_initializer=_init(1, 0.3), name="bn")
            if collect:
                with dapple_tf.collect_updates() as updates:
                    h = bn(h, training=True)
                assert len(updates) == 2
            else:
                h = bn(h, training=True)
            h = tf.nn.relu(h)
        with dapple_tf.layer("head"):
            flat = tf.reshape(h, [-1, 16 if rank == 4 else 4])
            return _xent(labels, layers.Dense(3, kernel_initializer=_init(2), name="out")(flat))

    return model_fn


def _bn_data(rank, n=8, seed=4):
    rng = np.random.RandomState(seed)
    shape = (n, 2, 2, 3) if rank == 4 else (n, IN)
    return (rng.randn(*shape) * 2 + 0.5).astype(np.float32), rng.randint(0, 3, n).astype(np.int32)


LAYOUTS = {
    "replicated": [("body", "body", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])],
    "straight": [("body", "body", [cpu(0)]), ("head", "head", [cpu(1), cpu(2)])],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("batch_norm", ["per_slice", "sync"])
@pytest.mark.parametrize("rank", [2, 4])
def test_keras_batch_normalization_trains_like_its_reference(rank, batch_norm, layout, recwarn):
    """M=2, 8 samples: the body normalizes micro-batches of 4 (sync, or straight), or slices of 2 (per_slice
    on the replicated body); one device fed those parts alone, gradients and moving statistics averaged."""
    x, y = _bn_data(rank)
    sliced = batch_norm == "per_slice" and layout == "replicated"
    model_fn = bn_model_fn(rank)
    want_weights, want_moving = reference(model_fn, x, y, 3, parts=4 if sliced else 2)
    assert len(want_moving) == 2
    with pytest.warns(BatchNormWarning, match="split further" if sliced else r"each micro-batch \(4 samples"):
        weights, moving = pipelined(model_fn, x, y, LAYOUTS[layout], 3, num_micro_batches=2, batch_norm=batch_norm)
    assert not [w for w in recwarn if issubclass(w.category, MovingStatisticsWarning)]
    assert_close(want_weights, weights, rtol=2e-5, atol=2e-6)
    assert_close(want_moving, moving, rtol=2e-5, atol=2e-6)
    other, _ = reference(model_fn, x, y, 3, parts=2 if sliced else 4)
    assert max_difference(other, weights) > 1e-3  # the tolerance tells the two semantics apart


@pytest.mark.parametrize("rank", [2, 4])
def test_keras_batch_normalization_with_sync_and_one_micro_batch_equals_one_device(rank, recwarn):
    x, y = _bn_data(rank, n=7)  # slices of 4 and 3
    model_fn = bn_model_fn(rank)
    want_weights, want_moving = reference(model_fn, x, y, 3, parts=1)
    weights, moving = pipelined(model_fn, x, y, LAYOUTS["replicated"], 3, batch_norm="sync")
    assert not [w for w in recwarn if issubclass(w.category, BatchNormWarning)]
    assert_close(want_weights, weights, rtol=2e-5, atol=2e-6)
    assert_close(want_moving, moving, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("batch_norm", ["per_slice", "sync"])
def test_moving_statistics_nothing_runs_are_warned_about(batch_norm):
    """BatchNormalization called in training mode without its updates in UPDATE_OPS (Keras 3 never puts them
    there; Keras 2 leaves it to the user): a MovingStatisticsWarning naming the assignments."""
    x, y = _bn_data(4)
    with pytest.warns(MovingStatisticsWarning, match=r"model_fn assigns variables from the batch in 2 op\(s\) that "
                                                     r"nothing runs \(body/bn.*\): they are not in UPDATE_OPS"):
        _, moving = pipelined(bn_model_fn(4, collect=False), x, y, LAYOUTS["replicated"], 1, batch_norm=batch_norm)
    assert all(np.all(np.isin(value, [0.0, 1.0])) for value in moving.values())  # never updated, as warned


def _v1_bn_model_fn(rank, fused):
    def model_fn(features, labels):
        with dapple_tf.layer("body"):
            h = tf.compat.v1.layers.dense(features, 4, kernel_initializer=_init(0, 0.7), name="dense") if rank == 2 \
                else tf.compat.v1.layers.conv2d(features, 4, 1, kernel_initializer=_init(0, 0.7), name="conv")
            h = tf.nn.relu(tf.compat.v1.layers.batch_normalization(h, momentum=0.9, training=True, fused=fused,
                                                                   beta_initializer=_init(1, 0.3)))
        with dapple_tf.layer("head"):
            w = tf.compat.v1.get_variable("w", initializer=_init(2)([16 if rank == 4 else 4, 3]))
            return _xent(labels, tf.matmul(tf.reshape(h, [-1, 16 if rank == 4 else 4]), w))
    return model_fn


@pytest.mark.primary_only  # tf.compat.v1.layers is gone with Keras 3
@pytest.mark.parametrize("rank,fused", [(2, False), (4, True), (4, False)])
def test_v1_layers_batch_normalization_with_sync(rank, fused):
    x, y = _bn_data(rank)
    model_fn = _v1_bn_model_fn(rank, fused)
    want_weights, want_moving = reference(model_fn, x, y, 2, parts=2)
    assert len(want_moving) == 2
    with pytest.warns(BatchNormWarning, match="all replicas of a stage together"):
        weights, moving = pipelined(model_fn, x, y, LAYOUTS["replicated"], 2, num_micro_batches=2, batch_norm="sync")
    assert_close(want_weights, weights, rtol=2e-5, atol=2e-6)
    assert_close(want_moving, moving, rtol=2e-5, atol=2e-6)


def _statistics_of(build, shape):
    """The batch statistics normalization.SampleAxes finds in the graph `build(x)` makes on a [None, ...] x."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, shape)
        first = len(graph.get_operations())
        build(x)
        ops = graph.get_operations()[first:]
        analysis = normalization.SampleAxes(graph, [x.op])
        return [op.type for op in analysis.batch_statistics(ops)]


def _fused(x, data_format="NHWC"):
    channels = x.shape[1 if data_format == "NCHW" else -1]
    ones = tf.ones([channels]) if channels is not None else tf.ones(tf.shape(x)[1:2])
    return tf.compat.v1.nn.fused_batch_norm(x, ones, tf.zeros_like(ones), data_format=data_format)[0]


def test_statistics_are_told_apart_by_the_axes_they_reduce_over():
    image = [None, 4, 4, 3]
    assert _statistics_of(_fused, image) == ["FusedBatchNormV3"]  # a batch norm
    assert _statistics_of(lambda x: tf.nn.moments(x, [0, 1, 2]), image) == ["Mean", "Mean"]
    assert _statistics_of(lambda x: tf.nn.moments(tf.reshape(x, [-1, 3]), [0]), image) == ["Mean", "Mean"]
    # instance norms: moments over the pixels, or the fused op with the samples moved into the channels
    assert _statistics_of(lambda x: tf.nn.moments(x, [1, 2], keepdims=True), image) == []
    assert _statistics_of(lambda x: _fused(tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, 4, 4, -1])), image) == []
    # a layer norm as Keras 2 computes it: [N, D] -> [1, N, D, 1], NCHW, from tf.shape(x)
    keras2_layer_norm = lambda x: _fused(  # noqa: E731
        tf.reshape(x, tf.stack([1, tf.reduce_prod(tf.shape(x)[:1]), tf.reduce_prod(tf.shape(x)[1:]), 1])), "NCHW")
    assert _statistics_of(keras2_layer_norm, [None, 6]) == []
    assert _statistics_of(lambda x: layers.LayerNormalization()(x), [None, 6]) == []
    assert _statistics_of(lambda x: layers.LayerNormalization(axis=[1, 2, 3])(x), image) == []
    assert _statistics_of(lambda x: layers.GroupNormalization(groups=3)(x), image) == []
    assert _statistics_of(lambda x: layers.BatchNormalization()(x, training=True), [None, 6]) == ["Mean", "Mean"]
    assert _statistics_of(lambda x: layers.BatchNormalization()(x, training=True), image) == (
        ["Mean", "Mean"] if KERAS_MAJOR >= 3 else ["FusedBatchNormV3"])


def test_statistics_after_an_rnn_are_not_taken_for_batch_statistics():
    """A Keras RNN runs time-major in a while loop the analysis does not follow and transposes back: the sample
    axis of its output is unknown, not guessed (guessing axis 0 inside the loop put it on the time axis)."""
    sequence = [None, 5, 3]
    lstm = lambda x: layers.LSTM(4, return_sequences=True)(x)  # noqa: E731
    assert _statistics_of(lambda x: tf.reduce_mean(lstm(x), axis=1, keepdims=True), sequence) == []
    assert _statistics_of(lambda x: layers.GlobalAveragePooling1D(keepdims=True)(lstm(x)), sequence) == []
    assert _statistics_of(
        lambda x: tf.reduce_sum(layers.GRU(4, return_sequences=True)(x), 1, keepdims=True), sequence) == []
    assert _statistics_of(lambda x: tf.reduce_mean(lstm(x), axis=1, keepdims=True), [8, 5, 3]) == []
    # a map_fn over the batch, then a time-major transpose: unknown, so the mean over axis 0 is no batch statistic
    assert _statistics_of(lambda x: tf.reduce_mean(tf.transpose(tf.map_fn(lambda r: r * 2.0, x), [1, 0, 2]), 0,
                                                   keepdims=True), sequence) == []
    # unknown axis: a training-mode fused norm is a batch norm (the rule before the analysis) ...
    assert _statistics_of(lambda x: _fused(tf.reshape(lstm(x), [-1, 5, 4, 1])), sequence) == ["FusedBatchNormV3"]
    # ... and a Mean keeping dims over axis 0 is an unproven one, which sync refuses in replicated stages
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, sequence)
        mean = tf.reduce_mean(lstm(x), axis=[0, 1], keepdims=True)
        analysis = normalization.SampleAxes(graph, [x.op])
        assert analysis.of(mean) is None
        assert analysis.batch_statistics([mean.op]) == [] and analysis.unproven_reductions([mean.op]) == [mean.op]
    # followed ops keep it proven: dropout's random mask, an embedding lookup, attention, convolutions
    assert _statistics_of(lambda x: tf.nn.moments(layers.Dropout(0.5)(layers.Dense(3)(x), training=True), [0, 1]),
                          sequence) == ["Mean", "Mean"]
    assert _statistics_of(lambda x: layers.LayerNormalization()(layers.MultiHeadAttention(2, 3)(x, x)), sequence) == []
    assert _statistics_of(lambda x: tf.nn.moments(layers.Embedding(10, 3)(tf.cast(x, tf.int32)), [0, 1]),
                          [None, 5]) == ["Mean", "Mean"]
    assert _statistics_of(lambda x: tf.nn.moments(layers.MaxPooling2D()(layers.Conv2D(3, 1)(x)), [1, 2, 3]),
                          [None, 4, 4, 3]) == []
    assert _statistics_of(lambda x: tf.nn.moments(x[:, 0], [0]), sequence) == ["Mean", "Mean"]
    deep = lambda x: tf.nn.moments(functools.reduce(lambda h, _: tf.tanh(h) * 1.5, range(300), x), [0])  # noqa: E731
    assert _statistics_of(deep, [None, 6]) == ["Mean", "Mean"]  # far from the inputs: still followed
    assert _statistics_of(lambda x: layers.LayerNormalization()(x[:, -1]), sequence) == []


def rnn_model_fn(pool):
    """LSTM(return_sequences=True) -> a per-sample mean over time keeping dims (h - mean, or
    GlobalAveragePooling1D(keepdims=True)), then the head."""

    def model_fn(features, labels):
        with dapple_tf.layer("body"):
            h = layers.LSTM(4, return_sequences=True, name="lstm")(tf.reshape(features, [-1, 3, 2]))
            if pool:
                h = h * layers.GlobalAveragePooling1D(keepdims=True)(h)
            else:
                h = h - tf.reduce_mean(h, axis=1, keepdims=True)
            h = tf.reshape(h, [-1, 12])
        with dapple_tf.layer("head"):
            return _xent(labels, layers.Dense(4, name="out")(h))

    return model_fn


@pytest.mark.parametrize("batch_norm", ["per_slice", "sync"])
@pytest.mark.parametrize("n,pool", [(8, False), (7, False), (8, True)])
def test_per_sample_means_after_an_rnn_train_like_one_device(batch_norm, n, pool):
    """A replicated stage, M=1 (slices of 4 and 4, or 4 and 3): nothing to synchronize, nothing to warn about."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(n, 6).astype(np.float32), rng.randint(0, 4, n).astype(np.int32)
    model_fn = rnn_model_fn(pool)
    optimizer = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5)  # noqa: E731
    initial = initial_weights(model_fn, x, y)
    _, want, want_losses = train_single(model_fn, x, y, optimizer, 2, initial=initial)
    plan = dapple_tf.Plan.from_stages(LAYOUTS["replicated"], num_micro_batches=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, got, losses, handle, _ = train_pipelined(model_fn, x, y, optimizer, plan, "dapple", 2, initial=initial,
                                                    batch_norm=batch_norm)
    assert not [w for w in caught if issubclass(w.category, BatchNormWarning)], [str(w.message) for w in caught]
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=2e-6)
    assert_close_dicts(want, got, rtol=2e-5, atol=2e-6)


def test_sync_refuses_a_mean_over_axis_0_whose_sample_axis_cannot_be_told():
    def model_fn(features, labels):
        with dapple_tf.layer("body"):
            h = layers.LSTM(4, return_sequences=True, name="lstm")(tf.reshape(features, [-1, 3, 2]))
            h = tf.reshape(h - tf.reduce_mean(h, axis=[0, 1], keepdims=True), [-1, 12])
        with dapple_tf.layer("head"):
            return _xent(labels, layers.Dense(4, name="out")(h))

    with pytest.raises(DappleError, match=r"stage 0, which is replicated, computes a Mean keeping dims over axis 0 in "
                                          r"body/Mean of a tensor whose sample axis cannot be told \(it comes from "
                                          r"body/lstm.+\), which the analysis does not follow\)"):
        _train_replicated_sync(model_fn)


def _train_replicated_sync(model_fn):
    """One sync-batch-norm step of model_fn (features [8, 6]) with its first stage replicated, M=1."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(8, 6).astype(np.float32), rng.randint(0, 4, 8).astype(np.int32)
    optimizer = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5)  # noqa: E731
    plan = dapple_tf.Plan.from_stages(LAYOUTS["replicated"], num_micro_batches=1)
    return train_pipelined(model_fn, x, y, optimizer, plan, "dapple", 1, batch_norm="sync")


def test_sync_refuses_a_fused_norm_whose_sample_axis_cannot_be_told():
    """A fused norm after an RNN may be per-sample (Keras 2's LayerNormalization is this op): sync refuses to
    synchronize it rather than guess; per_slice trains it as before."""
    def model_fn(features, labels):
        with dapple_tf.layer("body"):
            h = layers.LSTM(4, return_sequences=True, name="lstm")(tf.reshape(features, [-1, 3, 2]))
            h, _, _ = tf.compat.v1.nn.fused_batch_norm(tf.reshape(h, [-1, 3, 4, 1]), tf.ones([1]), tf.zeros([1]),
                                                       is_training=True, name="norm")
        with dapple_tf.layer("head"):
            return _xent(labels, layers.Dense(4, name="out")(tf.reshape(h, [-1, 12])))

    with pytest.raises(DappleError, match=r"stage 0, which is replicated, runs the fused norm body/norm on a tensor "
                                          r"whose sample axis cannot be told \(it comes from body/lstm.+use "
                                          r"batch_norm='per_slice'"):
        _train_replicated_sync(model_fn)


def test_sync_rewrite_refuses_statistics_it_cannot_find():
    @tf.function
    def inner(x):
        return tf.reduce_mean(x, 0, keepdims=True, name="inner_mean")

    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        tf.reduce_mean(x, 0, keepdims=True, name="mean")
        inner(x)
    stage = StageGraphDef(graph.as_graph_def(), set(), False)
    rewrite = lambda statistics: sync_batch_norm.rewrite(  # noqa: E731
        stage, 0, [cpu(0), cpu(1)], 1, "auto", statistics)
    assert rewrite({"mean": (2, (0,))}).num_keys == sync_batch_norm.KEYS_PER_NORM
    with pytest.raises(DappleError, match=r"stage 0 should synchronize the batch statistic gone/mean \(and 1 more\), "
                                          r"but it is not in the stage's graph"):
        rewrite({"mean": (2, (0,)), "gone/mean": (2, (0,)), "gone/variance": (2, (0,))})
    with pytest.raises(DappleError, match=r"the batch statistic inner_mean, but it is inside function .*inner.* \(a "
                                          r"tf.cond or loop body\), which cannot be synchronized"):
        rewrite({"inner_mean": (2, (0,))})
