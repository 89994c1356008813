"""Bad input to build_pipeline fails at build time with a clear error (type and message)."""

import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf import LayerMarkerError, PlanError
from dapple_tf.errors import DappleError
from tests import toy_models
from tests.pipeline_harness import cpu

N = 8


def build(model_fn=None, stages=None, m=2, n=N, schedule="dapple"):
    model_fn = model_fn or toy_models.skip_model_fn(toy_models.initial_values())
    stages = stages or [(0, 1, [cpu(0)]), (2, 4, [cpu(1)])]
    x, y = toy_models.batch(n)
    with tf.Graph().as_default():
        plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=m)
        return dapple_tf.build_pipeline(
            model_fn, tf.constant(x), tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
            dapple_tf.PipelineOptions(schedule=schedule)
        )


def test_unknown_layer_name():
    with pytest.raises(PlanError, match=r"stage 1: 'dense9' is not a layer of the model; its layers are \['dense0'"):
        build(stages=[(0, 1, [cpu(0)]), ("dense9", 4, [cpu(1)])])


def test_gap_between_stages():
    with pytest.raises(PlanError, match=r"stage 1 starts at layer 3 \('dense3'\) but must start right after stage 0"):
        build(stages=[(0, 1, [cpu(0)]), (3, 4, [cpu(1)])])


def test_layers_left_over():
    with pytest.raises(PlanError, match=r"the stages end at layer 3 but the model has 5 layers; layers \['head'\]"):
        build(stages=[(0, 1, [cpu(0)]), (2, 3, [cpu(1)])])


def test_index_out_of_range():
    with pytest.raises(PlanError, match="layer index 7 is out of range; the model has 5 layers"):
        build(stages=[(0, 1, [cpu(0)]), (2, 7, [cpu(1)])])


def test_missing_device():
    with pytest.raises(PlanError, match=r"devices \['/device:CPU:42'\] that this process does not have") as error:
        build(stages=[(0, 1, [cpu(0)]), (2, 4, ["/cpu:42"])])
    assert "To get them: dapple_train --num_devices=N" in str(error.value)  # how to get more devices
    assert ("tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0], "
            "[tf.config.LogicalDeviceConfiguration()] * N)") in str(error.value)


def test_device_used_twice():
    with pytest.raises(PlanError, match=r"device '/device:CPU:0' is used by stages 0 and 1"):
        build(stages=[(0, 1, [cpu(0)]), (2, 4, [cpu(0)])])


INTERLEAVED_STAGES = [(0, 0, [cpu(0)]), (1, 1, [cpu(1)]), (2, 2, [cpu(0)]), (3, 4, [cpu(1)])]


def test_stages_that_share_devices_need_the_interleaved_schedule():
    with pytest.raises(PlanError, match=r"manual: 4 stages on 2 device groups share devices; only the 'interleaved' "
                                        r"schedule runs several stages on one device, not 'dapple'"):
        build(stages=INTERLEAVED_STAGES, m=4)
    with pytest.raises(PlanError, match=r"manual: the interleaved schedule needs M \(3\) to be a multiple of the "
                                        r"device groups \(2\)"):
        build(stages=INTERLEAVED_STAGES, m=3, n=12, schedule="interleaved")
    with pytest.raises(PlanError, match=r"manual: stage 3 runs on \['/device:CPU:1'\], but stages that share devices "
                                        r"must take the 3 device groups round-robin"):
        build(stages=[(0, 0, [cpu(0)]), (1, 1, [cpu(1)]), (2, 2, [cpu(2)]), (3, 4, [cpu(1)])], m=4)
    assert build(stages=INTERLEAVED_STAGES, m=4, schedule=None).schedule.kind == "interleaved"  # the default


def test_empty_slice():
    with pytest.raises(PlanError, match=r"stage 0 is replicated on 3 devices but a micro-batch has only 2 samples"):
        build(stages=[(0, 1, [cpu(0), cpu(1), cpu(2)]), (2, 4, [cpu(3)])], m=4)


def test_batch_not_divisible():
    with pytest.raises(PlanError, match=r"global batch size 8 is not divisible by 3 micro-batches; valid micro-batch counts: \[1, 2, 4, 8\]"):
        build(m=3)


def test_unknown_schedule():
    with pytest.raises(PlanError, match="unknown schedule 'pipedream'"):
        build(schedule="pipedream")


def unmarked_op_model(features, labels):
    w = tf.compat.v1.get_variable("w", initializer=tf.ones([toy_models.IN, toy_models.CLASSES]))
    scaled = features * 2.0  # computes from the inputs outside any layer
    with dapple_tf.layer("a"):
        logits = tf.matmul(scaled, w)
    with dapple_tf.layer("b"):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_marker_missing():
    with pytest.raises(LayerMarkerError, match=r"operation mul \(Mul\) computes from the model inputs outside any dapple_tf.layer"):
        build(model_fn=unmarked_op_model, stages=[(0, 0, [cpu(0)]), (1, 1, [cpu(1)])])


def test_no_markers_at_all():
    def model_fn(features, labels):
        return tf.reduce_mean(features)

    with pytest.raises(LayerMarkerError, match="model_fn marked no layers"):
        build(model_fn=model_fn, stages=[(0, 0, [cpu(0)])])


