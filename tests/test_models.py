"""Reference models: each builds, trains one step and profiles at its tiny config; the paper configs
have the paper's parameter counts; the registry rejects bad names and flags."""

import numpy as np
import pytest
import tensorflow as tf

import models
import profiler
from dapple_tf import LayerRecorder
from profiler.analysis import analyze_layers

TINY_LAYERS = {"mlp": 3, "vgg19": 19, "resnet50": 6, "bert": 4, "gnmt": 7}


def _build(spec, batch_size):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        features, labels = spec.placeholders(batch_size)
        first = len(graph.get_operations())
        recorder = LayerRecorder(graph)
        with recorder.activate():
            loss = spec.model_fn(features, labels)
        model_ops = graph.get_operations()[first:]
    return graph, features, labels, loss, recorder, model_ops


def _trainable_bytes(graph):
    return sum(v.shape.num_elements() * v.dtype.size for v in graph.get_collection("trainable_variables"))


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_tiny_model_builds_trains_and_profiles(name):
    spec = models.get_model(name, "tiny")
    graph, features, labels, loss, recorder, model_ops = _build(spec, 4)
    assert len(recorder.layers) == TINY_LAYERS[name]
    with graph.as_default():
        # the marker contract holds: loss in the last layer, no computation outside the markers
        infos = analyze_layers(recorder, loss, model_ops, tf.nest.flatten((features, labels)))
        owned = [v.name for info in infos for v in info.variables]
        assert sorted(owned) == sorted(v.name for v in tf.compat.v1.trainable_variables())  # each var has one layer
        train = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
        feed = spec.feed_dict((features, labels), spec.synthetic_batch(4))
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            before = sess.run(loss, feed)
            sess.run(train, feed)
            after = sess.run(loss, feed)
    assert np.isfinite(before) and np.isfinite(after)
    assert after < before  # one step on the same batch lowers its loss

    profile = profiler.profile_spec(spec, 4, warmup=0, runs=1)
    assert [layer.name for layer in profile.layers] == recorder.names
    assert sum(layer.parameter_bytes for layer in profile.layers) == _trainable_bytes(graph)
    assert profile.layers[-1].activation_bytes == 4.0  # the scalar float32 loss
    assert all(layer.activation_bytes > 0 for layer in profile.layers)


@pytest.mark.parametrize("name,layers,expected,tolerance", [
    ("vgg19", 19, 143_667_240, 0.0),      # torchvision/Keras VGG-19: 143,667,240
    ("resnet50", 18, 25_557_032, 0.0),    # torchvision ResNet-50: 25,557,032
    ("bert", 50, 640e6, 0.05),            # DAPPLE's BERT-48: ~640M
])
def test_paper_configs_have_the_papers_parameter_counts(name, layers, expected, tolerance):
    spec = models.get_model(name, "paper")
    graph, _, _, _, recorder, _ = _build(spec, 1)
    params = _trainable_bytes(graph) // 4
    assert len(recorder.layers) == layers
    assert abs(params - expected) <= tolerance * expected, params


def test_bert_paper_encoder_layer_matches_the_shipped_profile():
    # bert-48-pbs-2.txt: every encoder layer has 50,384,896 parameter bytes (BERT-Large width)
    spec = models.get_model("bert", "paper", num_layers=1)
    graph, _, _, _, _, _ = _build(spec, 1)
    encoder = [v for v in graph.get_collection("trainable_variables") if v.name.startswith("encoder_0/")]
    assert sum(v.shape.num_elements() * 4 for v in encoder) == 50_384_896


@pytest.mark.slow
def test_gnmt_paper_config_builds():
    spec = models.get_model("gnmt", "paper", seq_len=4)
    graph, _, _, _, recorder, _ = _build(spec, 1)
    assert len(recorder.layers) == 19  # 2 embeddings + 8 + 8 LSTM layers + softmax
    assert _trainable_bytes(graph) // 4 == 308_382_976


def test_model_flags_override_the_config():
    spec = models.get_model("mlp", "tiny", **models.parse_model_flags("hidden=8:4:2, num_classes=3"))
    assert spec.config["hidden"] == [8, 4, 2] and spec.config["num_classes"] == 3
    graph, *_ , recorder, _ = _build(spec, 2)
    assert recorder.names == ["dense_0", "dense_1", "dense_2", "head"]
    shapes = {v.name: v.shape.as_list() for v in graph.get_collection("trainable_variables")}
    assert shapes["dense_2/fc_kernel:0"] == [4, 2] and shapes["head/logits_kernel:0"] == [2, 3]


@pytest.mark.parametrize("call,message", [
    (lambda: models.get_model("alexnet"), "unknown model 'alexnet'"),
    (lambda: models.get_model("mlp", "huge"), "unknown config 'huge'"),
    (lambda: models.get_model("mlp", depth=3), "unknown model flag 'depth'"),
    (lambda: models.get_model("mlp", input_dim="many"), "input_dim"),
    (lambda: models.parse_model_flags("hidden"), "not key=value"),
    (lambda: models.get_model("gnmt", num_layers=3), "even"),
])
def test_registry_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_synthetic_batch_matches_the_placeholders():
    spec = models.get_model("bert", "tiny")
    with tf.Graph().as_default():
        features, labels = spec.placeholders(5)
        values = spec.synthetic_batch(5, seed=1)
        for ph, value in spec.feed_dict((features, labels), values).items():
            assert list(value.shape) == ph.shape.as_list() and value.dtype == ph.dtype.as_numpy_dtype
    assert values[0]["input_ids"].max() < spec.config["vocab_size"]
