"""Training code as TF1 scripts are written (issue 35): the batch size read with tf.shape and used across stage
boundaries, hidden states kept as [batch * seq, hidden], gradients clipped by global norm (and a gradient
function), an Optimizer subclass making its slots in apply_gradients, learning rates from global_step, and
dapple_tf.minimize in model_fn: pipelined equal to one device."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

import dapple_tf
from dapple_tf import DappleError
from dapple_tf.rewrite.batch import sample_rows
from tests import tf1_models
from tests.pipeline_harness import SESSION_CONFIG, cpu, initial_weights
from tests.training_scripts_harness import Spec, differences, scripted, train_pipelined, train_single

v1 = tf.compat.v1
LAYERS = dapple_tf.layers_by_scope(patterns=tf1_models.BERT_LAYERS)
STEPS = 3
# bert/embeddings, bert/encoder/layer_0 | bert/encoder/layer_1, bert/pooler, loss
FIRST, SECOND = ("bert/embeddings", "bert/encoder/layer_0"), ("bert/encoder/layer_1", "loss")
PLANS = {
    "straight": [(*FIRST, [cpu(0)]), (*SECOND, [cpu(1)])],
    "2:1": [(*FIRST, [cpu(0), cpu(1)]), (*SECOND, [cpu(2)])],
    "1:2": [(*FIRST, [cpu(0)]), (*SECOND, [cpu(1), cpu(2)])],
    "one stage on 2": [(FIRST[0], SECOND[1], [cpu(0), cpu(1)])],
}


@pytest.fixture(scope="module")
def bert():
    x, y = tf1_models.bert_batch(8)
    initial = initial_weights(tf1_models.bert_loss, x, y)
    return x, y, initial, train_single(tf1_models.bert_loss, x, y, tf1_models.adamw, STEPS, tf1_models.CLIP, initial)


@pytest.mark.parametrize("plan, schedule, m, functions", [
    ("straight", "dapple", 2, False),
    ("2:1", "gpipe", 2, False),
    ("1:2", "zb-h1", 2, True),
    ("2:1", "dapple", 4, True),
    ("one stage on 2", "dapple", 2, False),
])
def test_tf1_bert_pipelined_inside_its_encoder_trains_as_on_one_device(bert, plan, schedule, m, functions):
    """The batch size read once with tf.shape crosses the cut inside the encoder (each stage reads it at its own
    slice size), hidden states cross as [batch * seq, hidden] between replications (2:1, 1:2); AdamW with its
    own slots and exclusions, a warmup learning rate, clipping at 0.5 of norms near 1, global_step += 1."""
    x, y, initial, want = bert
    assert min(want.norms) > tf1_models.CLIP  # clipping acts in every step
    got = train_pipelined(tf1_models.bert_loss, x, y, tf1_models.adamw, dapple_tf.Plan.from_stages(
        PLANS[plan], num_micro_batches=m), STEPS, tf1_models.CLIP, initial, schedule=schedule, layers=LAYERS,
        stage_functions=functions)
    weights, norms = differences(want, got)
    assert got.global_step == STEPS
    assert weights < 1e-5 and norms < 1e-5 * max(want.norms), (weights, norms)


def test_gradient_fn_and_a_standard_optimizer_with_a_decaying_learning_rate():
    x, y = tf1_models.bert_batch(8)
    initial = initial_weights(tf1_models.bert_loss, x, y)

    def momentum():
        step = v1.train.get_or_create_global_step()
        return v1.train.MomentumOptimizer(v1.train.polynomial_decay(0.05, step, 10, 0.001), 0.9)

    def halve_embeddings(pairs):  # per-variable scaling, clipping by value (dense: IndexedSlices have no clip)
        return [(tf.clip_by_value(tf.convert_to_tensor(g), -0.01, 0.01) * (0.5 if "embeddings" in v.op.name else 1.0),
                 v) for g, v in pairs]

    want = train_single(tf1_models.bert_loss, x, y, momentum, STEPS, tf1_models.CLIP, initial, halve_embeddings)
    got = train_pipelined(tf1_models.bert_loss, x, y, momentum, dapple_tf.Plan.from_stages(
        PLANS["2:1"], num_micro_batches=2), STEPS, tf1_models.CLIP, initial, halve_embeddings, layers=LAYERS)
    weights, _ = differences(want, got)
    assert weights < 1e-5
    # MomentumOptimizer advances global_step too: twice per step, as on one device
    assert got.global_step == 2 * STEPS


def test_clipping_counts_gathered_rows_as_tf_does():
    """tf.clip_by_global_norm counts each gathered row of an embedding's IndexedSlices gradient (repeated ids
    too), not the rows' sum: so does the pipeline, summing every micro-batch's squares."""
    ids = np.array([[1, 1, 1, 2]] * 8, np.int32)
    y = np.arange(8, dtype=np.float32)

    def loss_fn(features, labels):
        with v1.variable_scope("embed"):
            table = v1.get_variable("table", [4, 3], initializer=v1.constant_initializer(0.5))
            h = tf.reduce_sum(tf.gather(table, features), axis=1)
        with v1.variable_scope("head"):
            w = v1.get_variable("w", [3, 1], initializer=v1.constant_initializer(0.1))
            return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))

    initial = initial_weights(loss_fn, ids, y)
    sgd = lambda: v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    want = train_single(loss_fn, ids, y, sgd, 2, 0.01, initial)
    plan = dapple_tf.Plan.from_stages([("embed", "embed", [cpu(0), cpu(1)]), ("head", "head", [cpu(2)])],
                                      num_micro_batches=2)
    got = train_pipelined(loss_fn, ids, y, sgd, plan, 2, 0.01, initial, layers=dapple_tf.layers_by_scope(depth=1))
    weights, norms = differences(want, got)
    assert weights < 1e-5 and norms < 1e-4 * max(want.norms)


def shape_scalar_model(features, labels):
    """The batch size read in the first layer and used by both: reshape, a tf.ones of the batch's shape,
    and the loss's mean written as a sum over tf.shape's batch size."""
    with v1.variable_scope("a"):
        batch = tf.shape(features)[0]
        w = v1.get_variable("w", [4, 6], initializer=v1.glorot_uniform_initializer(seed=5))
        h = tf.reshape(tf.matmul(features, w), [batch * 3, 2])  # [batch * 3, 2]: 3 rows per sample
    with v1.variable_scope("b"):
        v = v1.get_variable("v", [2, 1], initializer=v1.glorot_uniform_initializer(seed=6))
        rows = tf.reshape(tf.matmul(h, v), [batch, 3]) * tf.ones([batch, 3])
        return tf.reduce_sum(tf.square(tf.reduce_sum(rows, 1) - labels)) / tf.cast(batch, tf.float32)


@pytest.mark.parametrize("stages", [[("a", "a", [cpu(0)]), ("b", "b", [cpu(1), cpu(2), cpu(3)])],
                                    [("a", "a", [cpu(0), cpu(1), cpu(2)]), ("b", "b", [cpu(3)])]],
                         ids=["1:3", "3:1"])
def test_shape_values_are_read_at_each_slice_size(stages):
    """Uneven slices (10 samples, M=2: 5 = 2 + 2 + 1): each clone reads the batch size of its own slice."""
    rng = np.random.RandomState(1)
    x, y = rng.randn(10, 4).astype(np.float32), rng.randn(10).astype(np.float32)
    initial = initial_weights(shape_scalar_model, x, y)
    sgd = lambda: v1.train.GradientDescentOptimizer(0.05)  # noqa: E731
    want = train_single(shape_scalar_model, x, y, sgd, 2, 1e-3, initial)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    got = train_pipelined(shape_scalar_model, x, y, sgd, plan, 2, 1e-3, initial,
                          layers=dapple_tf.layers_by_scope(depth=1))
    weights, _ = differences(want, got)
    assert weights < 1e-6


def test_a_shape_that_depends_on_the_values_is_refused():
    def model_fn(features, labels):
        with v1.variable_scope("a"):
            kept = tf.boolean_mask(features, features[:, 0] > 0)
            count = tf.shape(kept)[0]  # depends on the values: differs between slices of one size
            h = features * v1.get_variable("w", [4], initializer=v1.ones_initializer())
        with v1.variable_scope("b"):
            return tf.reduce_mean(h * v1.get_variable("v", [4])) * tf.cast(count, tf.float32)

    x = np.random.RandomState(0).randn(8, 4).astype(np.float32)
    plan = dapple_tf.Plan.from_stages([("a", "a", [cpu(0)]), ("b", "b", [cpu(1)])], num_micro_batches=2)
    with tf.Graph().as_default():
        with pytest.raises(DappleError, match=r"a/Shape:0, the shape of a/boolean_mask/GatherV2:0 \(stage 0\), is used "
                                              r"in stage 1, which reads it for its own slice of the batch; but for a "
                                              r"slice of 4 samples it is \(None, 4\), not known before the step runs"):
            dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(x[:, 0]), v1.train.AdamOptimizer(),
                                     plan, layers=dapple_tf.layers_by_scope(depth=1))


def test_rows_per_sample_are_proven_from_the_ops():
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 6, 4])
        flat = tf.reshape(x, [-1, 4])
        merged = tf.reshape(flat * 2.0, [-1, 24])
        time_major = tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, 4])
        rows = sample_rows.SampleRows([x.op], {op for op in tf.compat.v1.get_default_graph().get_operations()
                                               if op is not x.op} | {x.op})
        assert [rows.rows_per_sample(t) for t in (x, flat, merged, time_major)] == [1, 6, 1, None]


def test_custom_optimizer_slots_live_on_their_copy_and_checkpoints_hold_the_single_device_set(monkeypatch):
    x, y = tf1_models.bert_batch(8)
    features = lambda: {k: tf.constant(v) for k, v in x.items()}  # noqa: E731
    plan = dapple_tf.Plan.from_stages(PLANS["2:1"], num_micro_batches=2)

    def compared(*_):
        raise AssertionError("a variable compared with ==: a call into TF, per variable of a collection")

    with tf.Graph().as_default():
        # the copies' slots leave the global variables by identity: by ==, the paper plan's build was quadratic
        monkeypatch.setattr(resource_variable_ops.BaseResourceVariable, "__eq__", compared)
        dapple_tf.build_pipeline(scripted(tf1_models.bert_loss, tf1_models.adamw, 1.0), features(), tf.constant(y),
                                 None, plan, layers=LAYERS)
        monkeypatch.undo()
        by_name = {v.op.name: v for v in v1.global_variables() + v1.local_variables()}
        kernel = "bert/encoder/layer_0/attention/self/query/kernel"
        assert by_name[f"{kernel}/dapple_copy/adam_m"].device == by_name[f"{kernel}/dapple_copy"].device == cpu(1)
        assert by_name[f"{kernel}/adam_m"].device == cpu(0)
        pipelined = {v.op.name for v in v1.global_variables()}
    with tf.Graph().as_default():  # the script on one device
        loss = tf1_models.bert_loss(features(), tf.constant(y))
        tvars = v1.trainable_variables()
        tf1_models.adamw().apply_gradients(zip(v1.gradients(loss, tvars), tvars))
        assert pipelined == {v.op.name for v in v1.global_variables()}


def test_an_optimizer_that_treats_copies_apart_is_refused():
    x, y = tf1_models.bert_batch(8)

    def anchored():
        return tf1_models.optimization.AdamWeightDecayOptimizer(0.01, weight_decay_rate=0.01,
                                                                exclude_from_weight_decay=["bias$"])

    plan = dapple_tf.Plan.from_stages(PLANS["2:1"], num_micro_batches=2)
    with tf.Graph().as_default():
        with pytest.raises(DappleError, match=r"the optimizer \(AdamWeightDecayOptimizer\) builds a different "
                                              r"update for bert/.*bias/dapple_copy, the copy of bert/.*bias on "
                                              r"another device"):
            dapple_tf.build_pipeline(scripted(tf1_models.bert_loss, anchored, 1.0),
                                     {k: tf.constant(v) for k, v in x.items()}, tf.constant(y), None, plan,
                                     layers=LAYERS)


def _build(model_fn, optimizer=None, options=None, stages=(("a", "a", [cpu(0)]), ("b", "b", [cpu(1)]))):
    x = np.ones((4, 3), np.float32)
    plan = dapple_tf.Plan.from_stages(list(stages), num_micro_batches=2)
    return dapple_tf.build_pipeline(model_fn, tf.constant(x), tf.constant(x[:, 0]), optimizer, plan, options,
                                    layers=dapple_tf.layers_by_scope(depth=1))


def two_layers(features, labels):
    with v1.variable_scope("a"):
        h = features * v1.get_variable("w", [3], initializer=v1.ones_initializer())
    with v1.variable_scope("b"):
        return tf.reduce_mean(tf.square(tf.reduce_sum(h, 1) * v1.get_variable("v", []) - labels))


@pytest.mark.parametrize("gradient_fn, message", [
    (lambda pairs: pairs[1:], r"gradient_fn dropped the gradients of \['a/w:0'\]"),
    (lambda pairs: pairs + [(tf.constant(1.0), v1.get_variable("extra", []))],
     r"gradient_fn returned a gradient for extra:0, which is not one of the variables it was given"),
    (lambda pairs: [(None, v) for _, v in pairs], r"gradient_fn returned no gradient \(None\) for a/w:0"),
    (lambda pairs: pairs + pairs[:1], r"gradient_fn returned a/w:0 twice"),
])
def test_a_gradient_fn_must_return_each_variable_once(gradient_fn, message):
    with tf.Graph().as_default(), pytest.raises(DappleError, match=message):
        _build(two_layers, v1.train.GradientDescentOptimizer(0.1), dapple_tf.PipelineOptions(gradient_fn=gradient_fn))


def test_bad_clip_values_and_keras_optimizers_are_refused():
    for bad in (0, -1.0, "1"):
        with pytest.raises(DappleError, match=r"clip_global_norm must be a number > 0, got"):
            dapple_tf.PipelineOptions(clip_global_norm=bad)
    with tf.Graph().as_default(), pytest.raises(
            DappleError, match=r"optimizer is a Keras optimizer \(.*Adam\); the pipeline applies the gradients "
                               r"itself in graph mode with a tf.compat.v1.train.Optimizer: use "
                               r"tf.compat.v1.train.AdamOptimizer"):
        _build(two_layers, tf.keras.optimizers.Adam())


def test_minimize_is_checked_against_what_model_fn_returns():
    sgd = v1.train.GradientDescentOptimizer(0.1)

    def twice(features, labels):
        loss = two_layers(features, labels)
        dapple_tf.minimize(loss, sgd)
        return Spec(loss, dapple_tf.minimize(loss, sgd))

    def no_optimizer(features, labels):
        loss = two_layers(features, labels)
        return Spec(loss, tf.no_op())

    def minimize_and_apply(features, labels):
        loss = two_layers(features, labels)
        dapple_tf.minimize(loss, sgd)
        return Spec(loss, sgd.minimize(loss))

    def reads_inputs(features, labels):
        loss = two_layers(features, labels)
        return Spec(loss, tf.group(dapple_tf.minimize(loss, sgd), tf.reduce_sum(features)))

    def other_loss(features, labels):
        loss = two_layers(features, labels)
        dapple_tf.minimize(loss * 2.0, sgd)
        return loss

    cases = [(twice, None, r"model_fn called dapple_tf.minimize 2 times"),
             (no_optimizer, None, r"model_fn returned an EstimatorSpec whose train_op \(NoOp\) applies no optimizer"),
             (minimize_and_apply, None, r"model_fn calls dapple_tf.minimize and also applies gradients itself \(at "
                                        r"test_training_scripts.py:\d+\)"),
             (reads_inputs, None, r"the EstimatorSpec's train_op .* computes from the model's inputs"),
             (other_loss, None, r"dapple_tf.minimize was given mul:0, but model_fn returned the loss"),
             (lambda f, l: Spec(two_layers(f, l), None), None, r"build_pipeline got no optimizer \(None\)"),
             (scripted(two_layers, lambda: sgd, 1.0), sgd, r"model_fn called dapple_tf.minimize with its own optimizer "
                                                           r"and build_pipeline got one too")]
    for model_fn, optimizer, message in cases:
        with tf.Graph().as_default(), pytest.raises(DappleError, match=message):
            _build(model_fn, optimizer)
    with tf.Graph().as_default():
        loss = tf.constant(1.0)
        with pytest.raises(DappleError, match=r"dapple_tf.minimize only works in a model_fn that dapple_tf builds"):
            dapple_tf.minimize(loss, sgd)


def test_minimize_and_options_must_agree_on_clipping():
    sgd = v1.train.GradientDescentOptimizer(0.1)
    with tf.Graph().as_default(), pytest.raises(DappleError, match=r"clip_global_norm is 1.0 in dapple_tf.minimize "
                                                                   r"and 2.0 in PipelineOptions: set it in one place"):
        _build(scripted(two_layers, lambda: sgd, 1.0), None, dapple_tf.PipelineOptions(clip_global_norm=2.0))
    with tf.Graph().as_default():
        handle = _build(scripted(two_layers, lambda: sgd, None), None, dapple_tf.PipelineOptions(clip_global_norm=2.0))
        assert handle.global_norm is not None
        with v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            assert sess.run(handle.global_norm) > 0
