"""Fine-tunes the TF1-style Transformer-XL encoder of modeling.py on a synthetic sentence-pair classification task
with a tf.estimator.Estimator, as TF1 XLNet classifier scripts do: batch-major features made time-major in
model_fn (`tf.transpose(features["input_ids"], [1, 0])`), padding on the left and the classifier token last, the
classification head on the last position's output, and model_utils.py's training step (Adam, warmup then
polynomial decay, clipping, layer-wise learning-rate decay). This file, modeling.py and model_utils.py are the
single-device script; docs/user_guide.md ("Porting a training script") shows the lines that pipeline it.

    python examples/xl_tf1/run_classifier.py --model_dir=/tmp/xl_tf1 --train_steps=20
"""

import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_utils  # noqa: E402
import modeling  # noqa: E402

FLAGS = flags.FLAGS
SEQ_LENGTH = 12
NUM_LABELS = 2
TASK_NAME = "pairs"
SEP_ID, CLS_ID = 4, 3
SEG_ID_A, SEG_ID_B, SEG_ID_CLS, SEG_ID_PAD = 0, 1, 2, 4
HPARAMS = {"learning_rate": 1e-3, "train_steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.0,
           "adam_epsilon": 1e-8, "clip": 1.0, "lr_layer_decay_rate": 0.75, "init_checkpoint": None}


def examples(step, batch_size, seed=0):
    """The global batch of `step`, laid out as XLNet's classifier features are: A [SEP] B [SEP] [CLS], padded on
    the left; input_mask is 1.0 at padding. Label: does segment A hold more small ids (< 50) than segment B. A
    function of the step alone, so a resumed run sees the same batches."""
    rng = np.random.RandomState(seed * 100003 + step)
    input_ids = np.zeros((batch_size, SEQ_LENGTH), np.int32)
    input_mask = np.ones((batch_size, SEQ_LENGTH), np.float32)
    segment_ids = np.full((batch_size, SEQ_LENGTH), SEG_ID_PAD, np.int32)
    labels = np.zeros(batch_size, np.int32)
    for row in range(batch_size):
        len_a, len_b = rng.randint(1, 5, size=2)
        tokens_a = rng.randint(5, modeling.CONFIG["vocab_size"], size=len_a)
        tokens_b = rng.randint(5, modeling.CONFIG["vocab_size"], size=len_b)
        ids = list(tokens_a) + [SEP_ID] + list(tokens_b) + [SEP_ID, CLS_ID]
        segments = [SEG_ID_A] * (len_a + 1) + [SEG_ID_B] * (len_b + 1) + [SEG_ID_CLS]
        input_ids[row, SEQ_LENGTH - len(ids):] = ids
        segment_ids[row, SEQ_LENGTH - len(ids):] = segments
        input_mask[row, SEQ_LENGTH - len(ids):] = 0.0
        labels[row] = int((tokens_a < 50).sum() > (tokens_b < 50).sum())
    return {"input_ids": input_ids, "input_mask": input_mask, "segment_ids": segment_ids}, labels


def input_fn(step, batch_size):
    return examples(step, batch_size)


def train_input_fn(params):
    """The Estimator's input_fn: the batches of steps 0, 1, ... of `examples`."""
    batches = [examples(step, params["batch_size"]) for step in range(params["train_steps"])]
    features = {k: np.concatenate([b[0][k] for b in batches]) for k in batches[0][0]}
    labels = np.concatenate([b[1] for b in batches])
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(params["batch_size"], drop_remainder=True)


