"""Tensors whose batch is not on axis 0 (time-major sequence models) cross stage boundaries: split and joined along
their batch axis (dapple_tf/rewrite/batch/batch_axis.py), trained like one device; masks built from the inputs alone are
computed again by each stage; the refusals name the tensor and the axes."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.errors import DappleError
from dapple_tf.rewrite.batch import batch_axis, normalization
from tests import time_major_models as tm
from tests.pipeline_harness import SESSION_CONFIG, assert_close_dicts, cpu, train_pipelined, train_single

STEPS = 3
N = 16
STRAIGHT = [(0, 1, [cpu(0)]), (2, 4, [cpu(1)])]
TWO_ONE = [(0, 2, [cpu(0), cpu(1)]), (3, 4, [cpu(2)])]
ONE_THREE = [(0, 1, [cpu(0)]), (2, 4, [cpu(1), cpu(2), cpu(3)])]  # slices of 2, 1, 1 at M=4
PLANS = [  # (name, stages, M, schedule, stage functions)
    ("straight M=1", STRAIGHT, 1, "dapple", False),
    ("straight M=4", STRAIGHT, 4, "dapple", False),
    ("2:1 M=4", TWO_ONE, 4, "dapple", False),
    ("2:1 M=4 functions", TWO_ONE, 4, "dapple", True),
    ("2:1 M=2 zb-h1", TWO_ONE, 2, "zb-h1", False),
    ("1:3 uneven M=4 functions", ONE_THREE, 4, "dapple", True),
]


def adam():
    return tf.compat.v1.train.AdamOptimizer(0.05)


@pytest.fixture(scope="module")
def single():
    x, y = tm.batch(N)
    return train_single(tm.attention_model_fn, x, y, adam, STEPS)


def _pipelined(stages, m, schedule="dapple", stage_functions=False, **build):
    x, y = tm.batch(N)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=m)
    return train_pipelined(tm.attention_model_fn, x, y, adam, plan, schedule, STEPS, stage_functions=stage_functions,
                           **build)


@pytest.mark.parametrize("name,stages,m,schedule,functions", PLANS, ids=[p[0] for p in PLANS])
def test_time_major_model_matches_single_device(single, name, stages, m, schedule, functions):
    want_grads, want_weights, want_losses = single
    grads, weights, losses, handle, _ = _pipelined(stages, m, schedule, functions)
    if functions:
        assert handle.function_fallbacks == {}
    if m == 1 and len(stages[0][2]) == 1:  # nothing summed in another order: the same bits
        for name_ in want_weights:
            np.testing.assert_array_equal(weights[name_], want_weights[name_], err_msg=name_)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def test_each_boundary_is_split_along_its_batch_axis(monkeypatch):
    """[len, batch, dim] activations along axis 1, the learned [q, k, batch, 1] mask along axis 2; the mask made from
    the inputs alone is not sent at all (each stage computes it)."""
    found, find = [], batch_axis.find

    def recording(t, sample_axes, producer, consumer):
        axis = find(t, sample_axes, producer, consumer)
        if producer >= 0:  # a boundary's, not a check whether a later stage recomputes a tensor
            found.append((t.shape.rank, axis))
        return axis

    monkeypatch.setattr(batch_axis, "find", recording)
    with tf.Graph().as_default():
        x, y = tm.batch(N)
        plan = dapple_tf.Plan.from_stages(TWO_ONE, num_micro_batches=2)
        dapple_tf.build_pipeline(tm.attention_model_fn, tf.nest.map_structure(tf.constant, x), tf.constant(y), adam(),
                                 plan)
    assert sorted(found) == [(3, 1), (4, 2)]


def test_batch_axis_zero_would_train_something_else(single, monkeypatch):
    """The mutation check: the same 2:1 plan with every boundary split along axis 0 does not train like one device."""
    monkeypatch.setattr(batch_axis, "find", lambda *args: 0)
    _, want_weights, _ = single
    try:
        _, weights, _, _, _ = _pipelined(TWO_ONE, 4)
    except (DappleError, tf.errors.OpError):
        return  # refused, or failed when the step ran: not silently different
    assert max(float(np.abs(weights[k] - want_weights[k]).max()) for k in want_weights) > 1e-3


# -- the axis of one tensor -------------------------------------------------------------------------------------

def _find(build):
    """batch_axis.find for the tensor `build(features)` makes from a [batch, 6] float placeholder."""
    with tf.Graph().as_default() as graph:
        features = tf.compat.v1.placeholder(tf.float32, [None, 6])
        t = build(features)
        return batch_axis.find(t, normalization.SampleAxes(graph, [features.op]), 0, 1)


def test_axes_followed_through_layout_ops():
    assert _find(lambda x: tf.transpose(x)) == 1
    assert _find(lambda x: tf.transpose(x)[None, :, :, None] * tf.ones([6, 1, 1, 1])) == 2  # a [q, k, batch, 1] mask
    assert _find(lambda x: tf.einsum("bi,bj->ijb", x, x)) == 2
    assert _find(lambda x: tf.reshape(x, [-1, 2, 3])) == 0
    assert _find(lambda x: tf.tile(tf.ones([6, 1, 4]), [1, tf.shape(x)[0], 1])) == 1  # a position encoding per sample


def test_an_unfollowed_tensor_takes_its_one_axis_of_unknown_size():
    def looped(x):
        steps = tf.transpose(x)[:, :, None]  # [6, batch, 1]
        _, out = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, h * 2.0), [0, steps])
        return out

    assert _find(looped) == 1


def test_a_statistic_over_the_batch_is_refused():
    with pytest.raises(DappleError, match=r"depends on the batch, but its first dimension is not the batch, nor is any "
                                          r"other \(a statistic over the batch"):
        _find(lambda x: tf.transpose(tf.reduce_mean(x, axis=0, keepdims=True)))


def test_two_axes_following_the_batch_are_refused_naming_both():
    with pytest.raises(DappleError, match=r"MatMul:0 \(shape \(None, None\)\) crosses from stage 0 to stage 1, and by what "
                                          r"the operations compute, axes 0 and 1 both follow the batch.*Move the stage "
                                          r"boundary"):
        _find(lambda x: tf.matmul(x, x, transpose_b=True))  # an in-batch similarity [batch, batch]


def test_time_major_extra_outputs_are_joined_along_their_batch_axis():
    x, y = tm.batch(N)
    with tf.Graph().as_default():
        _, want = tm.attention_model_with_outputs_fn(tf.nest.map_structure(tf.constant, x), tf.constant(y))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            want = sess.run(want)
    with tf.Graph().as_default():
        plan = dapple_tf.Plan.from_stages(ONE_THREE, num_micro_batches=2)
        handle = dapple_tf.build_pipeline(tm.attention_model_with_outputs_fn, tf.nest.map_structure(tf.constant, x),
                                          tf.constant(y), adam(), plan)
        with tf.compat.v1.Session(config=handle.session_config(SESSION_CONFIG)) as sess:
            sess.run(handle.initializer)
            got = sess.run(handle.outputs)
    assert got["states"].shape == (tm.LENGTH, N, tm.DIM)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
