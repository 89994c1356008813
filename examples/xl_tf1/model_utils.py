"""The training step as TF1 XLNet fine-tuning code writes it: Adam with a linear warmup then a polynomial decay of
the learning rate, `tf.gradients` clipped by their global norm, then layer-wise learning-rate decay (each gradient
of a variable under `model/transformer/layer_<i>/`, found by `re.search` on its name, scaled by
`decay ** (n_layer - 1 - i)`), and `apply_gradients` with the global step.
"""

import re

import tensorflow.compat.v1 as tf


def learning_rate(init_lr, train_steps, warmup_steps, min_lr_ratio=0.0):
    """Linear warmup from 0 over warmup_steps, then a linear (power 1) decay to init_lr * min_lr_ratio."""
    global_step = tf.train.get_or_create_global_step()
    if warmup_steps > 0:
        warmup_lr = tf.cast(global_step, tf.float32) / tf.cast(warmup_steps, tf.float32) * init_lr
    else:
        warmup_lr = 0.0
    decay_lr = tf.train.polynomial_decay(init_lr, global_step=global_step - warmup_steps,
                                         decay_steps=train_steps - warmup_steps,
                                         end_learning_rate=init_lr * min_lr_ratio)
    return tf.where(global_step < warmup_steps, warmup_lr, decay_lr)


def get_train_op(total_loss, hparams):
    """The train op and the learning rate; hparams: learning_rate, train_steps, warmup_steps, min_lr_ratio,
    adam_epsilon, clip, lr_layer_decay_rate."""
    global_step = tf.train.get_or_create_global_step()
    lr = learning_rate(hparams["learning_rate"], hparams["train_steps"], hparams["warmup_steps"],
                       hparams["min_lr_ratio"])
    optimizer = tf.train.AdamOptimizer(learning_rate=lr, epsilon=hparams["adam_epsilon"])

    variables = tf.trainable_variables()
    gradients = tf.gradients(total_loss, variables)
    clipped, gnorm = tf.clip_by_global_norm(gradients, hparams["clip"])

    if hparams["lr_layer_decay_rate"] != 1.0:
        n_layer = 0
        for variable in variables:
            m = re.search(r"model/transformer/layer_(\d+?)/", variable.name)
            if m:
                n_layer = max(n_layer, int(m.group(1)) + 1)
        for i, variable in enumerate(variables):
            m = re.search(r"model/transformer/layer_(\d+?)/", variable.name)
            if not m:
                continue
            abs_rate = hparams["lr_layer_decay_rate"] ** (n_layer - 1 - int(m.group(1)))
            clipped[i] *= abs_rate
            tf.logging.info("Apply mult %.4f to the gradient of %s", abs_rate, variable.name)

    train_op = optimizer.apply_gradients(zip(clipped, variables), global_step=global_step)
    return train_op, lr, gnorm
