"""model_fn's extra outputs (`(loss, {name: tensor})`): combined over micro-batches and replicas, they
equal the single-device model's values on the same weights; outputs that cannot be combined are refused."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf import DappleError
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, cpu

VALUES = toy_models.initial_values()


def metrics_model_fn(features, labels):
    loss = toy_models.skip_model_fn(VALUES)(features, labels)
    graph = tf.compat.v1.get_default_graph()
    logits = [op for op in graph.get_operations() if op.type == "MatMul"][-1].outputs[0]
    predictions = tf.argmax(logits, axis=1, output_type=tf.int32)  # outside every layer
    correct = tf.cast(tf.equal(predictions, labels), tf.float32)
    wo = [v for v in tf.compat.v1.global_variables() if v.op.name == "wo"][0]
    return loss, {
        "logits": logits,
        "predictions": predictions,
        "accuracy": tf.reduce_mean(correct),
        "hidden0_mean": tf.reduce_mean(graph.get_tensor_by_name("dense0/Tanh:0")),  # a mean in stage 0
        "wo_norm": tf.norm(wo),
        "labels": labels,
    }


def single_values(x, y):
    with tf.Graph().as_default():
        loss, outputs = metrics_model_fn(tf.constant(x), tf.constant(y))
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return sess.run((loss, outputs))


@pytest.mark.parametrize(
    "stages, n",
    [
        ([(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2)])], 8),
        ([(0, 1, [cpu(0)]), (2, 4, [cpu(1), cpu(2)])], 6),  # uneven slices (2 and 1) in the last stage
    ],
    ids=["2:1", "1:2 uneven"],
)
@pytest.mark.parametrize("stage_functions", [False, True], ids=["clones", "functions"])
def test_extra_outputs_equal_single_device(stages, n, stage_functions):
    x, y = toy_models.batch(n)
    want_loss, want = single_values(x, y)
    with tf.Graph().as_default():
        plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
        handle = dapple_tf.build_pipeline(metrics_model_fn, tf.constant(x), tf.constant(y),
                                          tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                          dapple_tf.PipelineOptions(stage_functions=stage_functions))
        assert not stage_functions or handle.function_fallbacks == {}
        assert sorted(handle.outputs) == sorted(want)
        assert handle.outputs["logits"].shape.as_list() == [n, toy_models.CLASSES]
        summary = tf.compat.v1.summary.scalar("accuracy", handle.outputs["accuracy"])
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            loss, got, summary_bytes = sess.run((handle.loss, handle.outputs, summary))
            after_step = sess.run((handle.outputs, handle.train_op))[0]  # fetched with train_op: same forward
    summary_value = tf.compat.v1.Summary.FromString(summary_bytes).value[0]
    assert summary_value.tag == "accuracy"
    np.testing.assert_allclose(summary_value.simple_value, want["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(after_step[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(got["predictions"], np.argmax(want["logits"], axis=1))
    assert 0.0 <= got["accuracy"] <= 1.0


def build_with(model_fn):
    x, y = toy_models.batch(8)
    with tf.Graph().as_default():
        plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], num_micro_batches=2)
        return dapple_tf.build_pipeline(
            model_fn, tf.constant(x), tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan
        )


def returning(make_result):
    def model_fn(features, labels):
        loss = toy_models.skip_model_fn(VALUES)(features, labels)
        logits = tf.compat.v1.get_default_graph().get_tensor_by_name("head/MatMul:0")
        return make_result(loss, logits)

    return model_fn


def test_loss_and_bare_tensor_is_refused_with_the_fix():
    with pytest.raises(DappleError, match=r'returned a tuple of \(Tensor, Tensor\).*\(loss, \{"logits": logits\}\)'):
        build_with(returning(lambda loss, logits: (loss, logits)))


def test_batch_statistic_that_is_not_a_scalar_mean_is_refused():
    with pytest.raises(DappleError, match=r"extra output 'class_means' .* has shape \(3,\).*leading dimension"):
        build_with(returning(lambda loss, logits: (loss, {"class_means": tf.reduce_mean(logits, axis=0)})))


def test_integer_scalar_is_refused():
    with pytest.raises(DappleError, match=r"extra output 'count' .* int32 scalar .* floating-point mean"):
        build_with(returning(lambda loss, logits: (loss, {"count": tf.reduce_sum(tf.argmax(logits, 1, tf.int32))})))
