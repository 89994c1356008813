"""dapple_tf.frontends.estimator: a tf.estimator.Estimator trains pipelined like single-device (TF 2.15 only)."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from tests import user_model
from tests.pipeline_harness import SESSION_CONFIG, cpu

pytestmark = pytest.mark.primary_only
tf_estimator = pytest.importorskip("tensorflow_estimator").estimator
dapple_estimator = pytest.importorskip("dapple_tf.frontends.estimator")

BATCH = 8
PLAN = dapple_tf.Plan.from_stages([("encode", "encode", [cpu(0), cpu(1)]), ("decode", "decode", [cpu(2)])],
                                  num_micro_batches=2)
# One batch, repeated: a resumed Estimator restarts its input_fn, so every step must see the same data.
DATA_X = np.random.RandomState(0).normal(size=(BATCH, 6)).astype(np.float32)
DATA_Y = (DATA_X.sum(axis=1) * 0.5).astype(np.float32)


def _optimizer():
    return tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)


def _input_fn(drop_remainder=True):
    def input_fn():
        dataset = tf.data.Dataset.from_tensor_slices((DATA_X, DATA_Y))
        return dataset.batch(BATCH, drop_remainder=drop_remainder).repeat()
    return input_fn


def _single_device_model_fn(features, labels, mode):
    loss = user_model.model_fn(features, labels)
    if mode != tf_estimator.ModeKeys.TRAIN:
        return tf_estimator.EstimatorSpec(mode, loss=loss)
    train_op = _optimizer().minimize(loss, global_step=tf.compat.v1.train.get_global_step())
    return tf_estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _estimator(model_dir, pipelined, optimizer_fn=_optimizer):
    model_fn = dapple_estimator.model_fn(user_model.model_fn, optimizer_fn, PLAN) if pipelined \
        else _single_device_model_fn
    config = tf_estimator.RunConfig(model_dir=str(model_dir), tf_random_seed=5, session_config=SESSION_CONFIG,
                                    save_checkpoints_steps=2, log_step_count_steps=None)
    return tf_estimator.Estimator(model_fn=model_fn, config=config)


def _weights(model_dir):
    reader = tf.train.load_checkpoint(str(model_dir))
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()}


def _assert_same(actual, expected):
    assert sorted(actual) == sorted(expected)  # the same variables (momentum slots, global_step): no copies
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_pipelined_estimator_trains_evaluates_and_warm_starts_like_single_device(tmp_path):
    _estimator(tmp_path / "single", pipelined=False).train(_input_fn(), max_steps=4)
    _estimator(tmp_path / "pipelined", pipelined=True).train(_input_fn(), max_steps=4)
    expected = _weights(tmp_path / "single")
    assert expected["global_step"] == 4
    _assert_same(_weights(tmp_path / "pipelined"), expected)

    # Single-device checkpoint -> pipelined training (copies broadcast after the restore) and back.
    _estimator(tmp_path / "a", pipelined=False).train(_input_fn(), max_steps=2)
    _estimator(tmp_path / "a", pipelined=True).train(_input_fn(), max_steps=4)
    _assert_same(_weights(tmp_path / "a"), expected)
    _estimator(tmp_path / "b", pipelined=True).train(_input_fn(), max_steps=2)
    _estimator(tmp_path / "b", pipelined=False).train(_input_fn(), max_steps=4)
    _assert_same(_weights(tmp_path / "b"), expected)

    # evaluate: the pipelined Estimator's EVAL graph is the single-device model on the same weights.
    metrics = _estimator(tmp_path / "pipelined", pipelined=True).evaluate(_input_fn(), steps=4)
    reference = _estimator(tmp_path / "pipelined", pipelined=False).evaluate(_input_fn(), steps=4)
    assert metrics["global_step"] == 4
    assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-6)


def test_keras_optimizer_is_a_clear_error_before_training(tmp_path):
    estimator = _estimator(tmp_path, pipelined=True, optimizer_fn=lambda: tf.keras.optimizers.SGD(0.1))
    with pytest.raises(dapple_tf.DappleError, match="optimizer_fn must return a tf.compat.v1.train.Optimizer"):
        estimator.train(_input_fn(), max_steps=1)
    assert not tf.io.gfile.glob(str(tmp_path / "model.ckpt-*"))


def test_unknown_batch_size_is_a_clear_error(tmp_path):
    with pytest.raises(dapple_tf.DappleError, match="drop_remainder=True"):
        _estimator(tmp_path, pipelined=True).train(_input_fn(drop_remainder=False), max_steps=1)


def test_missing_devices_name_the_fix(tmp_path):
    plan = dapple_tf.Plan.from_stages([("encode", "encode", [cpu(0)]), ("decode", "decode", [cpu(63)])],
                                      num_micro_batches=2)
    estimator = tf_estimator.Estimator(dapple_estimator.model_fn(user_model.model_fn, _optimizer, plan),
                                       config=tf_estimator.RunConfig(model_dir=str(tmp_path)))
    with pytest.raises(dapple_tf.PlanError, match="set_logical_device_configuration"):
        estimator.train(_input_fn(), max_steps=1)


def _model_with_summaries(features, labels):
    loss = user_model.model_fn(features, labels)
    tf.compat.v1.summary.scalar("input_mean", tf.reduce_mean(features))  # reads the inputs: of the global batch
    tf.compat.v1.summary.scalar("decode_norm", tf.norm(tf.compat.v1.get_variable("decode_w")))
    return loss


def test_train_and_evaluate_with_hooks_and_summaries(tmp_path):
    model_fn = dapple_estimator.model_fn(_model_with_summaries_reusing, _optimizer, PLAN)
    config = tf_estimator.RunConfig(model_dir=str(tmp_path), session_config=SESSION_CONFIG, save_summary_steps=1,
                                    save_checkpoints_steps=3)
    estimator = tf_estimator.Estimator(model_fn=model_fn, config=config)
    logged = []
    hooks = [tf.compat.v1.train.StopAtStepHook(num_steps=3),
             tf.compat.v1.train.LoggingTensorHook({"loss": "dapple_loss:0"}, every_n_iter=1,
                                                  formatter=lambda values: logged.append(values["loss"]) or "")]
    tf_estimator.train_and_evaluate(estimator, tf_estimator.TrainSpec(_input_fn(), max_steps=10, hooks=hooks),
                                    tf_estimator.EvalSpec(_input_fn(), steps=2, throttle_secs=0))
    assert len(logged) == 3 and np.all(np.isfinite(logged)) and logged[-1] < logged[0]  # one line per step
    assert estimator.get_variable_value("global_step") == 3  # StopAtStepHook stopped it before max_steps
    tags = set()
    for path in tf.io.gfile.glob(str(tmp_path / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags |= {v.tag for v in event.summary.value}
    assert {"loss", "decode_norm", "input_mean"} <= tags
    assert tf.io.gfile.glob(str(tmp_path / "eval" / "events.out.tfevents.*"))

    predicting = tf_estimator.Estimator(dapple_estimator.model_fn(user_model.model_fn, _optimizer, PLAN,
                                                                  predict_fn=_predict), config=config)
    predictions = np.array(list(predicting.predict(lambda: tf.data.Dataset.from_tensor_slices(DATA_X).batch(3))))
    weights = _weights(tmp_path)
    expected = np.maximum(DATA_X @ weights["encode_w"], 0) @ weights["decode_w"]
    np.testing.assert_allclose(predictions, expected[:, 0], rtol=1e-5, atol=1e-6)  # single-device graph, any batch


def _predict(features):
    with dapple_tf.layer("encode"):
        h = tf.nn.relu(tf.matmul(features, tf.compat.v1.get_variable("encode_w", [6, 16])))
    with dapple_tf.layer("decode"):
        return tf.matmul(h, tf.compat.v1.get_variable("decode_w", [16, 1]))[:, 0]


def _model_with_summaries_reusing(features, labels):
    with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=tf.compat.v1.AUTO_REUSE):
        return _model_with_summaries(features, labels)


def _model_with_a_table(features, labels):
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer([0, 1], [0.5, 2.0]), default_value=1.0)
    with dapple_tf.layer("encode"):
        h = tf.nn.relu(tf.matmul(features, tf.compat.v1.get_variable("encode_w", [6, 16])))
    with dapple_tf.layer("decode"):
        prediction = tf.matmul(h, tf.compat.v1.get_variable("decode_w", [16, 1]))[:, 0] * table.lookup(tf.constant(1))
        return tf.reduce_mean(tf.square(prediction - labels))


def test_lookup_tables_are_initialized_in_pipelined_training(tmp_path):
    model_fn = dapple_estimator.model_fn(_model_with_a_table, _optimizer, PLAN)
    config = tf_estimator.RunConfig(model_dir=str(tmp_path), session_config=SESSION_CONFIG)
    tf_estimator.Estimator(model_fn=model_fn, config=config).train(_input_fn(), max_steps=1)  # no "Table not initialized"
    assert tf.train.load_checkpoint(str(tmp_path)).get_tensor("global_step") == 1


def _model_with_moving_mean(features, labels):
    with dapple_tf.layer("encode"):
        mean = tf.reduce_mean(features, axis=0)  # batch-norm style: normalize by the batch statistic
        moving = tf.compat.v1.get_variable("moving_mean", initializer=tf.zeros([6]), trainable=False)
        update = moving.assign_sub((moving - mean) * 0.1)
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
        h = tf.nn.relu(tf.matmul(features - mean, tf.compat.v1.get_variable("encode_w", [6, 16])))
    with dapple_tf.layer("decode"):
        return tf.reduce_mean(tf.square(tf.matmul(h, tf.compat.v1.get_variable("decode_w", [16, 1]))[:, 0] - labels))


def test_update_ops_run_once_per_step(tmp_path):
    model_fn = dapple_estimator.model_fn(_model_with_moving_mean, _optimizer, PLAN)
    config = tf_estimator.RunConfig(model_dir=str(tmp_path), session_config=SESSION_CONFIG)
    tf_estimator.Estimator(model_fn=model_fn, config=config).train(_input_fn(), max_steps=2)
    expected = np.zeros(6, np.float32)
    for _ in range(2):  # the mean over the 4 equal slices of their means is the batch mean
        expected -= (expected - DATA_X.mean(axis=0)) * 0.1
    np.testing.assert_allclose(tf.train.load_checkpoint(str(tmp_path)).get_tensor("moving_mean"), expected, rtol=1e-5)
