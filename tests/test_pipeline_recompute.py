"""Re-computation: the same gradients and weights as single-device training (and as the pipeline
without it, dropout on), recomputation inside the backward task's slot, and errors."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf import DappleError, PlanError
from planner.formats.schedule import BACKWARD, FORWARD, WEIGHT
from planner.formats import plan_pb2
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, assert_close_dicts, cpu, train_pipelined, train_single
from tests.test_pipeline_equivalence import PLANS, STEPS, adam
from tests.test_pipeline_order import executed_tasks, unordered_operations

UNEVEN = [(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)]), (3, 4, [cpu(3), cpu(4), cpu(5)])]  # 2:1:3, slices 4/3/2


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
@pytest.mark.parametrize("name,stages,m,n", PLANS, ids=[p[0] for p in PLANS])
def test_recompute_matches_single_device(name, stages, m, n, schedule):
    handle = _recomputed_matches_single_device(stages, m, n, schedule)
    kinds = {task.kind for (_, task, _), names in handle.task_op_names.items() for n in names if "/recompute/" in n}
    assert kinds == {BACKWARD}


def _recomputed_matches_single_device(stages, m, n, schedule):
    x, y = toy_models.batch(n)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    want_grads, want_weights, want_losses = train_single(model_fn, x, y, adam, STEPS)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=m)
    grads, weights, losses, handle, _ = train_pipelined(model_fn, x, y, adam, plan, schedule, STEPS, recompute=True)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    return handle


ZERO_BUBBLE_PLANS = [p for p in PLANS if p[0] in ("4 straight stages", "2:1", "3 stages 2:1:3, uneven")]


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("name,stages,m,n", ZERO_BUBBLE_PLANS, ids=[p[0] for p in ZERO_BUBBLE_PLANS])
def test_recompute_with_zero_bubble_matches_single_device(name, stages, m, n, schedule):
    """Re-computation with B and W tasks: each recomputed op runs once, in B when the input gradients need it,
    else in W; never in a forward task."""
    handle = _recomputed_matches_single_device(stages, m, n, schedule)
    kinds = {(task.stage > 0, task.kind) for (_, task, _), names in handle.task_op_names.items() for n in names
             if "/recompute/" in n}
    # later stages recompute what their input gradients need in B, the rest in W; the first stage's backward is W
    assert kinds == {(True, BACKWARD), (True, WEIGHT), (False, WEIGHT)}


def test_recompute_with_interleaved_matches_single_device():
    """Re-computation of stages that share devices (2:1 groups, two stages each): in each backward task."""
    stages = [(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)]), (2, 2, [cpu(0), cpu(1)]), (3, 4, [cpu(2)])]
    handle = _recomputed_matches_single_device(stages, 2, 16, "interleaved")
    kinds = {(task.stage, task.kind) for (_, task, _), names in handle.task_op_names.items() for n in names
             if "/recompute/" in n}
    assert kinds == {(s, BACKWARD) for s in range(4)}


SGD = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
OTHER_MODELS = [  # (model_fn, batch, stages): the other models of the equivalence suite
    (toy_models.tied_model_fn(toy_models.initial_values()), toy_models.batch(12),
     [(0, 0, [cpu(0)]), (1, 2, [cpu(1), cpu(2), cpu(3)])]),
    (toy_models.control_flow_model_fn, toy_models.sequence_batch(12), [(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)])]),
    (toy_models.embedding_model_fn, toy_models.embedding_batch(12), [(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)])]),
]


@pytest.mark.parametrize("model_fn,batch,stages", OTHER_MODELS, ids=["tied", "while and cond", "embeddings"])
def test_recompute_other_models(model_fn, batch, stages):
    x, y = batch
    want_grads, want_weights, _ = train_single(model_fn, x, y, SGD, 2)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    grads, weights, _, _, _ = train_pipelined(model_fn, x, y, SGD, plan, "gpipe", 2, recompute=True)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)


def dropout_model_fn(seed):
    """toy_models' skip model with dropout in three layers (seeded: the pipeline's masks are fixed)."""
    values = toy_models.initial_values()

    def var(name):
        return tf.compat.v1.get_variable(name, initializer=tf.constant(values[name]), use_resource=True)

    def drop(x, offset):
        return tf.nn.dropout(x, rate=0.4, seed=None if seed is None else seed + offset)

    def model_fn(features, labels):
        with dapple_tf.layer("dense0"):
            h0 = drop(tf.tanh(tf.matmul(features, var("w0")) + var("b0")), 0)
        with dapple_tf.layer("dense1"):
            h1 = tf.tanh(tf.matmul(h0, var("w1")) + var("b1"))
        with dapple_tf.layer("dense2"):
            h2 = drop(tf.tanh(tf.matmul(h1, var("w2"))), 1)
        with dapple_tf.layer("dense3"):
            h3 = drop(tf.tanh(tf.matmul(h2, var("w3")) + tf.matmul(h0, var("skip")) + var("b3")), 2)
        with dapple_tf.layer("head"):
            logits = tf.matmul(h3, var("wo"))
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    return model_fn


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
def test_dropout_masks_are_recomputed(schedule):
    """Seeded dropout, uneven replication 2:1:3: recomputing every stage, or stages 0 and 2 only,
    gives the gradients and weights of the pipeline that keeps its activations."""
    x, y = toy_models.batch(14)
    plan = dapple_tf.Plan.from_stages(UNEVEN, num_micro_batches=2)
    model_fn = dropout_model_fn(seed=11)
    want_grads, want_weights, want_losses, _, _ = train_pipelined(model_fn, x, y, adam, plan, schedule, 2)
    for recompute, steps in ((True, 2), ([0, 2], 1)):
        grads, weights, losses, _, _ = train_pipelined(model_fn, x, y, adam, plan, schedule, steps, recompute=recompute)
        assert_close_dicts(want_grads, grads)
        np.testing.assert_allclose(losses, want_losses[:steps], rtol=1e-5)
        if steps == 2:
            assert_close_dicts(want_weights, weights)


def test_unseeded_dropout_is_recomputed_with_the_forward_mask():
    """loss = w * sum(masks * x) / keep^2: d loss / d w = loss / w only if the recomputed masks are the
    forward's, also after steps that fetch train_op alone (the last stage's forward then computes only
    its random draws)."""

    def model_fn(features, labels):
        with dapple_tf.layer("scale"):
            w = tf.compat.v1.get_variable("w", initializer=2.0)
            h = tf.nn.dropout(features * w, rate=0.5)
        with dapple_tf.layer("head"):
            return tf.reduce_mean(tf.reduce_sum(tf.nn.dropout(h, rate=0.5), axis=1)) + 0.0 * tf.reduce_mean(labels)

    # Positive inputs: loss and gradient are sums of positive terms in different orders, so they agree
    # to a few ulps; signed inputs cancel to a loss near 0, where that round-off is large relative to it.
    x = np.abs(toy_models.batch(8)[0]) + 0.5
    y = np.zeros(8, np.float32)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0)]), (1, 1, [cpu(1)])], num_micro_batches=4)
    with tf.Graph().as_default():
        sgd = tf.compat.v1.train.GradientDescentOptimizer(0.0)
        handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), sgd, plan,
                                          dapple_tf.PipelineOptions(recompute=True))
        (grad, w), = handle.grads_and_vars
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            for _ in range(3):
                sess.run(handle.train_op)
                loss, g, _ = sess.run([handle.loss, grad, handle.train_op])
                assert loss > 1.0
                np.testing.assert_allclose(g, loss / 2.0, rtol=1e-6)


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
def test_recomputation_runs_in_the_backward_slot(schedule):
    """Executed order per device is still the schedule's, with no overlap, so every recomputed
    forward ran inside its backward task; the forward tasks hand the backward tasks only their inputs."""
    x, y = toy_models.batch(16)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)]), (3, 4, [cpu(3)])], 4)
    metadata = tf.compat.v1.RunMetadata()
    sgd = SGD
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    *_, handle, _ = train_pipelined(model_fn, x, y, sgd, plan, schedule, 1, run_metadata=metadata, recompute=True)
    order = executed_tasks(metadata, handle)
    stage_of_device = {d: s.index for s in handle.stages for d in s.devices}
    for device, spans in order.items():
        assert [str(t) for _, t in spans] == [str(t) for t in handle.schedule.stage_tasks[stage_of_device[device]]]
        for ((_, end), _), ((start, _), task) in zip(spans, spans[1:]):
            assert end <= start, f"{device}: {task} started before the previous task ended"
        assert unordered_operations(metadata, handle, device, handle.schedule.stage_tasks[stage_of_device[device]]) == []
    graph_ops = {}
    for (_, task, _), names in handle.task_op_names.items():
        for n in names:
            graph_ops[n] = task
    with tf.Graph().as_default() as graph:  # rebuild to inspect the ops (the harness's graph is gone)
        handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), sgd(), plan,
                                          dapple_tf.PipelineOptions(schedule=schedule, recompute=True))
        forward = {n for (_, t, _), names in handle.task_op_names.items() if t.kind == FORWARD for n in names}
        for (_, task, _), names in handle.task_op_names.items():
            if task.kind != BACKWARD:
                continue
            for n in names:
                for t in graph.get_operation_by_name(n).inputs:
                    if t.op.name in forward:  # a stored input: a received boundary tensor or an input slice
                        assert t.op.type in ("Identity", "StridedSlice"), (n, t.name)


def test_recompute_argument_errors():
    x, y = toy_models.batch(8)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], num_micro_batches=2)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    for recompute, message in (([2], "names stage 2, but the plan has 2 stages"),
                               ([True], "stage indices"), ("all", "must be True, False, None or a list")):
        with tf.Graph().as_default(), pytest.raises(PlanError, match=message):
            dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), adam(), plan,
                                     dapple_tf.PipelineOptions(recompute=recompute))
    with tf.Graph().as_default(), pytest.raises(PlanError, match=r"schedule 'dapple-batched-w' keeps every "
                                                              r".*re-computation \(stages \[1\]\) exists to avoid"):
        dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), adam(), plan,
                                 dapple_tf.PipelineOptions(recompute=[1], schedule="dapple-batched-w"))


def test_a_stage_that_changes_state_is_not_recomputed():
    def model_fn(features, labels):
        with dapple_tf.layer("count"):
            calls = tf.compat.v1.get_variable("calls", initializer=0.0, trainable=False)
            w = tf.compat.v1.get_variable("w", initializer=1.0)
            with tf.control_dependencies([calls.assign_add(1.0)]):
                h = features * w
        with dapple_tf.layer("head"):
            return tf.reduce_mean(h) + 0.0 * tf.reduce_mean(labels)

    x, _ = toy_models.batch(4)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0)]), (1, 1, [cpu(1)])], num_micro_batches=2)
    with tf.Graph().as_default(), pytest.raises(DappleError, match=r"stage 0 cannot be recomputed: .*AssignAdd"):
        dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(np.zeros(4, np.float32)), adam(), plan,
                                 dapple_tf.PipelineOptions(recompute=[0]))


def test_build_pipeline_follows_the_plan_files_choice():
    proto = plan_pb2.Plan(num_micro_batches=2, schedule=plan_pb2.DAPPLE)
    proto.cluster.device_names.extend([cpu(0), cpu(1)])
    proto.stages.add(first_layer=0, last_layer=1, device_ids=[0])
    proto.stages.add(first_layer=2, last_layer=4, device_ids=[1], recompute=True)
    plan = dapple_tf.Plan.from_proto(proto)
    assert plan.recompute == (False, True)
    x, y = toy_models.batch(8)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    for recompute, stages in ((None, {1}), (False, set()), (True, {0, 1}), ([0], {0})):
        with tf.Graph().as_default():
            handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), adam(), plan,
                                              dapple_tf.PipelineOptions(recompute=recompute))
        recomputed = {task.stage for (_, task, _), names in handle.task_op_names.items()
                      if any("/recompute/" in n for n in names)}
        assert recomputed == stages, recompute