def test_nested_marker():
    def model_fn(features, labels):
        with dapple_tf.layer("outer"):
            with dapple_tf.layer("inner"):
                return tf.reduce_mean(features)

    with pytest.raises(LayerMarkerError, match="layer 'inner' is opened inside layer 'outer'; dapple_tf.layer markers cannot nest"):
        build(model_fn=model_fn, stages=[(0, 0, [cpu(0)])])


def test_duplicate_marker():
    def model_fn(features, labels):
        with dapple_tf.layer("a"):
            h = features * 2.0
        with dapple_tf.layer("a"):
            return tf.reduce_mean(h)

    with pytest.raises(LayerMarkerError, match="layer 'a' is marked twice"):
        build(model_fn=model_fn, stages=[(0, 0, [cpu(0)])])


def test_loss_outside_last_layer():
    def model_fn(features, labels):
        with dapple_tf.layer("a"):
            loss = tf.reduce_mean(features)
        with dapple_tf.layer("b"):
            tf.identity(features)
        return loss

    with pytest.raises(LayerMarkerError, match="the loss must be computed in the last layer 'b'; it comes from layer 'a'"):
        build(model_fn=model_fn, stages=[(0, 1, [cpu(0)])])


def test_batch_statistic_crossing_a_boundary():
    def model_fn(features, labels):
        with dapple_tf.layer("a"):
            mean = tf.reduce_mean(features, axis=0)  # depends on the batch, has no batch dimension
        with dapple_tf.layer("b"):
            return tf.reduce_mean(features - mean)

    with pytest.raises(DappleError, match=r"crosses from stage 0 to stage 1 and depends on the batch, but its first dimension is not the batch"):
        build(model_fn=model_fn, stages=[(0, 0, [cpu(0)]), (1, 1, [cpu(1)])])


def test_plan_file_layer_names_must_match(tmp_path):
    from planner.formats import plan_pb2, write_message

    proto = plan_pb2.Plan(num_micro_batches=2, global_batch_size=N)
    proto.cluster.device_names.extend([cpu(0), cpu(1)])
    proto.stages.add(first_layer=0, last_layer=1, layer_names=["dense0", "dense1"], device_ids=[0])
    proto.stages.add(first_layer=2, last_layer=4, layer_names=["dense2", "dense3", "output"], device_ids=[1])
    path = str(tmp_path / "plan.json")
    write_message(proto, path)
    x, y = toy_models.batch(N)
    with tf.Graph().as_default():
        with pytest.raises(PlanError, match=r"plan\.json: stage 1 names layers \['dense2', 'dense3', 'output'\] but the model's layers 2\.\.4 are \['dense2', 'dense3', 'head'\]"):
            dapple_tf.build_pipeline(
                toy_models.skip_model_fn(toy_models.initial_values()),
                tf.constant(x), tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), path,
            )


def test_plan_file_round_trip_builds(tmp_path):
    from planner.formats import plan_pb2, write_message

    proto = plan_pb2.Plan(num_micro_batches=2, global_batch_size=N, policy=plan_pb2.POLICY_A)
    proto.cluster.device_names.extend([cpu(0), cpu(1), cpu(2)])
    proto.stages.add(first_layer=0, last_layer=1, layer_names=["dense0", "dense1"], device_ids=[0, 1], warmup_micro_batches=2)
    proto.stages.add(first_layer=2, last_layer=4, layer_names=["dense2", "dense3", "head"], device_ids=[2], warmup_micro_batches=1)
    path = str(tmp_path / "plan.pbtxt")
    write_message(proto, path)
    plan = dapple_tf.Plan.from_file(path)
    assert plan.warmup == (2, 1)
    assert [s.devices for s in plan.stages] == [(cpu(0), cpu(1)), (cpu(2),)]
    handle = build(stages=[(s.first_layer, s.last_layer, list(s.devices)) for s in plan.stages])
    assert [s.replication for s in handle.stages] == [2, 1]
    assert handle.micro_batch_size == 4


def test_warmup_counts_that_deadlock_are_refused():
    x, y = toy_models.batch(N)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], num_micro_batches=2, warmup=[1, 2])
    with tf.Graph().as_default():
        with pytest.raises(PlanError, match="schedule deadlocks: stage 0 waits at B0; stage 1 waits at F1"):
            dapple_tf.build_pipeline(
                toy_models.skip_model_fn(toy_models.initial_values()),
                tf.constant(x), tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
            )


def test_eager_mode_says_graph_mode_is_required():
    x, y = toy_models.batch(N)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], num_micro_batches=2)
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    assert tf.executing_eagerly()
    with pytest.raises(DappleError, match=r"needs graph mode but TensorFlow is executing eagerly.*tf.Graph\(\).as_default"):
        dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(y), sgd, plan)

    def traced(features, labels):
        return dapple_tf.build_pipeline(model_fn, features, labels, sgd, plan).loss

    with pytest.raises(DappleError, match=r"called inside a tf.function.*tf.compat.v1.Session"):
        tf.function(traced, autograph=False)(tf.constant(x), tf.constant(y))
    with pytest.raises(Exception, match=r"DappleError: build_pipeline was called inside a tf.function"):
        tf.function(traced)(tf.constant(x), tf.constant(y))  # autograph wraps it as a StagingError
