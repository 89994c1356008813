"""layers_by_scope on Keras models (Keras 2 on TF 2.15, Keras 3 on TF 2.21): one layer per Keras layer,
its variables with its computation; the loss's own scope joins the last layer; profiles list each
Keras layer once."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
import profiler
from dapple_tf.model import scopes
from tests.pipeline_harness import cpu

K = tf.keras


def recorded(model_fn, depth=1, n_in=6):
    """(recorder after drop_layers_unused_by, loss) for model_fn on placeholders."""
    with tf.Graph().as_default() as graph:
        recorder = dapple_tf.layers_by_scope(depth=depth).recorder(graph)
        with recorder.activate():
            loss = model_fn(tf.compat.v1.placeholder(tf.float32, [None, n_in]),
                            tf.compat.v1.placeholder(tf.int32, [None]))
        recorder.drop_layers_unused_by(loss)
        return recorder, loss


def placed(model_fn, depth=1):
    """(recorder, the (name, index) pairs device_for_layer was asked for while model_fn's ops were created)."""
    asked = []
    with tf.Graph().as_default() as graph:
        recorder = dapple_tf.layers_by_scope(depth=depth).recorder(graph, lambda *name_index: asked.append(name_index))
        with recorder.activate():
            loss = model_fn(tf.compat.v1.placeholder(tf.float32, [None, 6]), tf.compat.v1.placeholder(tf.int32, [None]))
        recorder.drop_layers_unused_by(loss)
    return recorder, asked


def xent(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def bare_layers(x, y):
    h = K.layers.Dense(8, activation="tanh", name="d0")(x)
    h = K.layers.LayerNormalization(name="ln")(h)
    return xent(y, K.layers.Dense(4, name="d1")(h))


def sequential(x, y):
    model = K.Sequential([K.layers.Dense(8, activation="tanh", name="d0"), K.layers.LayerNormalization(name="ln"),
                          K.layers.Dense(4, name="d1")], name="seq")
    return xent(y, model(x))


def functional(x, y):
    inputs = K.Input((6,))
    outputs = K.layers.Dense(4, name="d1")(K.layers.Dense(8, activation="tanh", name="d0")(inputs))
    return xent(y, K.Model(inputs, outputs, name="net")(x))


def weights_with_their_ops(recorder):
    """Per recorded layer: does it hold both each variable it creates and the ops reading it? -> set of
    variable names whose handle and first reading matmul/layer op are in different layers."""
    layer_of = recorder.layer_of_op()
    apart = set()
    for record in recorder.layers:
        for op in record.ops:
            if op.type != "VarHandleOp":
                continue
            readers = [c for c in op.outputs[0].consumers() if c.type == "ReadVariableOp"]
            users = [u.name for r in readers for t in r.outputs for u in t.consumers()
                     if u.type in ("MatMul", "BiasAdd", "Mul", "AddV2", "Reshape")]
            if users and all(layer_of.get(u) != record.index for u in users):
                apart.add(op.name)
    return apart


@pytest.mark.parametrize("model_fn, names, num_variables", [
    (bare_layers, ["d0", "ln", "d1"], 6),
    (functional, ["net"], 4),  # Keras 3 calls it in a scope "net_2": named by its Keras name
], ids=["bare", "functional"])
def test_one_layer_per_keras_layer_at_depth_1(model_fn, names, num_variables):
    recorder, loss = recorded(model_fn)
    # Keras 3 builds "d0" and calls it in "d0_1": one layer, named "d0"; the loss's own scope
    # (SparseSoftmaxCrossEntropyWithLogits) joins the last layer.
    assert recorder.names == names
    assert recorder.layer_of_op()[loss.op.name] == len(names) - 1
    assert weights_with_their_ops(recorder) == set()
    assert sum(op.type == "VarHandleOp" for r in recorder.layers for op in r.ops) == num_variables


def test_sequential_layers_at_depth_2_hold_their_weights():
    recorder, _ = recorded(sequential, depth=2)
    assert recorder.names == ["seq/d0", "seq/ln", "seq/d1"]
    assert weights_with_their_ops(recorder) == set()


def keras_3():
    """Keras 3's global state (its name counters and name scopes), or None (Keras 2)."""
    K.layers.Dense  # noqa: B018 (tf.keras loads Keras lazily)
    return scopes._keras_state()


def test_names_do_not_depend_on_models_built_before():
    # Keras 3 numbers unnamed layers per process, Keras 2 per graph: the recorder makes both per graph, so
    # a profile and a training graph built later in one process name the same layers.
    if keras_3():
        K.backend.clear_session()  # numbering from 0, as in a new process
    made = []

    def unnamed(x, y):
        made[:] = [K.layers.Dense(8), K.layers.Dense(4)]
        return xent(y, made[1](made[0](x)))

    first = recorded(unnamed)[0].names
    # Each layer is its Keras layer's name: "dense_1", not the scope TF gave Keras 3's variables ("dense_1_1",
    # "dense_1" being the first Dense's call scope) nor its call scope ("dense_1_2").
    assert first == [layer.name for layer in made] == ["dense", "dense_1"]
    assert recorded(unnamed)[0].names == first


class Backbone(K.Model):
    """A model of named and unnamed layers, called inside model_fn (as a keras-hub backbone is)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = K.layers.Dense(8, name="token_embedding")
        self.blocks = [K.layers.Dense(8, activation="tanh") for _ in range(2)]

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.embedding(x)


def backbone_model(x, y):
    return xent(y, K.layers.Dense(4, name="head")(Backbone(name="bert_backbone")(x)))


def test_nested_keras_layers_keep_their_names_however_often_the_model_was_built():
    """Each scope component by the Keras name it was opened for ("bert_backbone/token_embedding", not TF's
    "bert_backbone_1_2/token_embedding_1"), and auto-named layers counted in this graph only: models built
    before, outside recordings (a single-device run, an evaluation), change nothing."""
    if keras_3():
        K.backend.clear_session()
    first = recorded(backbone_model, depth=2)[0].names
    for _ in range(2):  # built outside a recording: Keras 3 names the next ones "bert_backbone_1", "dense_4", ...
        with tf.Graph().as_default():
            backbone_model(tf.compat.v1.placeholder(tf.float32, [None, 6]), tf.compat.v1.placeholder(tf.int32, [None]))
    again = recorded(backbone_model, depth=2)[0].names
    expected = ["bert_backbone/dense", "bert_backbone/dense_1", "bert_backbone/token_embedding"]
    assert first == again == expected if keras_3() else first == again


def test_a_layer_made_before_recording_keeps_a_name_no_new_layer_takes():
    # Keras 3: a layer made outside model_fn (at a module's top level) has taken "dense"; a new Dense in the
    # same functional model must not be named "dense" again (Keras: 'The name "dense" is used 2 times').
    if not keras_3():
        pytest.skip("Keras 2 numbers layers per graph: a layer made outside the graph is not called in it")
    K.backend.clear_session()
    made_before = K.layers.Dense(8, activation="tanh")

    def model_fn(x, y):
        inputs = K.Input((6,))
        return xent(y, K.Model(inputs, K.layers.Dense(4)(made_before(inputs)))(x))

    recorder, loss = recorded(model_fn)
    assert made_before.name == "dense" and len(recorder.names) == 1
    assert recorder.layer_of_op()[loss.op.name] == 0


def test_keras_name_counters_are_restored_after_nested_recordings_and_errors():
    state = keras_3()
    if not state:
        pytest.skip("Keras 3 only: Keras 2 numbers layers per graph")
    counters, stack = state.get_global_attribute("object_name_uids"), state.get_global_attribute("name_scope_stack")
    made = []

    def failing(x, y):
        made.append(K.layers.Dense(2))
        made[-1](x)
        raise RuntimeError("model_fn failed")

    def nesting(x, y):
        made.append(K.layers.Dense(3))
        with pytest.raises(RuntimeError, match="model_fn failed"):
            recorded(failing)  # a recording on another graph, inside this one, ending in an error
        own = scopes._KERAS_NAMES[tf.compat.v1.get_default_graph()]
        assert state.get_global_attribute("object_name_uids") is own  # this graph's counters again
        made.append(K.layers.Dense(4))
        return xent(y, made[-1](made[0](x)))

    assert len(recorded(nesting)[0].names) == 2
    now = state.get_global_attribute("object_name_uids")
    assert now is counters or counters is None
    assert state.get_global_attribute("name_scope_stack") is stack
    assert K.layers.Dense(1).name not in {layer.name for layer in made}  # the process's counters went past them


def test_a_scope_of_variables_only_joins_the_scope_computing_with_them():
    def model_fn(x, y):
        with tf.compat.v1.variable_scope("params"):  # variables only: no layer of its own
            w = tf.compat.v1.get_variable("w", [6, 4])
        with tf.compat.v1.variable_scope("encoder"):
            h = tf.matmul(x, w) + tf.compat.v1.get_variable("b", [4])
        with tf.name_scope("loss"):  # the loss's own scope: joins the last layer
            return xent(y, h)

    recorder, loss = recorded(model_fn)
    assert recorder.names == ["encoder"]
    layer_of = recorder.layer_of_op()
    assert layer_of["params/w"] == layer_of["encoder/MatMul"] == layer_of[loss.op.name] == 0


def test_a_last_layer_with_weights_stays_a_layer():
    def model_fn(x, y):
        with tf.compat.v1.variable_scope("encoder"):
            h = tf.matmul(x, tf.compat.v1.get_variable("w", [6, 4]))
        with tf.compat.v1.variable_scope("loss"):  # weights of its own: a layer
            return xent(y, h * tf.compat.v1.get_variable("scale", []))

    assert recorded(model_fn)[0].names == ["encoder", "loss"]


def test_profile_of_a_keras_model_lists_each_layer_once():
    rng = np.random.RandomState(0)
    values = rng.randn(4, 6).astype(np.float32), rng.randint(0, 4, 4).astype(np.int32)
    profile = profiler.profile_model(
        bare_layers, lambda: (tf.compat.v1.placeholder(tf.float32, [4, 6]), tf.compat.v1.placeholder(tf.int32, [4])),
        values, 4, layers=dapple_tf.layers_by_scope(depth=1), warmup=0, runs=1)
    assert [layer.name for layer in profile.layers] == ["d0", "ln", "d1"]
    assert [layer.parameter_bytes for layer in profile.layers] == [4 * (6 * 8 + 8), 4 * 16, 4 * (8 * 4 + 4)]


def test_a_variables_scope_names_its_layer_only_when_one_keras_layer_opened_both():
    # Found from the recorded scopes, not from names: "d0_1" reads the variables of "d0" but is no Keras
    # layer's scope entered again, so the layer is the computing scope's.
    def model_fn(x, y):
        with tf.compat.v1.variable_scope("d0"):
            w = tf.compat.v1.get_variable("w", [6, 4])
        with tf.name_scope("d0_1"):
            return xent(y, tf.matmul(x, w))

    assert recorded(model_fn)[0].names == ["d0_1"]


def test_a_computing_scope_is_placed_with_the_variables_it_reads():
    # While ops are created (placement), a computing scope reading a variables-only scope's variables takes its
    # layer index, decided from the graph: the op's inputs.
    def model_fn(x, y):
        with tf.compat.v1.variable_scope("params"):
            w = tf.compat.v1.get_variable("w", [6, 4])
        with tf.compat.v1.variable_scope("encoder"):
            h = tf.matmul(x, w) + tf.compat.v1.get_variable("b", [4])
        with tf.compat.v1.variable_scope("head"):
            return xent(y, tf.matmul(h, tf.compat.v1.get_variable("w", [4, 4])))

    recorder, asked = placed(model_fn)
    assert recorder.names == ["encoder", "head"]
    assert sorted(set(asked)) == [("encoder", 0), ("head", 1), ("params", 0)]


def test_keras_layers_are_placed_by_their_final_names():
    # Keras 3 builds "d0" and calls it in "d0_1": both are asked for as layer 0 named "d0".
    recorder, asked = placed(bare_layers)
    assert recorder.names == ["d0", "ln", "d1"]
    assert sorted(set(asked)) == [("SparseSoftmaxCrossEntropyWithLogits", 3), ("d0", 0), ("d1", 2), ("ln", 1)]


def test_keras_dropout_is_its_own_layer_with_its_seed_variable():
    def model_fn(x, y):
        h = K.layers.Dense(8, name="d0")(x)
        return xent(y, K.layers.Dense(4, name="d1")(K.layers.Dropout(0.5, name="drop")(h, training=True)))

    recorder, _ = recorded(model_fn)
    assert len(recorder.names) == 3 and recorder.names[0] == "d0" and recorder.names[2] == "d1"
    assert recorder.names[1].startswith("drop")  # Keras 3: "drop_1", its seed_generator variable with it


def test_keras_weights_are_placed_with_their_layers_stage():
    # Placement is decided while ops are created: Keras 3's call scope "d0_1" counts as the layer of "d0".
    x = np.random.RandomState(0).randn(8, 6).astype(np.float32)
    y = np.random.RandomState(1).randint(0, 4, 8).astype(np.int32)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)])], num_micro_batches=2)
    with tf.Graph().as_default():
        handle = dapple_tf.build_pipeline(bare_layers, tf.constant(x), tf.constant(y),
                                          tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                          layers=dapple_tf.layers_by_scope(depth=1))
    devices = {v.op.name: v.device for _, v in handle.grads_and_vars}
    assert devices == {"d0/kernel": cpu(0), "d0/bias": cpu(0), "ln/gamma": cpu(0), "ln/beta": cpu(0),
                       "d1/kernel": cpu(2), "d1/bias": cpu(2)}
