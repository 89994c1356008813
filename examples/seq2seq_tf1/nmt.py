"""Trains the GNMT-style sequence-to-sequence model of model.py on a synthetic translation task (each target is its
source reversed, in a vocabulary shifted by one) with a tf.estimator.Estimator, as TF1 NMT scripts do: batch-major
features (source, target_input, their lengths) and target_output labels from an input_fn, made time-major in the
model. TF1 code on TF 2: v2 behavior off (control flow v1 in dynamic_rnn's loops), resource variables on. This file
and model.py are the single-device script; docs/user_guide.md ("Porting a training script") shows the lines that
pipeline it.

    python examples/seq2seq_tf1/nmt.py --model_dir=/tmp/seq2seq_tf1 --train_steps=20
"""

import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model  # noqa: E402

tf.disable_v2_behavior()
tf.enable_resource_variables()

FLAGS = flags.FLAGS
SRC_MAX_LEN = 8
SOS_ID, EOS_ID, FIRST_WORD = 1, 2, 3


def examples(step, batch_size, seed=0):
    """The global batch of `step`: features source, target_input (<s> then the target), source_sequence_length,
    target_sequence_length; labels target_output (the target then </s>). Padded with </s> as NMT's iterator pads.
    A function of the step alone, so a resumed run sees the same batches."""
    hparams = model.HPARAMS
    rng = np.random.RandomState(seed * 100003 + step)
    source = np.full((batch_size, SRC_MAX_LEN), EOS_ID, np.int32)
    target_input = np.full((batch_size, SRC_MAX_LEN + 1), EOS_ID, np.int32)
    target_output = np.full((batch_size, SRC_MAX_LEN + 1), EOS_ID, np.int32)
    source_length = rng.randint(3, SRC_MAX_LEN + 1, size=batch_size).astype(np.int32)
    for row, length in enumerate(source_length):
        words = rng.randint(FIRST_WORD, hparams["src_vocab_size"] - 1, size=length)
        target = words[::-1] + 1  # reversed, shifted: < tgt_vocab_size
        source[row, :length] = words
        target_input[row, 0], target_input[row, 1:length + 1] = SOS_ID, target
        target_output[row, :length] = target
    features = {"source": source, "target_input": target_input, "source_sequence_length": source_length,
                "target_sequence_length": source_length + 1}
    return features, target_output


def input_fn(step, batch_size):
    return examples(step, batch_size)


def train_input_fn(params):
    """The Estimator's input_fn: the batches of steps 0, 1, ... of `examples`."""
    batches = [examples(step, params["batch_size"]) for step in range(params["train_steps"])]
    features = {k: np.concatenate([b[0][k] for b in batches]) for k in batches[0][0]}
    labels = np.concatenate([b[1] for b in batches])
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(params["batch_size"], drop_remainder=True)


def model_fn_builder(hparams):
    def model_fn(features, labels, mode, params):
        del params
        loss, logits = model.build_graph(features, labels, hparams)
        if mode == tf.estimator.ModeKeys.TRAIN:
            return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=model.build_train_op(loss, hparams))
        # each position's next token given the reference before it (NMT's greedy/beam inference is not part of this
        # example)
        predictions = tf.transpose(tf.argmax(logits, axis=-1, output_type=tf.int32))
        if mode == tf.estimator.ModeKeys.EVAL:
            weights = tf.sequence_mask(features["target_sequence_length"], tf.shape(labels)[1])
            accuracy = tf.metrics.accuracy(labels, predictions, weights=weights)
            return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
        return tf.estimator.EstimatorSpec(mode, predictions={"tokens": predictions})

    return model_fn


model_fn = model_fn_builder(model.HPARAMS)


def define_flags():
    flags.DEFINE_string("model_dir", None, "Where checkpoints and summaries go.")
    flags.DEFINE_integer("train_steps", 20, "Training steps.")
    flags.DEFINE_integer("batch_size", 16, "Global batch size.")
    flags.DEFINE_integer("num_cpu_devices", 4, "Virtual CPU devices this process splits its CPU into.")
    flags.DEFINE_float("learning_rate", model.HPARAMS["learning_rate"], "Learning rate after the warmup.")
    flags.DEFINE_integer("warmup_steps", model.HPARAMS["warmup_steps"], "Steps of warmup.")
    flags.DEFINE_integer("decay_start", model.HPARAMS["decay_start"], "The step the learning rate starts decaying.")
    flags.DEFINE_integer("decay_steps", model.HPARAMS["decay_steps"], "Steps between halvings of the learning rate.")
    flags.DEFINE_float("max_gradient_norm", model.HPARAMS["max_gradient_norm"], "Clip gradients to this norm.")
    flags.mark_flag_as_required("model_dir")


def main(_):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.num_cpu_devices)
    session_config = tf.ConfigProto(device_count={"CPU": FLAGS.num_cpu_devices})
    run_config = tf.estimator.RunConfig(model_dir=FLAGS.model_dir, tf_random_seed=1, save_summary_steps=1,
                                        log_step_count_steps=10, session_config=session_config)
    hparams = dict(model.HPARAMS, learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                   decay_start=FLAGS.decay_start, decay_steps=FLAGS.decay_steps,
                   max_gradient_norm=FLAGS.max_gradient_norm)
    model_fn = model_fn_builder(hparams)
    params = {"batch_size": FLAGS.batch_size, "train_steps": FLAGS.train_steps}
    estimator = tf.estimator.Estimator(model_fn=model_fn, config=run_config, params=params)
    estimator.train(train_input_fn, max_steps=FLAGS.train_steps)


if __name__ == "__main__":
    define_flags()
    app.run(main)
