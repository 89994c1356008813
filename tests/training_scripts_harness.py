"""Training as TF1 scripts write it, on one device and pipelined, for test_training_scripts.py and
tf1_behavior_probe.py: the optimizer applied to gradients clipped by their global norm, global_step advanced by
the script after the apply (TF1 BERT's AdamW does not advance it), compared weight by weight."""

import collections

import numpy as np
import tensorflow as tf

import dapple_tf
from tests.pipeline_harness import SESSION_CONFIG, _load, split_options

v1 = tf.compat.v1
Spec = collections.namedtuple("Spec", ["loss", "train_op"])  # what an EstimatorSpec holds that training reads
Run = collections.namedtuple("Run", ["weights", "norms", "global_step", "losses"])


def _after(train_op, global_step):
    with tf.control_dependencies([train_op]):
        return tf.group(train_op, global_step.assign_add(1))


def train_single(loss_fn, x, y, make_optimizer, steps, clip, initial, gradient_fn=None) -> Run:
    """tf.gradients, tf.clip_by_global_norm, gradient_fn, apply_gradients, global_step += 1: on one device."""
    with tf.Graph().as_default():
        loss = loss_fn(tf.nest.map_structure(tf.constant, x), tf.constant(y))
        global_step = v1.train.get_or_create_global_step()
        optimizer = make_optimizer()
        tvars = v1.trainable_variables()
        grads = v1.gradients(loss, tvars)
        grads, norm = tf.clip_by_global_norm(grads, clip)
        pairs = list(zip(grads, tvars))
        if gradient_fn is not None:
            pairs = gradient_fn(pairs)
        step = _after(optimizer.apply_gradients(pairs, global_step=global_step), global_step)
        with v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(v1.global_variables_initializer())
            _load(sess, tvars, initial)
            norms, losses = [], []
            for _ in range(steps):
                n, l, _ = sess.run([norm, loss, step])
                norms.append(n)
                losses.append(l)
            return Run(dict(zip([v.op.name for v in tvars], sess.run(tvars))), norms, sess.run(global_step), losses)


def scripted(loss_fn, make_optimizer, clip, gradient_fn=None):
    """A model_fn as a ported TF1 script has it: dapple_tf.minimize where the gradients were applied."""

    def model_fn(features, labels):
        loss = loss_fn(features, labels)
        global_step = v1.train.get_or_create_global_step()
        train_op = dapple_tf.minimize(loss, make_optimizer(), global_step=global_step, clip_global_norm=clip,
                                      gradient_fn=gradient_fn)
        return Spec(loss, _after(train_op, global_step))

    return model_fn


def train_pipelined(loss_fn, x, y, make_optimizer, plan, steps, clip, initial, gradient_fn=None, **build) -> Run:
    """The same through build_pipeline (`build`: PipelineOptions fields and build_pipeline's keywords)."""
    with tf.Graph().as_default():
        options, rest = split_options(**build)
        handle = dapple_tf.build_pipeline(scripted(loss_fn, make_optimizer, clip, gradient_fn),
                                          tf.nest.map_structure(tf.constant, x), tf.constant(y), None, plan, options,
                                          **rest)
        tvars = [v for _, v in handle.grads_and_vars]
        global_step = v1.train.get_global_step()
        with v1.Session(config=handle.session_config(SESSION_CONFIG)) as sess:
            sess.run(handle.initializer)
            _load(sess, tvars, initial)
            sess.run(handle.local_init_op)
            norms, losses = [], []
            for _ in range(steps):
                n, l, _ = sess.run([handle.global_norm, handle.loss, handle.train_op])
                norms.append(n)
                losses.append(l)
            return Run(dict(zip([v.op.name for v in tvars], sess.run(tvars))), norms, sess.run(global_step), losses)


def differences(want: Run, got: Run):
    """(largest weight difference, largest norm difference); asserts the same variables and global steps."""
    assert sorted(want.weights) == sorted(got.weights)
    assert want.global_step == got.global_step
    weights = max(float(np.abs(want.weights[k] - got.weights[k]).max()) for k in want.weights)
    return weights, float(np.abs(np.array(want.norms) - np.array(got.norms)).max())