def get_classification_loss(features, labels, config, n_class):
    """The mean cross entropy, per-example losses and logits of the classifier on the encoder's last position
    (losses None without labels: PREDICT)."""
    bsz_per_core = tf.shape(features["input_ids"])[0]
    inp = tf.transpose(features["input_ids"], [1, 0])
    seg_id = tf.transpose(features["segment_ids"], [1, 0])
    inp_mask = tf.transpose(features["input_mask"], [1, 0])
    label = tf.reshape(labels, [bsz_per_core]) if labels is not None else None
    initializer = modeling.initializer(config)
    with tf.variable_scope("model"):
        output, _ = modeling.transformer_xl(inp, seg_id, inp_mask, config)
        summary = modeling.summarize_sequence(output, config["d_model"], initializer)
        per_example_loss, logits = modeling.classification_loss(summary, label, n_class, initializer,
                                                                scope=f"classification_{TASK_NAME}")
    total_loss = tf.reduce_mean(per_example_loss) if per_example_loss is not None else None
    return total_loss, per_example_loss, logits


def model_fn_builder(config, hparams):
    def model_fn(features, labels, mode, params):
        del params
        total_loss, _, logits = get_classification_loss(features, labels, config, NUM_LABELS)
        num_params = sum(np.prod(v.shape.as_list()) for v in tf.trainable_variables())
        tf.logging.info("#params: %d", num_params)
        if hparams["init_checkpoint"]:  # fine-tuning starts from pre-trained weights
            tf.train.init_from_checkpoint(hparams["init_checkpoint"],
                                          {v.op.name: v.op.name for v in tf.trainable_variables()})
        if mode == tf.estimator.ModeKeys.TRAIN:
            train_op, _, _ = model_utils.get_train_op(total_loss, hparams)
            return tf.estimator.EstimatorSpec(mode, loss=total_loss, train_op=train_op)
        if mode == tf.estimator.ModeKeys.EVAL:
            accuracy = tf.metrics.accuracy(labels, tf.argmax(logits, axis=-1, output_type=tf.int32))
            return tf.estimator.EstimatorSpec(mode, loss=total_loss, eval_metric_ops={"accuracy": accuracy})
        return tf.estimator.EstimatorSpec(mode, predictions={"probabilities": tf.nn.softmax(logits)})

    return model_fn


model_fn = model_fn_builder(modeling.CONFIG, HPARAMS)


def define_flags():
    flags.DEFINE_string("model_dir", None, "Where checkpoints go.")
    flags.DEFINE_integer("train_steps", 20, "Training steps.")
    flags.DEFINE_integer("batch_size", 16, "Global batch size.")
    flags.DEFINE_integer("num_cpu_devices", 4, "Virtual CPU devices this process splits its CPU into.")
    flags.DEFINE_string("init_checkpoint", None, "Pre-trained weights to start from.")
    flags.DEFINE_float("learning_rate", HPARAMS["learning_rate"], "Peak learning rate.")
    flags.DEFINE_integer("warmup_steps", HPARAMS["warmup_steps"], "Steps of linear warmup.")
    flags.DEFINE_float("lr_layer_decay_rate", HPARAMS["lr_layer_decay_rate"],
                       "Each layer's learning rate is this times the next layer's.")
    flags.DEFINE_float("adam_epsilon", HPARAMS["adam_epsilon"], "Adam's epsilon.")
    flags.mark_flag_as_required("model_dir")


def main(_):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.num_cpu_devices)
    session_config = tf.ConfigProto(device_count={"CPU": FLAGS.num_cpu_devices})
    run_config = tf.estimator.RunConfig(model_dir=FLAGS.model_dir, tf_random_seed=1, log_step_count_steps=10,
                                        session_config=session_config)
    hparams = dict(HPARAMS, init_checkpoint=FLAGS.init_checkpoint, learning_rate=FLAGS.learning_rate,
                   warmup_steps=FLAGS.warmup_steps, lr_layer_decay_rate=FLAGS.lr_layer_decay_rate,
                   adam_epsilon=FLAGS.adam_epsilon)
    model_fn = model_fn_builder(modeling.CONFIG, hparams)
    params = {"batch_size": FLAGS.batch_size, "train_steps": FLAGS.train_steps}
    estimator = tf.estimator.Estimator(model_fn=model_fn, config=run_config, params=params)
    estimator.train(train_input_fn, max_steps=FLAGS.train_steps)


if __name__ == "__main__":
    define_flags()
    app.run(main)
