"""Checkpoints of a pipelined run hold the single-device model's variables, and restore both ways."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.rewrite.graphs import graph_walk
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, cpu

STAGES = [(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2)])]


def adam():
    return tf.compat.v1.train.AdamOptimizer(0.05)


def variables_by_name():
    return {v.op.name: v for v in tf.compat.v1.global_variables()}


def single_graph(values, x, y):
    loss = toy_models.skip_model_fn(values)(tf.constant(x), tf.constant(y))
    train_op = adam().minimize(loss)
    return loss, train_op


def pipelined_graph(values, x, y):
    plan = dapple_tf.Plan.from_stages(STAGES, num_micro_batches=2)
    return dapple_tf.build_pipeline(toy_models.skip_model_fn(values), tf.constant(x), tf.constant(y), adam(), plan)


def test_checkpoint_restores_both_ways(tmp_path):
    values = toy_models.initial_values()
    x, y = toy_models.batch(8)
    # Pipelined: 2 steps, save.
    with tf.Graph().as_default():
        handle = pipelined_graph(values, x, y)
        saver = tf.compat.v1.train.Saver()
        saved_names = sorted(v.op.name for v in tf.compat.v1.global_variables())
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            for _ in range(2):
                sess.run(handle.train_op)
            pipelined_weights = {v.op.name: sess.run(v) for _, v in handle.grads_and_vars}
            pipe_ckpt = saver.save(sess, str(tmp_path / "pipe" / "model"))
    assert not any("dapple" in name for name in saved_names), saved_names
    # Single device: restore the pipelined checkpoint, same weights; train 1 step and save.
    with tf.Graph().as_default():
        loss, train_op = single_graph(values, x, y)
        single_names = sorted(v.op.name for v in tf.compat.v1.global_variables())
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            saver.restore(sess, pipe_ckpt)
            for name, value in pipelined_weights.items():
                np.testing.assert_array_equal(sess.run(variables_by_name()[name]), value)
            sess.run(train_op)
            single_after = {n: sess.run(variables_by_name()[n]) for n in pipelined_weights}
            single_ckpt = saver.save(sess, str(tmp_path / "single" / "model"))
    assert single_names == saved_names
    # Pipelined again: restore the single-device checkpoint; copies follow via local_init_op.
    with tf.Graph().as_default():
        handle = pipelined_graph(values, x, y)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            saver.restore(sess, single_ckpt)
            sess.run(handle.local_init_op)
            copies = {v.op.name: sess.run(v) for v in tf.compat.v1.local_variables() if v.op.name.endswith("dapple_copy")}
            assert copies, "a 2:1 plan has variable copies"
            for name, value in copies.items():
                np.testing.assert_array_equal(value, single_after[name.split("/dapple_copy")[0]])
            sess.run(handle.train_op)
            restored_then_trained = {v.op.name: sess.run(v) for _, v in handle.grads_and_vars}
    # ... and one more step matches one more single-device step.
    with tf.Graph().as_default():
        loss, train_op = single_graph(values, x, y)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            saver.restore(sess, single_ckpt)
            sess.run(train_op)
            for name, value in restored_then_trained.items():
                np.testing.assert_allclose(value, sess.run(variables_by_name()[name]), rtol=1e-5, atol=1e-6)


def test_restore_without_local_init_op_fails_on_the_first_step_with_the_fix(tmp_path):
    values = toy_models.initial_values()
    x, y = toy_models.batch(8)
    with tf.Graph().as_default():
        handle = pipelined_graph(values, x, y)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            sess.run(handle.train_op)
            ckpt = saver.save(sess, str(tmp_path / "model"))
    with tf.Graph().as_default():
        handle = pipelined_graph(values, x, y)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            saver.restore(sess, ckpt)  # the copies still hold the initial values
            for _ in range(2):  # failed, not marked checked
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match=r"copy of variable \w+ differs .*local_init_op"):
                    sess.run(handle.train_op)
            sess.run(handle.local_init_op)  # the fix
            for _ in range(2):  # checked once, then skipped
                sess.run(handle.train_op)
            copies = {v.op.name: sess.run(v) for v in tf.compat.v1.local_variables() if v.op.name.endswith("dapple_copy")}
            for name, value in copies.items():
                user = variables_by_name()[name.split("/dapple_copy")[0]]
                np.testing.assert_array_equal(value, sess.run(user))


@pytest.mark.parametrize("batch_norm", [None, "sync"])
def test_no_collective_starts_before_the_whole_check(batch_norm):
    """A collective op that has started in a step that fails aborts the process's collectives for good, so the
    fix (local_init_op) would not bring the session back: every device's collectives wait for every comparing,
    the devices without copies (stage 0's variables on cpu:0) too, and so do the synchronized batch norms'
    collectives in the forward and backward passes, built before the check."""
    values = toy_models.initial_values()
    x, y = toy_models.batch(8)
    with tf.Graph().as_default() as graph:
        if batch_norm:
            dapple_tf.build_pipeline(toy_models.batch_norm_model_fn(values), tf.constant(x), tf.constant(y), adam(),
                                     dapple_tf.Plan.from_stages(STAGES, num_micro_batches=2),
                                     dapple_tf.PipelineOptions(batch_norm=batch_norm))
        else:
            pipelined_graph(values, x, y)
        checks = {op for op in graph.get_operations() if op.type in ("If", "StatelessIf")
                  and op.name.startswith("dapple_stale_copy_check")}
        collectives = [op for op in graph.get_operations() if op.type.startswith("Collective")]
    assert len(checks) == 1 and sorted({op.device for op in collectives}) == [cpu(0), cpu(1)]
    assert sum(op.type == "CollectiveReduceV2" for op in collectives) == (16 if batch_norm else 0)
    for op in collectives:
        assert checks <= graph_walk.ancestors(op), op.name


def test_the_check_takes_one_tensor_per_pair_of_devices_across():
    """A conditional's inputs cross devices in every step, taken or not: each side of the check takes its own
    device's handles and flag, and one tensor of the other side's (the flag, the variables' values)."""
    values = toy_models.initial_values()
    x, y = toy_models.batch(8)
    with tf.Graph().as_default() as graph:
        pipelined_graph(values, x, y)
        conditionals = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
        across = {op.name: sorted(t.op.type for t in op.inputs if t.op.device != op.device) for op in conditionals}
    # stage 0's variables on cpu:0, their copies on cpu:1
    assert sorted((op.name, op.device) for op in conditionals) == [
        ("dapple_stale_copy_check", cpu(1)), ("dapple_stale_copy_values", cpu(0))]
    assert across == {"dapple_stale_copy_check": ["Identity"], "dapple_stale_copy_values": ["Identity"]}
