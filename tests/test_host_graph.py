"""A per-host graph holds only what its task reads (dapple_tf/rewrite/hosts/host_graph.py): the same operations however
many layers other tasks run, the same seeds as the whole template, and its collections and control inputs kept.
That it trains bit for bit like the one graph: tests/test_per_host.py."""

import gc
import logging

import numpy as np
import tensorflow as tf

import dapple_tf


def _task(i: int) -> str:
    return f"/job:worker/replica:0/task:{i}"


def _model_fn(layers: int, outside=None):
    """`layers` marked layers of 4 units, each its own randomly initialized weights; `outside`: a tensor of the
    graph made before build_pipeline, which model_fn reads."""
    def model_fn(x, y):
        h = x
        for i in range(layers):
            with dapple_tf.layer(f"layer{i}"):
                h = h if outside is None or i else h * outside
                w = tf.compat.v1.get_variable(f"w{i}", [4, 4], initializer=tf.compat.v1.random_normal_initializer())
                h = tf.nn.relu(tf.matmul(h, w)) + h
                if i == layers - 1:
                    return tf.reduce_mean(tf.square(h - y))
    return model_fn


def _build(layers: int, task: int, whole_template=False, outside=False):
    """(graph, handle) of `task`'s part of a straight pipeline of `layers` one-layer stages, one per task."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(7)
        tf.random.uniform([2], name="made_before")  # a seeded random op before the model: counted in its seeds
        scale = tf.constant(2.0, name="scale") if outside else None
        x, y = np.ones([8, 4], np.float32), np.zeros([8, 4], np.float32)
        plan = dapple_tf.Plan.from_stages([(i, i, [f"{_task(i)}/device:CPU:0"]) for i in range(layers)], 2)
        handle = dapple_tf.build_pipeline(_model_fn(layers, scale), tf.constant(x), tf.constant(y),
                                          tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                          dapple_tf.PipelineOptions(own_task=_task(task), whole_template=whole_template))
        tf.random.uniform([2], name="made_after")
    return graph, handle


def test_a_tasks_graph_does_not_grow_with_the_layers_of_other_tasks():
    sizes = {(layers, last): len(_build(layers, layers - 1 if last else 0)[0].get_operations())
             for layers in (2, 5) for last in (False, True)}
    assert sizes[(2, False)] == sizes[(5, False)] and sizes[(2, True)] == sizes[(5, True)], sizes
    whole = len(_build(5, 0, whole_template=True)[0].get_operations())
    assert whole - sizes[(5, False)] > 4 * 10, (whole, sizes)  # about a dozen operations per other task's layer


def _seeds(graph):
    return {op.name: (op.get_attr("seed"), op.get_attr("seed2")) for op in graph.get_operations()
            if op.type in ("RandomStandardNormal", "RandomUniform")}


def test_random_operations_keep_the_seeds_of_the_whole_template():
    pruned, whole = _seeds(_build(3, 1)[0]), _seeds(_build(3, 1, whole_template=True)[0])
    assert set(pruned) == {"made_before/RandomUniform", "made_after/RandomUniform",
                           "w1/Initializer/random_normal/RandomStandardNormal"}, pruned
    assert pruned == {name: whole[name] for name in pruned}
    assert len(set(whole.values())) == len(whole)  # every random op its own seeds: the comparison can fail


def test_the_graph_keeps_its_own_variables_and_what_its_part_reads():
    graph, handle = _build(3, 1)
    with graph.as_default():
        assert [v.op.name for v in tf.compat.v1.trainable_variables()] == ["w1"]
        assert [v.op.name for v in tf.compat.v1.global_variables()] == ["w1"]
        assert [v.op.name for _, v in handle.grads_and_vars] == ["w1"]
        assert handle.grads_and_vars[0][1] is tf.compat.v1.trainable_variables()[0]
        assert handle.train_op.graph is graph and handle.tasks == (_task(1), _task(0), _task(2))
        tf.compat.v1.train.Saver()  # over the restored variables
    assert not {op.name for op in graph.get_operations()} & {"w0", "w2", "layer0/MatMul"}


def test_control_inputs_on_operations_made_before_the_build_are_kept():
    """The local init runs the initializers of local variables made before build_pipeline (an input pipeline's
    counters), a control input the importer maps only under a name prefix."""
    graph = tf.Graph()
    with graph.as_default():
        counter = tf.compat.v1.Variable(0, name="epochs", collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        plan = dapple_tf.Plan.from_stages([(i, i, [f"{_task(i)}/device:CPU:0"]) for i in range(2)], 2)
        handle = dapple_tf.build_pipeline(_model_fn(2), tf.ones([8, 4]), tf.zeros([8, 4]),
                                          tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                          dapple_tf.PipelineOptions(own_task=_task(0)))
    assert counter.initializer in dapple_tf.rewrite.graphs.graph_walk.ancestors(handle.local_init_op)


def test_a_model_fn_reading_a_tensor_made_outside_it_keeps_the_whole_template(caplog):
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        graph, _ = _build(3, 0, outside=True)
    whole = _build(3, 0, whole_template=True, outside=True)[0]
    assert len(graph.get_operations()) == len(whole.get_operations())
    assert "this task's graph keeps every task's layers (PipelineOptions.whole_template): building in a scratch " \
           "graph failed on a tensor made outside model_fn" in caplog.text


def test_a_task_talks_only_to_the_tasks_its_part_reads_or_sends_to():
    """Task 0 of three stages sends to task 1 alone; with the whole template its session also placed stage 2's
    layer on task 2 (PipelineHandle.tasks becomes its device filters)."""
    assert _build(3, 0)[1].tasks == (_task(0), _task(1))
    assert _build(3, 0, whole_template=True)[1].tasks == (_task(0), _task(1), _task(2))


def test_python_functions_of_the_part_stay_registered_while_its_graph_lives():
    """A tf.py_function is registered for as long as the graph that made it lives: the scratch graph, kept alive
    with the task's graph."""
    from tensorflow.python.ops import script_ops  # pylint: disable=import-outside-toplevel

    def model_fn(x, y):
        with dapple_tf.layer("layer0"):
            h = tf.py_function(lambda t: t * 2.0, [x], tf.float32)
            h.set_shape(x.shape)
            w = tf.compat.v1.get_variable("w0", [4, 4], initializer=tf.compat.v1.ones_initializer())
            h = tf.matmul(h, w)
        with dapple_tf.layer("layer1"):
            return tf.reduce_mean(tf.square(h - y))

    graph = tf.Graph()
    with graph.as_default():
        plan = dapple_tf.Plan.from_stages([(i, i, [f"{_task(i)}/device:CPU:0"]) for i in range(2)], 2)
        dapple_tf.build_pipeline(model_fn, tf.ones([8, 4]), tf.zeros([8, 4]),
                                 tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                 dapple_tf.PipelineOptions(own_task=_task(0)))
    gc.collect()
    tokens = [op.get_attr("token") for op in graph.get_operations() if op.type == "EagerPyFunc"]
    assert tokens and all(script_ops._py_funcs.get(token.decode()) is not None for token in tokens)  # pylint: disable=protected-access


def test_a_trainer_evaluating_per_host_keeps_every_layer_on_the_loss_task_alone():
    """Held-out evaluation calls model_fn again on the loss's task (the last stage's), on every task's variables."""
    from dapple_tf.cluster.servers import TFCluster  # pylint: disable=import-outside-toplevel
    from dapple_tf.frontends.host_training import HostTraining  # pylint: disable=import-outside-toplevel

    stages = [[f"{_task(0)}/device:CPU:0"], [f"{_task(1)}/device:CPU:0", f"{_task(0)}/device:CPU:1"]]
    workers = ("127.0.0.1:1", "127.0.0.1:2")
    whole = {(task, evaluates): HostTraining(TFCluster(workers, "worker", task), None, None).pipeline_options(
        dapple_tf.PipelineOptions(), stages, evaluates).whole_template for task in (0, 1) for evaluates in (False, True)}
    assert whole == {(0, False): False, (0, True): False, (1, False): False, (1, True): True}
