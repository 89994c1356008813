"""Trains the residual network of resnet_model.py on synthetic images with a tf.estimator.Estimator, as TF1 image
training scripts do: l2 weight decay over every trainable variable added to the loss, Momentum with a piecewise
constant learning rate after a linear warmup (a tf.cond on the global step), batch norm's UPDATE_OPS grouped with
the train op, moving averages of the weights, train-accuracy metrics and image summaries. TF1 code on TF 2: v2
behavior off, resource variables on. This file and resnet_model.py are the single-device script;
docs/user_guide.md ("Porting a training script") shows the lines that pipeline it.

    python examples/resnet_tf1/resnet_main.py --model_dir=/tmp/resnet_tf1 --train_steps=20
"""

import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resnet_model  # noqa: E402

tf.disable_v2_behavior()
tf.enable_resource_variables()

FLAGS = flags.FLAGS
HPARAMS = {"weight_decay": 1e-4, "momentum": 0.9, "learning_rate": 0.1, "warmup_steps": 2, "boundaries": [2],
           "decays": [1.0, 0.1], "moving_average_decay": 0.99}


def examples(step, batch_size, seed=0):
    """The global batch of `step`: images and labels (the label is the channel with the brightest mean). A function
    of the step alone, so a resumed run sees the same batches."""
    config = resnet_model.CONFIG
    rng = np.random.RandomState(seed * 100003 + step)
    shape = (batch_size, config["image_size"], config["image_size"], config["channels"])
    images = rng.rand(*shape).astype(np.float32)
    labels = rng.randint(0, config["num_classes"], batch_size).astype(np.int32)
    images[np.arange(batch_size), :, :, labels % config["channels"]] += 0.5
    return images, labels


def input_fn(step, batch_size):
    return examples(step, batch_size)


def train_input_fn(params):
    """The Estimator's input_fn: the batches of steps 0, 1, ... of `examples`."""
    batches = [examples(step, params["batch_size"]) for step in range(params["train_steps"])]
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(params["batch_size"], drop_remainder=True)


def learning_rate_fn(global_step, hparams):
    """Linear warmup to the base rate, then piecewise constant."""
    base = hparams["learning_rate"]
    decayed = tf.train.piecewise_constant(global_step, hparams["boundaries"], [base * d for d in hparams["decays"]])
    warmup = base * tf.cast(global_step + 1, tf.float32) / float(hparams["warmup_steps"])
    return tf.cond(global_step < hparams["warmup_steps"], lambda: warmup, lambda: decayed)


def model_fn_builder(hparams):
    def model_fn(features, labels, mode, params):
        del params
        tf.summary.image("images", features, max_outputs=2)
        logits = resnet_model.resnet(features, training=mode == tf.estimator.ModeKeys.TRAIN)
        predictions = {"classes": tf.argmax(logits, axis=1, output_type=tf.int32),
                       "probabilities": tf.nn.softmax(logits)}
        if mode == tf.estimator.ModeKeys.PREDICT:
            return tf.estimator.EstimatorSpec(mode, predictions=predictions)
        cross_entropy = tf.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
        tf.summary.scalar("cross_entropy", cross_entropy)
        l2_loss = hparams["weight_decay"] * tf.add_n([tf.nn.l2_loss(v) for v in tf.trainable_variables()])
        tf.summary.scalar("l2_loss", l2_loss)
        loss = cross_entropy + l2_loss
        accuracy = tf.metrics.accuracy(labels, predictions["classes"])
        tf.summary.scalar("train_accuracy", accuracy[1])
        if mode == tf.estimator.ModeKeys.EVAL:
            return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
        global_step = tf.train.get_or_create_global_step()
        learning_rate = learning_rate_fn(global_step, hparams)
        tf.summary.scalar("learning_rate", learning_rate)
        optimizer = tf.train.MomentumOptimizer(learning_rate, momentum=hparams["momentum"])
        minimize_op = optimizer.minimize(loss, global_step)
        update_ops = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
        train_op = tf.group(minimize_op, update_ops)
        averages = tf.train.ExponentialMovingAverage(hparams["moving_average_decay"], global_step)
        with tf.control_dependencies([train_op]):
            train_op = averages.apply(tf.trainable_variables())
        return tf.estimator.EstimatorSpec(mode, predictions=predictions, loss=loss, train_op=train_op)

    return model_fn


model_fn = model_fn_builder(HPARAMS)


def define_flags():
    flags.DEFINE_string("model_dir", None, "Where checkpoints and summaries go.")
    flags.DEFINE_integer("train_steps", 20, "Training steps.")
    flags.DEFINE_integer("batch_size", 16, "Global batch size.")
    flags.DEFINE_integer("num_cpu_devices", 4, "Virtual CPU devices this process splits its CPU into.")
    flags.DEFINE_float("learning_rate", HPARAMS["learning_rate"], "Base learning rate.")
    flags.mark_flag_as_required("model_dir")


def main(_):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.num_cpu_devices)
    session_config = tf.ConfigProto(device_count={"CPU": FLAGS.num_cpu_devices})
    run_config = tf.estimator.RunConfig(model_dir=FLAGS.model_dir, tf_random_seed=1, save_summary_steps=1,
                                        log_step_count_steps=10, session_config=session_config)
    params = {"batch_size": FLAGS.batch_size, "train_steps": FLAGS.train_steps}
    model_fn = model_fn_builder(dict(HPARAMS, learning_rate=FLAGS.learning_rate))
    estimator = tf.estimator.Estimator(model_fn=model_fn, config=run_config, params=params)
    estimator.train(train_input_fn, max_steps=FLAGS.train_steps)


if __name__ == "__main__":
    define_flags()
    app.run(main)
