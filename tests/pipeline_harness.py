"""Runs a model single-device and pipelined from the same initial values, for comparisons."""

import dataclasses
import random

import numpy as np
import tensorflow as tf

import dapple_tf

SESSION_CONFIG = tf.compat.v1.ConfigProto(device_count={"CPU": 8})


def cpu(i):
    return f"/device:CPU:{i}"


def _load(sess, variables, initial):
    for v in variables:
        if v.op.name in initial:
            v.load(initial[v.op.name], sess)


def initial_weights(model_fn, x, y, seed=0):
    """Values of the trainable variables after initialization on one device (by name), the same every run:
    the graph's seed and Python's (Keras 3 initializers without a seed draw one from `random`) are `seed`.
    Random starting points made tests flaky: one draw in 16 put two of slim ResNet's max-pool inputs within
    float32 round-off of each other after a step, and the pipeline's round-off took the other argmax."""
    state = random.getstate()
    random.seed(seed)
    try:
        return _initial_weights(model_fn, x, y, seed)
    finally:
        random.setstate(state)


def _initial_weights(model_fn, x, y, seed):
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(seed)
        model_fn(tf.nest.map_structure(tf.constant, x), tf.constant(y))
        variables = tf.compat.v1.trainable_variables()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return dict(zip([v.op.name for v in variables], sess.run(variables)))


def train_single(model_fn, x, y, make_optimizer, steps, initial=None):
    """Full-batch training on one device: (first-step gradients by name, final weights by name, losses).

    `initial` (name -> value) overrides the initializers, for models with random ones.
    """
    with tf.Graph().as_default():
        loss = model_fn(tf.nest.map_structure(tf.constant, x), tf.constant(y))
        variables = tf.compat.v1.trainable_variables()
        raw = tf.gradients(loss, variables)  # IndexedSlices for gathers, applied as such (as minimize does)
        train_op = make_optimizer().apply_gradients(list(zip(raw, variables)))
        grads = [tf.convert_to_tensor(g) for g in raw]
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _load(sess, variables, initial or {})
            first_grads = dict(zip([v.op.name for v in variables], sess.run(grads)))
            losses = []
            for _ in range(steps):
                losses.append(sess.run([loss, train_op])[0])
            weights = dict(zip([v.op.name for v in variables], sess.run(variables)))
    return first_grads, weights, losses


def split_options(**build):
    """build_pipeline's keyword arguments as (its PipelineOptions, the other keyword arguments)."""
    fields = {f.name for f in dataclasses.fields(dapple_tf.PipelineOptions)}
    options = dapple_tf.PipelineOptions(**{k: v for k, v in build.items() if k in fields})
    return options, {k: v for k, v in build.items() if k not in fields}


def train_pipelined(model_fn, x, y, make_optimizer, plan, schedule, steps, run_metadata=None, initial=None,
                    target="", config=SESSION_CONFIG, **build):
    """The same through build_pipeline (`build`: its other keyword arguments) in a session on `target` ("" is
    this process); also returns the handle and every variable copy's value."""
    with tf.Graph().as_default():
        options, rest = split_options(schedule=schedule, **build)
        handle = dapple_tf.build_pipeline(
            model_fn, tf.nest.map_structure(tf.constant, x), tf.constant(y), make_optimizer(), plan, options, **rest
        )
        grads = [tf.convert_to_tensor(g) for g, _ in handle.grads_and_vars]
        names = [v.op.name for _, v in handle.grads_and_vars]
        with tf.compat.v1.Session(target, config=handle.session_config(config)) as sess:
            sess.run(handle.initializer)
            if initial:
                _load(sess, [v for _, v in handle.grads_and_vars], initial)
                sess.run(handle.local_init_op)  # the copies follow the loaded values
            first_grads = dict(zip(names, sess.run(grads)))
            losses = []
            for step in range(steps):
                options = None
                if run_metadata is not None and step == steps - 1:
                    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                                      output_partition_graphs=True)
                losses.append(sess.run([handle.loss, handle.train_op], options=options, run_metadata=run_metadata)[0])
            weights = dict(zip(names, sess.run([v for _, v in handle.grads_and_vars])))
            local = tf.compat.v1.local_variables()
            copies = dict(zip([v.op.name for v in local], sess.run(local)))
    return first_grads, weights, losses, handle, copies


def assert_close_dicts(expected, actual, rtol=1e-5, atol=1e-6):
    assert sorted(expected) == sorted(actual)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=atol, err_msg=name)
