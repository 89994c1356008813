"""Building blocks for the reference models: variables and layers in raw TF ops (tf.compat.v1 graph mode).

Every block creates its variables with `tf.compat.v1.get_variable` (resource variables), so the caller's
variable scope decides naming and reuse. `layer_scope(name)` opens the dapple_tf layer marker and a
variable scope of the same name (without a second name scope), so a layer's ops are named `name/...`
and its variables `name/...:0`.
"""

import contextlib

import tensorflow as tf

import dapple_tf

v1 = tf.compat.v1


@contextlib.contextmanager
def layer_scope(name):
    """`dapple_tf.layer(name)` plus a variable scope `name` for the variables created inside."""
    with dapple_tf.layer(name), v1.variable_scope(name, auxiliary_name_scope=False):
        yield


def variable(name, shape, initializer=None, stddev=None):
    """A float32 trainable resource variable (Glorot-uniform unless `initializer`/`stddev` is given)."""
    if initializer is None:
        initializer = (v1.truncated_normal_initializer(stddev=stddev) if stddev is not None
                       else v1.glorot_uniform_initializer())
    return v1.get_variable(name, shape=shape, dtype=tf.float32, initializer=initializer,
                           use_resource=True, trainable=True)


def dense(x, units, name, activation=None, use_bias=True, stddev=None):
    """x @ W + b over the last axis (any rank)."""
    in_dim = int(x.shape[-1])
    w = variable(name + "_kernel", [in_dim, units], stddev=stddev)
    if x.shape.ndims == 2:
        y = tf.matmul(x, w)
    else:
        y = tf.tensordot(x, w, axes=[[x.shape.ndims - 1], [0]])
    if use_bias:
        y = y + variable(name + "_bias", [units], initializer=v1.zeros_initializer())
    return activation(y) if activation is not None else y


def conv2d(x, filters, kernel, name, stride=1, use_bias=True, padding="SAME"):
    """NHWC 2-D convolution with He-normal initialisation."""
    in_ch = int(x.shape[-1])
    w = variable(name + "_kernel", [kernel, kernel, in_ch, filters],
                 initializer=v1.variance_scaling_initializer(scale=2.0))
    y = tf.nn.conv2d(x, w, strides=[1, stride, stride, 1], padding=padding)
    if use_bias:
        y = tf.nn.bias_add(y, variable(name + "_bias", [filters], initializer=v1.zeros_initializer()))
    return y


def batch_norm(x, name, epsilon=1e-5):
    """Batch normalisation with the batch's statistics (training mode) and a trainable scale/offset."""
    channels = int(x.shape[-1])
    gamma = variable(name + "_gamma", [channels], initializer=v1.ones_initializer())
    beta = variable(name + "_beta", [channels], initializer=v1.zeros_initializer())
    mean, var = tf.nn.moments(x, axes=list(range(x.shape.ndims - 1)), keepdims=True)
    return tf.nn.batch_normalization(x, mean, var, beta, gamma, epsilon)


def layer_norm(x, name, epsilon=1e-12):
    """Layer normalisation over the last axis."""
    dim = int(x.shape[-1])
    gamma = variable(name + "_gamma", [dim], initializer=v1.ones_initializer())
    beta = variable(name + "_beta", [dim], initializer=v1.zeros_initializer())
    mean, var = tf.nn.moments(x, axes=[x.shape.ndims - 1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + epsilon) * gamma + beta


def gelu(x):
    """GELU, tanh approximation (as in BERT)."""
    return 0.5 * x * (1.0 + tf.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def softmax_loss(logits, labels):
    """Mean sparse softmax cross-entropy over every leading position (a scalar)."""
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int32), logits=logits)
    return tf.reduce_mean(xent, name="loss")
