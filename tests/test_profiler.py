"""The layer profiler: exact sizes, the layer DAG, timing against a real training step, errors."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
import models
import profiler
from dapple_tf.errors import LayerMarkerError
from profiler.analysis import analyze_layers
from profiler.core import session_config
from profiler.timing import median_run_ms


def _profile(spec, batch_size, **kwargs):
    kwargs.setdefault("warmup", 0)
    kwargs.setdefault("runs", 1)
    return profiler.profile_spec(spec, batch_size, **kwargs)


def test_mlp_sizes_are_exact():
    spec = models.get_model("mlp", "tiny", input_dim=10, hidden="7:5", num_classes=3)
    profile = _profile(spec, 6)
    assert profile.batch_size == 6 and profile.device.name == "/device:CPU:0" and profile.device.kind == "CPU"
    by_name = {layer.name: layer for layer in profile.layers}
    assert [layer.name for layer in profile.layers] == ["dense_0", "dense_1", "head"]
    assert by_name["dense_0"].activation_bytes == 6 * 7 * 4
    assert by_name["dense_1"].activation_bytes == 6 * 5 * 4
    assert by_name["head"].activation_bytes == 4  # the loss
    assert by_name["dense_0"].parameter_bytes == (10 * 7 + 7) * 4
    assert by_name["dense_1"].parameter_bytes == (7 * 5 + 5) * 4
    assert by_name["head"].parameter_bytes == (5 * 3 + 3) * 4
    assert [list(layer.inputs) for layer in profile.layers] == [[], ["dense_0"], ["dense_1"]]
    assert [layer.index for layer in profile.layers] == [0, 1, 2]


def test_branching_dag_and_per_output_bytes():
    spec = models.get_model("bert", "tiny")
    batch, seq, hidden = 3, spec.config["seq_len"], spec.config["hidden"]
    profile = _profile(spec, batch)
    emb, enc0, enc1, head = profile.layers
    # embeddings emits the hidden states and the attention-mask bias [batch, 1, 1, seq]
    assert list(emb.output_activation_bytes) == [batch * seq * hidden * 4, batch * seq * 4]
    assert emb.activation_bytes == batch * seq * hidden * 4 + batch * seq * 4
    assert enc0.activation_bytes == enc1.activation_bytes == batch * seq * hidden * 4
    assert list(enc1.inputs) == ["embeddings", "encoder_0"]  # the mask bias skips a layer
    assert list(head.inputs) == ["encoder_1"]
    # parameter bytes equal the variables' sizes, per layer
    with tf.Graph().as_default() as graph:
        features, labels = spec.placeholders(batch)
        spec.model_fn(features, labels)
        for layer in profile.layers:
            own = [v for v in graph.get_collection("trainable_variables") if v.name.startswith(layer.name + "/")]
            assert layer.parameter_bytes == sum(int(np.prod(v.shape.as_list())) * 4 for v in own)
    # GNMT's DAG, from the graph analysis alone (profiling it is covered by test_models/test_profiler_io)
    spec = models.get_model("gnmt", "tiny")
    with tf.Graph().as_default() as graph:
        features, labels = spec.placeholders(2)
        recorder = dapple_tf.LayerRecorder(graph)
        with recorder.activate():
            loss = spec.model_fn(features, labels)
        infos = analyze_layers(recorder, loss)
    edges = {info.name: [infos[j].name for j in info.input_layers] for info in infos}
    assert edges["decoder_lstm_0"] == ["encoder_lstm_1", "decoder_embedding"]
    assert edges["softmax"] == ["decoder_lstm_0", "decoder_lstm_1"]
    assert [t.name for t in infos[-1].outputs] == [loss.name]
    assert edges["decoder_embedding"] == []


def _train_step_ms(spec, batch_size, values, clock, threads):
    with tf.Graph().as_default():
        features, labels = spec.placeholders(batch_size)
        loss = spec.model_fn(features, labels)
        train = tf.compat.v1.train.GradientDescentOptimizer(1e-3).minimize(loss)
        with tf.compat.v1.Session(config=session_config("/device:CPU:0", threads)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return median_run_ms(sess, train, spec.feed_dict((features, labels), values), 3, 9, clock)


@pytest.mark.parametrize("name,batch,flags", [
    ("mlp", 256, dict(input_dim=256, hidden="512:512:512")),
    ("bert", 32, dict(hidden=128, ffn=512, heads=4, seq_len=64)),
])
def test_layer_times_add_up_to_a_training_step(name, batch, flags):
    """Sum over layers of forward+backward is within 30% of one measured training step.

    Process CPU time and single-threaded sessions keep other processes on this shared machine out of
    the numbers; the comparison is retried (both sides re-measured) up to three times for noise."""
    spec = models.get_model(name, "tiny", **flags)
    values = spec.synthetic_batch(batch)
    ratios = []
    for _ in range(3):
        profile = profiler.profile_spec(spec, batch, warmup=2, runs=4, rounds=3, clock="cpu", threads=1)
        total = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)
        step = _train_step_ms(spec, batch, values, "cpu", 1)
        # the layers' sum, and the whole step (forward, backward, accumulation) the profiler measures too
        ratios.append((total / step, profile.step_ms / step))
        if all(0.7 <= r <= 1.3 for r in ratios[-1]):
            break
    assert all(0.7 <= r <= 1.3 for r in ratios[-1]), f"(profile sum, profile step) / training step = {ratios}"
    for layer in profile.layers[1:-1]:  # the hidden layers take measurable time both ways
        assert layer.forward_ms > 0 and layer.backward_ms > 0, layer
        # their input gradients are part of their backward (a matmul's: about half)
        assert 0 < layer.backward_input_ms <= layer.backward_ms, layer
    assert profile.layers[0].backward_input_ms == 0  # the model's inputs take no gradient


def _marker_model(kind):
    def model_fn(features, labels):
        if kind == "none":
            return tf.reduce_mean(tf.square(features))
        if kind == "loss_outside":
            with dapple_tf.layer("a"):
                y = features * 2.0
            return tf.reduce_mean(y)
        if kind == "unmarked":
            with dapple_tf.layer("a"):
                y = features * 2.0
            z = y + 1.0
            with dapple_tf.layer("b"):
                return tf.reduce_mean(z)
        if kind == "not_last":
            with dapple_tf.layer("a"):
                loss = tf.reduce_mean(features)
            with dapple_tf.layer("b"):
                tf.identity(features)
            return loss
    return model_fn


@pytest.mark.parametrize("kind,message", [
    ("none", "no dapple_tf.layer markers"),
    ("loss_outside", "inside the last layer marker"),
    ("unmarked", "outside every dapple_tf.layer marker"),
    ("not_last", r"last layer marker \('b'\); it is in layer 'a'"),
])
def test_models_breaking_the_marker_contract_are_rejected(kind, message):
    def make_inputs():
        return tf.compat.v1.placeholder(tf.float32, [2, 3]), tf.compat.v1.placeholder(tf.int32, [2])
    values = (np.zeros([2, 3], np.float32), np.zeros([2], np.int32))
    with pytest.raises(LayerMarkerError, match=message):
        profiler.profile_model(_marker_model(kind), make_inputs, values, 2, warmup=0, runs=1)


def test_unavailable_device_is_rejected():
    with pytest.raises(ValueError, match=r"'/device:GPU:7' is not available here; available: /device:CPU:0"):
        _profile(models.get_model("mlp"), 2, device="/device:GPU:7")
