"""An Estimator training script (tests/user_model.py's batch-norm model) that also trains per host: run it with
`dapple_launch --per_host -- python -m tests.per_host_estimator_script --plan=P --model_dir=D --steps=N`
(tests/test_per_host_estimator.py)."""

import tensorflow as tf
from absl import app, flags

import dapple_tf
import dapple_tf.frontends.estimator as dapple_estimator
from dapple_tf.model.inputs import estimator_input_fn
from tests import user_model

flags.DEFINE_string("plan", None, "The plan file.")
flags.DEFINE_string("model_dir", None, "Checkpoints and summaries.")
flags.DEFINE_integer("steps", 6, "Global steps to train to.")
flags.DEFINE_integer("batch_size", 24, "Global batch.")
flags.DEFINE_boolean("script", False, "A TF1 script's own model_fn(features, labels, mode, params), its training "
                     "step the batch-norm idiom tf.group(minimize_op, update_ops), through pipelined.")
FLAGS = flags.FLAGS


def script_model_fn(features, labels, mode, params):
    """What a TF1 image script writes, ported: dapple_tf.minimize in place of optimizer.minimize."""
    del params
    loss = user_model.batch_norm_model_fn(features, labels)
    minimize_op = dapple_tf.minimize(loss, tf.compat.v1.train.AdamOptimizer(0.01),
                                     global_step=tf.compat.v1.train.get_global_step())
    update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(minimize_op, update_ops))


def main(_):
    task = dapple_estimator.cluster_task(FLAGS.plan)
    config = task.run_config(model_dir=FLAGS.model_dir, save_checkpoints_steps=3, save_summary_steps=3,
                             tf_random_seed=0)  # dapple_train's --seed
    if FLAGS.script:
        model_fn = dapple_estimator.pipelined(script_model_fn, FLAGS.plan)
    else:
        model_fn = dapple_estimator.model_fn(user_model.batch_norm_model_fn,
                                             lambda: tf.compat.v1.train.AdamOptimizer(0.01), FLAGS.plan)
    estimator = tf.estimator.Estimator(model_fn, config=config)
    estimator.train(estimator_input_fn(user_model.input_fn, FLAGS.batch_size), max_steps=FLAGS.steps)
    print(f"trained to step {FLAGS.steps}", flush=True)


if __name__ == "__main__":
    app.run(main)
