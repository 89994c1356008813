"""One model_fn, as a TF1 script writes it (its own minimize / apply_gradients, EstimatorSpec-like result), trained
on one device as written and pipelined by build_pipeline(model_fn, ..., optimizer=None, plan): every global variable
(weights, optimizer slots, moving averages, the global step) compared by name, for test_script_training.py and
test_image_script.py."""

import collections
import random

import numpy as np
import tensorflow as tf

import dapple_tf
from tests.pipeline_harness import SESSION_CONFIG, split_options

v1 = tf.compat.v1
Spec = collections.namedtuple("Spec", ["loss", "train_op"])  # what an EstimatorSpec holds that training reads


def _variables():
    return {v.op.name: v for v in v1.global_variables()}


def initial_values(model_fn, x, y, seed=0):
    """Every global variable's value after initialization on one device (by name), the same every run."""
    state = random.getstate()
    random.seed(seed)
    try:
        with tf.Graph().as_default():
            v1.set_random_seed(seed)
            model_fn(tf.nest.map_structure(tf.constant, x), tf.constant(y))
            variables = _variables()
            with v1.Session(config=SESSION_CONFIG) as sess:
                sess.run(v1.global_variables_initializer())
                return dict(zip(variables, sess.run(list(variables.values()))))
    finally:
        random.setstate(state)


def _load(sess, variables, initial):
    for name, variable in variables.items():
        if name in initial:
            variable.load(initial[name], sess)


def train_one_device(model_fn, x, y, steps, initial):
    """The script as written: model_fn on the whole batch, its train_op run `steps` times; (values, losses)."""
    with tf.Graph().as_default():
        spec = model_fn(tf.nest.map_structure(tf.constant, x), tf.constant(y))
        variables = _variables()
        with v1.Session(config=SESSION_CONFIG) as sess:
            sess.run([v1.global_variables_initializer(), v1.local_variables_initializer()])
            _load(sess, variables, initial)
            losses = [sess.run([spec.loss, spec.train_op])[0] for _ in range(steps)]
            return dict(zip(variables, sess.run(list(variables.values())))), losses


def train_pipelined(model_fn, x, y, plan, steps, initial, **build):
    """The same model_fn through build_pipeline (`build`: PipelineOptions fields and build_pipeline's keywords)."""
    with tf.Graph().as_default():
        options, rest = split_options(**build)
        handle = dapple_tf.build_pipeline(model_fn, tf.nest.map_structure(tf.constant, x), tf.constant(y), None,
                                          plan, options, **rest)
        variables = _variables()
        with v1.Session(config=handle.session_config(SESSION_CONFIG)) as sess:
            sess.run(handle.initializer)
            _load(sess, variables, initial)
            sess.run(handle.local_init_op)
            losses = [sess.run([handle.loss, handle.train_op])[0] for _ in range(steps)]
            return dict(zip(variables, sess.run(list(variables.values())))), losses


def largest_difference(want, got):
    """Asserts the same global variables; the largest absolute difference over them."""
    assert sorted(want) == sorted(got)
    return max(float(np.abs(np.asarray(want[k], np.float64) - np.asarray(got[k], np.float64)).max()) for k in want)
