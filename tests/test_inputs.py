"""The input_fn contract (dapple_tf/model/inputs.py): input_fn(step, batch_size) -> (features, labels) as numpy
arrays or tensors, for dapple_profile, dapple_train, Trainer and tf.estimator; older one-argument forms."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.model import inputs
from dapple_tf.errors import DappleError
from tests import toy_models
from tests.pipeline_harness import cpu


def numpy_input_fn(step, batch_size):
    rng = np.random.RandomState(step)  # fails on a symbolic step: numpy needs a Python int
    return rng.randn(batch_size, toy_models.IN).astype(np.float32), rng.randint(0, 3, batch_size).astype(np.int32)


def tensor_input_fn(step, batch_size):
    x = tf.random.stateless_normal([batch_size, 2], tf.stack([tf.constant(1, tf.int64), tf.cast(step, tf.int64)]))
    return {"x": x}, tf.cast(step, tf.float32) + tf.zeros([batch_size])


def run(batch, step_value):
    step = tf.compat.v1.placeholder(tf.int64, [])
    with tf.compat.v1.Session() as sess:
        return sess.run(batch(step), {step: step_value})


@pytest.mark.parametrize("input_fn", [numpy_input_fn, tensor_input_fn], ids=["numpy", "tensors"])
def test_each_step_gets_its_own_batch(input_fn):
    with tf.Graph().as_default():
        step = tf.compat.v1.placeholder(tf.int64, [])
        features, labels = inputs.batch_tensors(input_fn, step, 4)
        assert tf.nest.flatten(features)[0].shape[0] == 4  # a known global batch: the Trainer needs it
        with tf.compat.v1.Session() as sess:
            got = [sess.run((features, labels), {step: s}) for s in (3, 5)]
    for s, (features, labels) in zip((3, 5), got):
        want = inputs.batch_values(input_fn, s, 4)
        tf.nest.map_structure(np.testing.assert_array_equal, (features, labels), want)
    assert not np.array_equal(tf.nest.flatten(got[0])[0], tf.nest.flatten(got[1])[0])


def test_older_one_argument_forms():
    def by_batch_size(batch_size):  # dapple_profile's input_fn(batch_size)
        return np.zeros([batch_size, 2], np.float32), np.zeros([batch_size], np.int32)

    features, _ = inputs.batch_values(by_batch_size, 0, 5, legacy="batch_size")
    assert features.shape == (5, 2)
    with tf.Graph().as_default():  # the Trainer's input_fn(step)
        features, labels = inputs.batch_tensors(lambda step: tensor_input_fn(step, 3), tf.constant(7, tf.int64), None,
                                                legacy="step")
        with tf.compat.v1.Session() as sess:
            assert list(sess.run(labels)) == [7.0] * 3


def test_a_default_batch_size_is_still_the_contracts_second_argument():
    """input_fn(step, batch_size=32) takes the caller's batch size, in dapple_profile's and the Trainer's places;
    input_fn(batch_size, seed=0) is the older one-argument form."""
    def with_default(step, batch_size=32):
        return np.full([batch_size, 2], step, np.float32), np.zeros([batch_size], np.int32)

    def by_batch_size(batch_size, seed=0):
        return np.full([batch_size, 2], seed, np.float32), np.zeros([batch_size], np.int32)

    assert inputs.batch_values(with_default, 3, 16, legacy="batch_size")[0].shape == (16, 2)
    assert inputs.batch_values(with_default, 3, 16, legacy="step")[0][0, 0] == 3
    assert inputs.batch_values(by_batch_size, 0, 16, legacy="batch_size")[0].shape == (16, 2)


def test_a_batch_of_another_size_is_an_error():
    def fixed(step, batch_size):
        return np.zeros([8, 2], np.float32), np.zeros([8], np.int32)

    with pytest.raises(DappleError, match=r"leaf 0 for step 0 leads with 8 samples, but the batch size is 16\. "
                                          r"Contract: input_fn\(step, batch_size\)"):
        inputs.batch_values(fixed, 0, 16)
    with tf.Graph().as_default(), pytest.raises(DappleError, match=r"leads with 8 samples, but the batch size is 4"):
        inputs.batch_tensors(lambda step, batch_size: (tf.zeros([8, 2]), tf.zeros([8])), tf.constant(0, tf.int64), 4)


def test_errors_name_the_contract():
    def half_numpy(step, batch_size):  # tensors for an int step, numpy on the step: breaks on the tensor
        return tf.constant(np.random.RandomState(step).randn(batch_size, 2)), tf.zeros([batch_size])

    with tf.Graph().as_default():
        with pytest.raises(DappleError, match=r"returned tensors for step 0 \(a Python int\) but failed on the "
                                              r"step tensor .*or return numpy arrays.*Contract: "
                                              r"input_fn\(step, batch_size\)"):
            inputs.batch_tensors(half_numpy, tf.constant(1, tf.int64), 2)
        with pytest.raises(DappleError, match=r"returned ndarray; expected input_fn\(step, batch_size\) -> "
                                              r"\(features, labels\)"):
            inputs.batch_tensors(lambda step, batch_size: np.zeros([batch_size]), tf.constant(1, tf.int64), 2)
        with pytest.raises(DappleError, match=r"takes \(step, batch_size\) but no global batch size is known"):
            inputs.batch_tensors(numpy_input_fn, tf.constant(1, tf.int64), None, legacy="step")

        def growing(step, batch_size):
            return np.zeros([batch_size + step, 2], np.float32), np.zeros([batch_size + step], np.int32)

        features, _ = inputs.batch_tensors(growing, tf.constant(1, tf.int64), 2)
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.InvalidArgumentError,
                                                           match=r"leaf 0 for step 1 is float32 \(3, 2\), for step 0 "
                                                                 r"float32 \(2, 2\)"):
            sess.run(features)


def test_estimator_input_fn_reads_the_global_step():
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        features, labels = inputs.estimator_input_fn(tensor_input_fn, 2)()
        with tf.compat.v1.Session() as sess:
            sess.run(step.initializer)
            sess.run(step.assign(4))
            assert list(sess.run(labels)) == [4.0, 4.0]


def test_trainer_with_a_numpy_input_fn_trains_like_single_device(tmp_path):
    """Three steps on numpy batches of their own, a 2-stage pipeline, equal to single-device SGD."""
    values = toy_models.initial_values()
    model_fn = toy_models.skip_model_fn(values)
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    with tf.Graph().as_default():
        x, y = tf.compat.v1.placeholder(tf.float32, [8, toy_models.IN]), tf.compat.v1.placeholder(tf.int32, [8])
        with dapple_tf.LayerRecorder(tf.compat.v1.get_default_graph()).activate():
            loss = model_fn(x, y)
        train_op = sgd().minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(3):
                sess.run(train_op, dict(zip((x, y), numpy_input_fn(step, 8))))
            want = {v.op.name: sess.run(v) for v in tf.compat.v1.trainable_variables()}
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2)])], num_micro_batches=2)
    options = dapple_tf.TrainerOptions(log_every=0, summary_every=0, save_checkpoints_steps=3)
    result = dapple_tf.Trainer(model_fn, numpy_input_fn, sgd, plan, str(tmp_path), batch_size=8,
                               options=options, log=lambda text: None).train(3)
    assert result.step == 3
    reader = tf.train.load_checkpoint(str(tmp_path))
    for name, value in want.items():
        np.testing.assert_allclose(reader.get_tensor(name), value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.primary_only
def test_estimator_trains_from_the_same_input_fn(tmp_path):
    """A pipelined Estimator fed a numpy input_fn(step, batch_size) equals the single-device one fed tf.data."""
    from tests import test_estimator as est  # pylint: disable=import-outside-toplevel  (TF 2.15: estimator)

    def numpy_batches(step, batch_size):
        assert batch_size == est.BATCH
        return est.DATA_X, est.DATA_Y

    est._estimator(tmp_path / "single", pipelined=False).train(est._input_fn(), max_steps=3)
    est._estimator(tmp_path / "pipelined", pipelined=True).train(
        inputs.estimator_input_fn(numpy_batches, est.BATCH), max_steps=3)
    est._assert_same(est._weights(tmp_path / "pipelined"), est._weights(tmp_path / "single"))


def test_a_function_of_the_step_tensor_still_works():
    def uses_tensor_methods(step):  # the Trainer's older input_fn(step), written for the step tensor only
        value = tf.cast(step, tf.float32) if step.dtype.is_integer else step  # an int has no .dtype
        return tf.fill([2, 1], value), tf.zeros([2], tf.int32)

    with tf.Graph().as_default():
        features, _ = inputs.batch_tensors(uses_tensor_methods, tf.constant(5, tf.int64), None, legacy="step")
        with tf.compat.v1.Session() as sess:
            assert sess.run(features).tolist() == [[5.0], [5.0]]


def test_dapple_profile_takes_the_same_input_fn():
    from dapple_tf.model import user_model  # pylint: disable=import-outside-toplevel

    features, labels = user_model.input_values(5, numpy_input_fn)  # input_fn(step, batch_size), step 0
    np.testing.assert_array_equal(features, numpy_input_fn(0, 5)[0])
    features, _ = user_model.input_values(5, lambda batch_size: numpy_input_fn(9, batch_size))  # the older form
    assert features.shape == (5, toy_models.IN)
    features, labels = user_model.input_values(3, tensor_input_fn)  # tensors: evaluated
    assert features["x"].shape == (3, 2) and list(labels) == [0.0] * 3


def test_labels_may_be_none():
    def features_only(step, batch_size):
        return {"a": np.full([batch_size, 1], step, np.float32)}, None

    with tf.Graph().as_default():
        features, labels = inputs.batch_tensors(features_only, tf.constant(2, tf.int64), 3)
        assert labels is None
        with tf.compat.v1.Session() as sess:
            assert sess.run(features)["a"].tolist() == [[2.0]] * 3
    assert inputs.batch_values(lambda step, n: (tf.ones([n]), None), 0, 2)[1] is None
