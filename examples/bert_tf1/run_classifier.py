"""Fine-tunes the TF1-style BERT of modeling.py on a synthetic sentence classification task with a
tf.estimator.Estimator, as TF1 BERT fine-tuning scripts do. This file and optimization.py are the
single-device script; docs/user_guide.md ("Porting a training script") shows the lines that pipeline it.

    python examples/bert_tf1/run_classifier.py --model_dir=/tmp/bert_tf1 --train_steps=20
"""

import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import modeling  # noqa: E402
import optimization  # noqa: E402

FLAGS = flags.FLAGS
SEQ_LENGTH = 16
NUM_LABELS = 2
HPARAMS = {"learning_rate": 1e-3, "num_train_steps": 100, "num_warmup_steps": 10, "init_checkpoint": None}


def examples(step, batch_size, seed=0):
    """The global batch of `step`: features input_ids, input_mask, segment_ids; labels: does token 7
    occur in the first segment. A function of the step alone, so a resumed run sees the same batches."""
    rng = np.random.RandomState(seed * 100003 + step)
    lengths = rng.randint(SEQ_LENGTH // 2, SEQ_LENGTH + 1, size=batch_size)
    positions = np.arange(SEQ_LENGTH)[None, :]
    input_mask = (positions < lengths[:, None]).astype(np.int32)
    input_ids = rng.randint(1, modeling.CONFIG["vocab_size"], size=(batch_size, SEQ_LENGTH)).astype(np.int32)
    input_ids *= input_mask
    segment_ids = ((positions >= lengths[:, None] // 2) * input_mask).astype(np.int32)
    labels = ((input_ids == 7) & (segment_ids == 0)).any(axis=1).astype(np.int32)
    return {"input_ids": input_ids, "input_mask": input_mask, "segment_ids": segment_ids}, labels


def input_fn(step, batch_size):
    return examples(step, batch_size)


def train_input_fn(params):
    """The Estimator's input_fn: the batches of steps 0, 1, ... of `examples`."""
    batches = [examples(step, params["batch_size"]) for step in range(params["train_steps"])]
    features = {k: np.concatenate([b[0][k] for b in batches]) for k in batches[0][0]}
    labels = np.concatenate([b[1] for b in batches])
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(params["batch_size"], drop_remainder=True)


def create_model(features, labels, config):
    pooled = modeling.bert(features["input_ids"], features["input_mask"], features["segment_ids"], config)
    with tf.variable_scope("loss"):
        weights = tf.get_variable("output_weights", [NUM_LABELS, config["hidden_size"]],
                                  initializer=tf.truncated_normal_initializer(stddev=0.02))
        bias = tf.get_variable("output_bias", [NUM_LABELS], initializer=tf.zeros_initializer())
        logits = tf.nn.bias_add(tf.matmul(pooled, weights, transpose_b=True), bias)
        log_probs = tf.nn.log_softmax(logits, axis=-1)
        per_example_loss = -tf.reduce_sum(tf.one_hot(labels, NUM_LABELS) * log_probs, axis=-1)
        return tf.reduce_mean(per_example_loss), logits


def model_fn_builder(config, learning_rate, num_train_steps, num_warmup_steps, init_checkpoint):
    def model_fn(features, labels, mode, params):
        loss, logits = create_model(features, labels, config)
        if init_checkpoint:  # fine-tuning starts from pre-trained weights
            tf.train.init_from_checkpoint(init_checkpoint, {v.op.name: v.op.name for v in tf.trainable_variables()})
        if mode == tf.estimator.ModeKeys.TRAIN:
            train_op = optimization.create_optimizer(loss, learning_rate, num_train_steps, num_warmup_steps)
            return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
        if mode == tf.estimator.ModeKeys.EVAL:
            accuracy = tf.metrics.accuracy(labels, tf.argmax(logits, axis=-1, output_type=tf.int32))
            return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
        return tf.estimator.EstimatorSpec(mode, predictions={"probabilities": tf.nn.softmax(logits)})

    return model_fn


model_fn = model_fn_builder(modeling.CONFIG, **HPARAMS)


def define_flags():
    flags.DEFINE_string("model_dir", None, "Where checkpoints go.")
    flags.DEFINE_integer("train_steps", 20, "Training steps.")
    flags.DEFINE_integer("batch_size", 16, "Global batch size.")
    flags.DEFINE_integer("num_cpu_devices", 4, "Virtual CPU devices this process splits its CPU into.")
    flags.DEFINE_string("init_checkpoint", None, "Pre-trained weights to start from.")
    flags.DEFINE_float("learning_rate", HPARAMS["learning_rate"], "Peak learning rate.")
    flags.DEFINE_integer("warmup_steps", HPARAMS["num_warmup_steps"], "Steps of linear warmup.")
    flags.mark_flag_as_required("model_dir")


def main(_):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.num_cpu_devices)
    session_config = tf.ConfigProto(device_count={"CPU": FLAGS.num_cpu_devices})
    run_config = tf.estimator.RunConfig(model_dir=FLAGS.model_dir, tf_random_seed=1, log_step_count_steps=10,
                                        session_config=session_config)
    model_fn = model_fn_builder(modeling.CONFIG, **dict(HPARAMS, init_checkpoint=FLAGS.init_checkpoint,
                                                        learning_rate=FLAGS.learning_rate,
                                                        num_warmup_steps=FLAGS.warmup_steps))
    params = {"batch_size": FLAGS.batch_size, "train_steps": FLAGS.train_steps}
    estimator = tf.estimator.Estimator(model_fn=model_fn, config=run_config, params=params)
    estimator.train(train_input_fn, max_steps=FLAGS.train_steps)


if __name__ == "__main__":
    define_flags()
    app.run(main)
