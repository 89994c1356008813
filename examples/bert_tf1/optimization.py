"""AdamW as TF1 BERT scripts write it: a `tf.compat.v1.train.Optimizer` subclass that overrides
`apply_gradients`, makes its `adam_m`/`adam_v` slots with `get_variable` there, decays weights except those
whose names match `exclude_from_weight_decay`; a learning rate with linear warmup then polynomial decay, and
gradients clipped by their global norm.
"""

import re

import tensorflow.compat.v1 as tf


def learning_rate(init_lr, num_train_steps, num_warmup_steps):
    """Linear warmup over num_warmup_steps, then linear decay to 0 at num_train_steps."""
    global_step = tf.train.get_or_create_global_step()
    decayed = tf.train.polynomial_decay(tf.constant(init_lr, tf.float32), global_step, num_train_steps,
                                        end_learning_rate=0.0, power=1.0, cycle=False)
    if not num_warmup_steps:
        return decayed
    step = tf.cast(global_step, tf.float32)
    warmup = init_lr * step / float(num_warmup_steps)
    return tf.where(step < float(num_warmup_steps), warmup, decayed)


def create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps):
    """The train op: AdamW on the clipped gradients of every trainable variable, then global_step += 1."""
    global_step = tf.train.get_or_create_global_step()
    optimizer = AdamWeightDecayOptimizer(learning_rate(init_lr, num_train_steps, num_warmup_steps),
                                         weight_decay_rate=0.01,
                                         exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"])
    tvars = tf.trainable_variables()
    grads = tf.gradients(loss, tvars)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
    train_op = optimizer.apply_gradients(zip(grads, tvars), global_step=global_step)
    with tf.control_dependencies([train_op]):  # this optimizer does not advance global_step itself
        return tf.group(train_op, global_step.assign_add(1))


class AdamWeightDecayOptimizer(tf.train.Optimizer):
    """Adam with decoupled weight decay and no bias correction."""

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                 exclude_from_weight_decay=None, name="AdamWeightDecayOptimizer"):
        super().__init__(False, name)
        self.learning_rate = learning_rate
        self.weight_decay_rate = weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.exclude_from_weight_decay = exclude_from_weight_decay or []

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        updates = []
        for grad, param in grads_and_vars:
            if grad is None or param is None:
                continue
            param_name = re.sub(r":\d+$", "", param.name)
            m = tf.get_variable(param_name + "/adam_m", shape=param.shape.as_list(), dtype=tf.float32,
                                trainable=False, initializer=tf.zeros_initializer())
            v = tf.get_variable(param_name + "/adam_v", shape=param.shape.as_list(), dtype=tf.float32,
                                trainable=False, initializer=tf.zeros_initializer())
            grad = tf.convert_to_tensor(grad)
            next_m = self.beta_1 * m + (1.0 - self.beta_1) * grad
            next_v = self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad)
            update = next_m / (tf.sqrt(next_v) + self.epsilon)
            if self._do_use_weight_decay(param_name):
                update += self.weight_decay_rate * param
            updates.extend([param.assign(param - self.learning_rate * update), m.assign(next_m),
                            v.assign(next_v)])
        return tf.group(*updates, name=name)

    def _do_use_weight_decay(self, param_name):
        if not self.weight_decay_rate:
            return False
        return not any(re.search(pattern, param_name) for pattern in self.exclude_from_weight_decay)
