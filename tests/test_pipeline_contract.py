"""Corner cases of the user contract: variables read outside layers, non-trainable variables,
sparse updates, control dependencies, seeds, shared resources, shapes, device spellings, re-use
of model_fn, and input types."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf import DappleError, PlanError
from dapple_tf.rewrite.graphs.graph_defs import private_copy, stage_graph_defs
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, assert_close_dicts, cpu, train_pipelined, train_single

SGD = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
TWO_TO_ONE = [(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)])]


def outside_reads_model_fn(features, labels):
    """A transposed weight and an L2 term computed outside the layers (they read variables)."""
    values = toy_models.initial_values()
    with dapple_tf.layer("dense0"):
        w0 = tf.compat.v1.get_variable("w0", initializer=tf.constant(values["w0"]))
        h0 = tf.tanh(tf.matmul(features, w0))
    w0_t = tf.transpose(w0)  # outside any layer
    regularizer = 0.1 * tf.nn.l2_loss(w0)  # outside any layer
    with dapple_tf.layer("dense1"):
        h1 = tf.tanh(tf.matmul(h0, tf.compat.v1.get_variable("w1", initializer=tf.constant(values["w1"]))))
    with dapple_tf.layer("head"):
        logits = tf.matmul(h1, w0_t)
        ce = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        return ce + regularizer


@pytest.mark.parametrize("stages", [TWO_TO_ONE, [(0, 2, [cpu(0), cpu(1)])]], ids=["2:1", "1 stage x2"])
def test_variables_read_outside_layers(stages):
    x, y = toy_models.batch(8)
    want_grads, want_weights, want_losses = train_single(outside_reads_model_fn, x, y, SGD, 3)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    grads, weights, losses, _, _ = train_pipelined(outside_reads_model_fn, x, y, SGD, plan, "dapple", 3)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def scaled_model_fn(features, labels):
    """A non-trainable variable (assigned between steps) read inside a replicated layer."""
    values = toy_models.initial_values()
    with dapple_tf.layer("dense0"):
        temperature = tf.compat.v1.get_variable("temperature", initializer=1.0, trainable=False)
        w0 = tf.compat.v1.get_variable("w0", initializer=tf.constant(values["w0"]))
        h0 = tf.tanh(tf.matmul(features, w0) / temperature)
    with dapple_tf.layer("head"):
        logits = tf.matmul(h0, tf.compat.v1.get_variable("wo", initializer=tf.constant(values["wo"])))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_non_trainable_variable_assigned_between_steps_is_read_by_every_replica():
    x, y = toy_models.batch(8)

    def losses(build):
        with tf.Graph().as_default():
            loss, train_op, init = build()
            temperature = [v for v in tf.compat.v1.global_variables() if v.op.name == "temperature"][0]
            with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
                sess.run(init)
                out = []
                for t in (1.0, 2.0, 4.0):
                    temperature.load(t, sess)
                    out.append(sess.run([loss, train_op])[0])
                return out

    def single():
        loss = scaled_model_fn(tf.constant(x), tf.constant(y))
        return loss, SGD().minimize(loss), tf.compat.v1.global_variables_initializer()

    def pipelined():
        plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)])], num_micro_batches=2)
        h = dapple_tf.build_pipeline(scaled_model_fn, tf.constant(x), tf.constant(y), SGD(), plan)
        return h.loss, h.train_op, h.initializer

    np.testing.assert_allclose(losses(pipelined), losses(single), rtol=1e-5)


def test_sparse_updates_match_minimize_with_a_lazy_optimizer():
    """Momentum on an embedding table, with batches touching different rows."""
    momentum = lambda: tf.compat.v1.train.MomentumOptimizer(0.5, 0.9)  # noqa: E731
    batches = []
    for rows in ((1, 2), (3, 4), (5, 6)):  # each batch touches its own rows of the table
        x, y = toy_models.embedding_batch(8, seed=rows[0])
        x["ids"] = np.random.RandomState(rows[1]).choice(rows, size=x["ids"].shape).astype(np.int32)
        batches.append((x, y))

    def run(build):
        with tf.Graph().as_default():
            phs = (
                tf.compat.v1.placeholder(tf.int32, [8, toy_models.TOKENS]),
                tf.compat.v1.placeholder(tf.float32, [8, toy_models.EMBED]),
                tf.compat.v1.placeholder(tf.int32, [8]),
            )
            train_op, init = build({"ids": phs[0], "dense": phs[1]}, phs[2])
            table = [v for v in tf.compat.v1.global_variables() if v.op.name == "table"][0]
            with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
                sess.run(init)
                for x, y in batches:
                    sess.run(train_op, {phs[0]: x["ids"], phs[1]: x["dense"], phs[2]: y})
                return sess.run(table)

    def single(features, y):
        loss = toy_models.embedding_model_fn(features, y)
        return momentum().minimize(loss), tf.compat.v1.global_variables_initializer()

    def pipelined(features, y):
        plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)])], num_micro_batches=2)
        h = dapple_tf.build_pipeline(toy_models.embedding_model_fn, features, y, momentum(), plan)
        return h.train_op, h.initializer

    np.testing.assert_allclose(run(pipelined), run(single), rtol=1e-5, atol=1e-6)


def test_control_dependencies_inside_a_layer_are_kept():
    def model_fn(features, labels):
        with dapple_tf.layer("checked"):
            check = tf.debugging.assert_less(tf.reduce_max(features), -100.0, message="features too large")
            with tf.control_dependencies([check]):
                h = features * tf.compat.v1.get_variable("w", initializer=2.0)
        with dapple_tf.layer("head"):
            return tf.reduce_mean(h)

    x, y = toy_models.batch(8)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)])], num_micro_batches=2)
    with tf.Graph().as_default():
        h = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), SGD(), plan)
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(h.initializer)
            with pytest.raises(tf.errors.InvalidArgumentError, match="features too large"):
                sess.run(h.loss)


def test_fixed_seed_random_ops_get_a_seed_per_clone():
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        y = tf.nn.dropout(x, rate=0.5, seed=7)
        ops = [op for op in graph.get_operations() if op.type != "Placeholder"]
        stage = stage_graph_defs(graph, [ops])[0]
        assert stage.seeded
        seeds = set()
        for salt in (1, 2, 3):
            nodes = private_copy(stage, f"_c{salt}", salt).node
            seeds.add(tuple(n.attr["seed2"].i for n in nodes if "seed2" in n.attr))
        assert len(seeds) == 3
        del y


def test_lookup_table_created_in_a_layer():
    def model_fn(features, labels):
        with dapple_tf.layer("lookup"):
            table = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(tf.constant([0, 1, 2]), tf.constant([1.0, 2.0, 3.0])), 0.0
            )
            scale = table.lookup(labels)[:, None]
            h = features * scale
        with dapple_tf.layer("head"):
            w = tf.compat.v1.get_variable("w", initializer=tf.ones([toy_models.IN, 1]))
            return tf.reduce_mean(tf.matmul(h, w))

    x, y = toy_models.batch(8)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)])], num_micro_batches=2)
    with tf.Graph().as_default():
        h = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), SGD(), plan)
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run([h.initializer, tf.compat.v1.tables_initializer()])
            want = np.mean(x.sum(axis=1) * (y + 1))
            np.testing.assert_allclose(sess.run(h.loss), want, rtol=1e-5)


def test_boundary_tensor_without_a_batch_dimension_is_refused():
    def model_fn(features, labels):
        with dapple_tf.layer("flatten"):
            rows = tf.reshape(tf.transpose(features), [-1, 2])  # [3 * batch, 2], samples interleaved in the rows
        with dapple_tf.layer("head"):
            return tf.reduce_mean(tf.tanh(rows))

    x, y = toy_models.batch(8)
    plan = dapple_tf.Plan.from_stages([(0, 0, [cpu(0)]), (1, 1, [cpu(1), cpu(2)])], num_micro_batches=2)
    with tf.Graph().as_default():
        with pytest.raises(DappleError, match=r"flatten/Reshape:0 leaves stage 0 and is split by samples, but its first dimension is not the batch"):
            dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), SGD(), plan)


def test_one_device_spelled_two_ways_is_refused():
    with pytest.raises(PlanError, match=r"device '/device:CPU:0' is used by stages 0 and 1"):
        x, y = toy_models.batch(8)
        plan = dapple_tf.Plan.from_stages(
            [(0, 1, ["/cpu:0"]), (2, 4, ["/job:localhost/replica:0/task:0/device:CPU:0"])], num_micro_batches=2
        )
        with tf.Graph().as_default():
            dapple_tf.build_pipeline(
                toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x), tf.constant(y), SGD(), plan
            )


def test_model_fn_builds_again_for_evaluation_after_build_pipeline():
    x, y = toy_models.batch(8)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    plan = dapple_tf.Plan.from_stages(TWO_TO_ONE[:1] + [(2, 4, [cpu(2)])], num_micro_batches=2)
    with tf.Graph().as_default():
        h = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), SGD(), plan)
        with tf.compat.v1.variable_scope("", reuse=True):
            eval_loss = model_fn(tf.constant(x), tf.constant(y))
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(h.initializer)
            np.testing.assert_allclose(sess.run(eval_loss), sess.run(h.loss), rtol=1e-6)


def build(model_fn=None, labels=True, optimizer=None, stages=None):
    x, y = toy_models.batch(8)
    with tf.Graph().as_default():
        plan = dapple_tf.Plan.from_stages(stages or [(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], num_micro_batches=2)
        return dapple_tf.build_pipeline(
            model_fn or toy_models.skip_model_fn(toy_models.initial_values()),
            tf.constant(x), tf.constant(y) if labels else None, optimizer or SGD(), plan,
        )


def test_labels_may_be_none():
    def model_fn(features, labels):
        assert labels is None
        with dapple_tf.layer("a"):
            h = tf.tanh(features * tf.compat.v1.get_variable("w", initializer=1.0))
        with dapple_tf.layer("b"):
            return tf.reduce_mean(h)

    handle = build(model_fn, labels=False, stages=[(0, 0, [cpu(0)]), (1, 1, [cpu(1)])])
    assert [s.layer_names for s in handle.stages] == [("a",), ("b",)]


def test_bad_types_are_named():
    with pytest.raises(PlanError, match=r"stage 1: a device is a string such as '/cpu:0', got 3"):
        dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 4, [3])], num_micro_batches=2)
    with pytest.raises(DappleError, match="optimizer must be a tf.compat.v1.train.Optimizer"):
        build(optimizer=object())

    def int_loss(features, labels):
        with dapple_tf.layer("a"):
            return tf.reduce_sum(labels)

    with pytest.raises(DappleError, match="model_fn must return a floating-point loss, got int32"):
        build(int_loss, stages=[(0, 0, [cpu(0)])])


def test_plan_file_batch_size_and_schedule_are_used(tmp_path):
    from planner.formats import plan_pb2, write_message

    proto = plan_pb2.Plan(num_micro_batches=2, global_batch_size=8, schedule=plan_pb2.GPIPE)
    proto.cluster.device_names.extend([cpu(0), cpu(1)])
    proto.stages.add(first_layer=0, last_layer=1, device_ids=[0])
    proto.stages.add(first_layer=2, last_layer=4, device_ids=[1])
    path = str(tmp_path / "plan.pbtxt")
    write_message(proto, path)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    with tf.Graph().as_default():
        x, y = toy_models.batch(8)
        handle = dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), SGD(), path)
        assert handle.schedule.kind == "gpipe"
    with tf.Graph().as_default():
        x, y = toy_models.batch(16)
        with pytest.raises(PlanError, match="the plan is for a global batch of 8 but the features hold 16 samples"):
            dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), SGD(), path)


def test_model_without_trainable_variables():
    def model_fn(features, labels):
        with dapple_tf.layer("a"):
            return tf.reduce_mean(features)

    with pytest.raises(DappleError, match="the loss depends on no trainable variable"):
        build(model_fn, stages=[(0, 0, [cpu(0)])])
