"""Gradient exchange across processes (collectives.exchange_sum) and the B/W order inside backward tasks (input
gradients first, or TensorFlow's own order)."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.rewrite.update import collectives
from planner.formats.schedule import BACKWARD, Task
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, assert_close_dicts, cpu, train_pipelined, train_single

SHAPES = [(3, 5), (700, 600), (7,), (2000, 300), (1,), (4, 4, 4), ()]  # small, large, small, large, ..., a scalar


@pytest.mark.parametrize("num_devices", [2, 3])
def test_exchange_sum_equals_the_sum_on_every_device(num_devices):
    rng = np.random.default_rng(0)
    values = {cpu(d): [rng.standard_normal(s).astype(np.float32) for s in SHAPES] for d in range(num_devices)}
    with tf.Graph().as_default():
        per_device = {}
        for device, arrays in values.items():
            with tf.device(device):
                per_device[device] = [tf.constant(a) for a in arrays]
        sums = collectives.exchange_sum(per_device, pack_bytes=2**20)
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            got = sess.run(sums)
    for i, shape in enumerate(SHAPES):
        expected = sum(values[d][i] for d in values)
        for device in values:
            assert got[device][i].shape == shape
            np.testing.assert_allclose(got[device][i], expected, rtol=1e-6, atol=1e-6)


def test_small_tensors_travel_packed_large_ones_alone():
    with tf.Graph().as_default():
        tensors = [tf.zeros(s) for s in SHAPES]
    # 4-byte floats: 60 B, 1.68 MB, 28 B, 2.4 MB, 4 B, 256 B, 4 B
    assert collectives._groups(tensors, 2**20) == [[1], [3], [0, 2, 4, 5, 6]]
    assert collectives._groups(tensors, 64) == [[1], [0, 2], [3], [5], [4, 6]]


def test_only_cpu_devices_of_several_tasks_use_the_exchange():
    task = "/job:worker/replica:0/task:{}/device:{}:0"
    assert collectives.uses_exchange([task.format(0, "CPU"), task.format(1, "CPU")])
    assert not collectives.uses_exchange([cpu(0), cpu(1)])  # one process: TF's ring collective
    assert not collectives.uses_exchange([task.format(0, "GPU"), task.format(1, "GPU")])  # NCCL


@pytest.mark.parametrize("stage_functions", [False, True], ids=["clones", "functions"])
def test_weight_gradients_wait_for_the_input_gradients_of_a_later_stage(stage_functions):
    """Stage 1's backward computes the input gradients stage 0 waits for before its weight gradients: every
    weight-gradient matmul of stage 1 (with stage functions: its W call) depends (through control edges) on its
    input-gradient marker, while stage 0 (nobody waits for its input gradients) has no marker; the operations
    recorded as the input gradients' (handle.input_gradient_op_names) do not wait for it."""
    x, y = toy_models.batch(8)
    plan = dapple_tf.Plan.from_stages([(0, 2, [cpu(0)]), (3, 4, [cpu(1)])], num_micro_batches=2)
    with tf.Graph().as_default() as graph:
        handle = dapple_tf.build_pipeline(toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x),
                                          tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                          dapple_tf.PipelineOptions(stage_functions=stage_functions))
        assert handle.function_fallbacks == {}
        for stage, has_marker in ((0, False), (1, True)):
            for m in range(2):
                key = next(k for k in handle.task_op_names if k[1] == Task(stage, BACKWARD, m) and k[2] == 0)
                names = handle.task_op_names[key]
                markers = [n for n in names if n.startswith("input_grads_")]
                assert bool(markers) == has_marker, (stage, m, markers)
                assert bool(handle.input_gradient_op_names.get(key)) == has_marker
                if not has_marker:
                    continue
                marker = graph.get_operation_by_name(markers[0])
                ops = [graph.get_operation_by_name(n) for n in names]
                if stage_functions:
                    weight_ops = [op for op in ops if op.type == "RemoteCall"
                                  and op.name not in handle.input_gradient_op_names[key]]
                else:
                    weight_ops = [op for op in ops if op.name.endswith("MatMul_1")]
                assert weight_ops and (len(weight_ops) == 1 or not stage_functions), [op.name for op in weight_ops]
                for op in weight_ops:
                    assert _depends_on(op, marker), op.name
                for name in handle.input_gradient_op_names[key]:
                    assert not _depends_on(graph.get_operation_by_name(name), marker), name


def test_a_backward_in_tensorflows_own_order_trains_like_one_device():
    """PipelineOptions(input_gradients_first=False), the baseline of the zero-bubble schedules: no backward task
    gets the input-gradient marker, and training is unchanged (gradients, weights after 3 steps)."""
    x, y = toy_models.batch(16)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    optimizer = lambda: tf.compat.v1.train.AdamOptimizer(0.05)  # noqa: E731
    want_grads, want_weights, _ = train_single(model_fn, x, y, optimizer, 3)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 2, [cpu(1)]), (3, 4, [cpu(2)])], num_micro_batches=4)
    grads, weights, _, handle, _ = train_pipelined(model_fn, x, y, optimizer, plan, "dapple", 3,
                                                   stage_functions=False, input_gradients_first=False)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    assert not handle.input_gradient_op_names
    assert not [n for names in handle.task_op_names.values() for n in names if n.startswith("input_grads_")]


@pytest.mark.parametrize("schedule", ["zb-h1", "dapple-batched-w"])
def test_a_schedule_that_splits_backwards_refuses_the_fused_order(schedule):
    plan = dapple_tf.Plan.from_stages([(0, 2, [cpu(0)]), (3, 4, [cpu(1)])], num_micro_batches=2)
    x, y = toy_models.batch(8)
    with tf.Graph().as_default():
        with pytest.raises(dapple_tf.PlanError, match=f"schedule '{schedule}' splits every backward into input and "
                                                      "weight gradients: input_gradients_first=False applies to"):
            dapple_tf.build_pipeline(toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x),
                                     tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                     dapple_tf.PipelineOptions(schedule=schedule, input_gradients_first=False))


def test_stage_functions_warn_that_their_backward_stays_split():
    plan = dapple_tf.Plan.from_stages([(0, 2, [cpu(0)]), (3, 4, [cpu(1)])], num_micro_batches=2)
    x, y = toy_models.batch(8)
    with tf.Graph().as_default():
        with pytest.warns(UserWarning, match="input_gradients_first=False with stage functions: each backward is "
                                             "still a B call"):
            dapple_tf.build_pipeline(toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x),
                                     tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                     dapple_tf.PipelineOptions(stage_functions=True, input_gradients_first=False))


def _depends_on(op, target, seen=None):
    seen = set() if seen is None else seen
    if op is target:
        return True
    if op in seen:
        return False
    seen.add(op)
    return any(_depends_on(t.op, target, seen) for t in op.inputs) or any(
        _depends_on(c, target, seen) for c in op.control_inputs)


def test_a_lone_scalar_is_exchanged():
    with tf.Graph().as_default():
        per_device = {}
        for d in range(3):
            with tf.device(cpu(d)):
                per_device[cpu(d)] = [tf.constant(float(d + 1))]
        sums = collectives.exchange_sum(per_device)
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            assert sess.run(sums) == {cpu(d): [6.0] for d in range(3)}
