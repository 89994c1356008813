"""Pipelined training equals single-device full-batch training (gradients, and weights after 3 steps), with
stages imported per micro-batch (clones) and built once as functions (stage_function.py)."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from tests import toy_models
from tests.pipeline_harness import assert_close_dicts, cpu, train_pipelined, train_single

STEPS = 3

# (name, stages as (first, last, devices), M, global batch)
PLANS = [
    ("1 stage, M=4 (accumulation)", [("dense0", "head", [cpu(0)])], 4, 16),
    ("2 straight stages", [(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], 4, 16),
    ("4 straight stages", [(0, 0, [cpu(0)]), (1, 1, [cpu(1)]), (2, 2, [cpu(2)]), (3, 4, [cpu(3)])], 4, 16),
    ("2:1", [(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2)])], 2, 16),
    ("1:2", [(0, 2, [cpu(0)]), (3, 4, [cpu(1), cpu(2)])], 2, 16),
    ("2:2", [(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2), cpu(3)])], 4, 16),
    ("3:1, micro-batch 4", [(0, 2, [cpu(0), cpu(1), cpu(2)]), (3, 4, [cpu(3)])], 4, 16),
    ("3 stages 2:1:3, uneven", [(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)]), (3, 4, [cpu(3), cpu(4), cpu(5)])], 2, 14),
    ("data parallel on 4", [(0, 4, [cpu(0), cpu(1), cpu(2), cpu(3)])], 2, 16),
]


def adam():
    return tf.compat.v1.train.AdamOptimizer(0.05)


@pytest.fixture(scope="module")
def values():
    return toy_models.initial_values()


@pytest.fixture(params=[False, True], ids=["clones", "functions"])
def stage_functions(request):
    return request.param


def check_rewrite(handle, stage_functions, fallbacks=()):
    """With stage functions, every stage but `fallbacks` ran as functions."""
    if stage_functions:
        assert sorted(handle.function_fallbacks) == sorted(fallbacks), handle.function_fallbacks


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
@pytest.mark.parametrize("name,stages,m,n", PLANS, ids=[p[0] for p in PLANS])
def test_matches_single_device(values, name, stages, m, n, schedule, stage_functions):
    _check_matches_single_device(values, stages, m, n, schedule, stage_functions)


ZERO_BUBBLE_PLANS = [p for p in PLANS if p[0] in ("1 stage, M=4 (accumulation)", "4 straight stages", "2:1", "1:2",
                                                   "3 stages 2:1:3, uneven")] + [
    # the last stage cuts its input gradients into the middle replicas' pieces, in B (found by scripts.bench.fuzz.fuzz:
    # cut in W, they waited for the deferred W, after the next B, whose forward waited for the replicas: a cycle)
    ("3 stages 1:2:1, M=4", [(0, 0, [cpu(0)]), (1, 2, [cpu(1), cpu(2)]), (3, 4, [cpu(3)])], 4, 16),
]


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "dapple-batched-w"])
@pytest.mark.parametrize("name,stages,m,n", ZERO_BUBBLE_PLANS, ids=[p[0] for p in ZERO_BUBBLE_PLANS])
def test_zero_bubble_matches_single_device(values, name, stages, m, n, schedule, stage_functions):
    """B and W as tasks of their own, W where the schedule puts it (straight, replicated 2:1 / 1:2 / uneven,
    skips across stages; dapple-batched-w stacks the micro-batches' weight gradients): the same training as one
    device."""
    handle = _check_matches_single_device(values, stages, m, n, schedule, stage_functions)
    assert handle.schedule.splits_backward


INTERLEAVED_PLANS = [
    ("2 groups x 2 chunks", [(0, 0, [cpu(0)]), (1, 1, [cpu(1)]), (2, 2, [cpu(0)]), (3, 4, [cpu(1)])], 4, 16),
    ("2:1 groups x 2 chunks", [(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)]), (2, 2, [cpu(0), cpu(1)]),
                               (3, 4, [cpu(2)])], 2, 16),
]


@pytest.mark.parametrize("name,stages,m,n", INTERLEAVED_PLANS, ids=[p[0] for p in INTERLEAVED_PLANS])
def test_interleaved_matches_single_device(values, name, stages, m, n, stage_functions):
    """Stages that share devices round-robin (virtual stages), each group running its stages' merged order
    (straight, replicated with split/concat, skips across stages): the same training as one device."""
    handle = _check_matches_single_device(values, stages, m, n, "interleaved", stage_functions)
    assert handle.schedule.num_lanes == len({tuple(devices) for _, _, devices in stages})


def _check_matches_single_device(values, stages, m, n, schedule, stage_functions):
    x, y = toy_models.batch(n)
    model_fn = toy_models.skip_model_fn(values)
    want_grads, want_weights, want_losses = train_single(model_fn, x, y, adam, STEPS)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=m)
    grads, weights, losses, handle, copies = train_pipelined(model_fn, x, y, adam, plan, schedule, STEPS,
                                                             stage_functions=stage_functions)
    check_rewrite(handle, stage_functions)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    # Every variable copy on another replica (and its Adam slots) equals the user's variable.
    for copy_name, value in copies.items():
        base = copy_name.split("/dapple_copy")[0]
        if copy_name.endswith("dapple_copy"):
            np.testing.assert_allclose(value, weights[base], rtol=1e-6, atol=1e-7, err_msg=copy_name)
    if any(len(devices) > 1 for _, _, devices in stages):
        assert any(k.endswith("dapple_copy") for k in copies), sorted(copies)
    assert handle.schedule.kind == schedule
    assert handle.micro_batch_size == n // m
    return handle


def test_uneven_slices_are_weighted_by_size(values, stage_functions):
    """3 replicas of a 4-sample micro-batch get 2, 1, 1 samples; the mean is still exact."""
    x, y = toy_models.batch(8)
    model_fn = toy_models.skip_model_fn(values)
    want_grads, _, want_losses = train_single(model_fn, x, y, adam, 1)
    plan = dapple_tf.Plan.from_stages([(0, 4, [cpu(0), cpu(1), cpu(2)])], num_micro_batches=2)
    grads, _, losses, handle, _ = train_pipelined(model_fn, x, y, adam, plan, "dapple", 1,
                                                  stage_functions=stage_functions)
    check_rewrite(handle, stage_functions)
    assert_close_dicts(want_grads, grads)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


@pytest.mark.parametrize(
    "stages",
    [
        [(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)])],
        [(0, 0, [cpu(0)]), (1, 2, [cpu(1), cpu(2), cpu(3)])],
    ],
    ids=["2:1", "1:3"],
)
def test_tied_and_unplaced_variables(values, stages, stage_functions):
    """A variable read by two stages is reduced across all its holders; an unplaced one is updated too."""
    x, y = toy_models.batch(12)
    model_fn = toy_models.tied_model_fn(values)
    want_grads, want_weights, _ = train_single(model_fn, x, y, adam, STEPS)
    assert set(want_grads) == {"scale", "w0", "w1"}
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    grads, weights, _, handle, copies = train_pipelined(model_fn, x, y, adam, plan, "dapple", STEPS,
                                                        stage_functions=stage_functions)
    check_rewrite(handle, stage_functions)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    assert {"w0/dapple_copy", "scale/dapple_copy"} <= {k.rstrip("_0123456789") for k in copies}


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
def test_control_flow_in_stages(schedule):
    """tf.while_loop and tf.cond inside layers: every clone gets private copies of their functions (stage functions
    leave such stages to clones and say why)."""
    x, y = toy_models.sequence_batch(12)
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    want_grads, want_weights, _ = train_single(toy_models.control_flow_model_fn, x, y, sgd, 2)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)])], num_micro_batches=2)
    grads, weights, _, handle, _ = train_pipelined(toy_models.control_flow_model_fn, x, y, sgd, plan, schedule, 2,
                                                   stage_functions=True)
    assert "control flow" in " ".join(handle.function_fallbacks.values()), handle.function_fallbacks
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)


@pytest.mark.parametrize(
    "stages",
    [[(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)])], [(0, 1, [cpu(0)]), (2, 2, [cpu(1), cpu(2), cpu(3)])]],
    ids=["2:1", "1:3"],
)
def test_dict_features_embeddings_and_integer_boundaries(stages, stage_functions):
    x, y = toy_models.embedding_batch(12)
    want_grads, want_weights, _ = train_single(toy_models.embedding_model_fn, x, y, adam, STEPS)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    grads, weights, _, handle, _ = train_pipelined(toy_models.embedding_model_fn, x, y, adam, plan, "dapple", STEPS,
                                                   stage_functions=stage_functions)
    check_rewrite(handle, stage_functions)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
