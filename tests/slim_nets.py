"""tf-slim's networks as a user would call them (unmodified), for tests of layers_by_scope.

On TF 2.15, slim's batch_norm builds `tensorflow.python.layers.normalization.BatchNormalization`, which
TF 2.15 loads from `tf_keras.legacy_tf_layers` (no tf-keras release has that module; keras 2.15 has it as
`keras.src.legacy_tf_layers`). `import_slim` registers that alias in sys.modules (only if the module is
missing), the same workaround a user needs (README, "Third-party models").
"""

import importlib
import sys
import types

import pytest
import tensorflow as tf


def import_slim():
    try:
        importlib.import_module("tf_keras.legacy_tf_layers.normalization")
    except ImportError:
        legacy = importlib.import_module("keras.src.legacy_tf_layers")
        normalization = importlib.import_module("keras.src.legacy_tf_layers.normalization")
        sys.modules.setdefault("tf_keras", types.ModuleType("tf_keras"))
        sys.modules["tf_keras.legacy_tf_layers"] = legacy
        sys.modules["tf_keras.legacy_tf_layers.normalization"] = normalization
    return pytest.importorskip("tf_slim")


def cross_entropy(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def small_resnet_v1(is_training=False):
    """slim's resnet_v1 with two small bottleneck blocks, its arg scope (batch norm, L2) and its loss terms."""
    slim = import_slim()
    from tf_slim.nets import resnet_v1

    def model_fn(images, labels):
        blocks = [resnet_v1.resnet_v1_block("block1", base_depth=2, num_units=2, stride=2),
                  resnet_v1.resnet_v1_block("block2", base_depth=4, num_units=1, stride=1)]
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            logits, _ = resnet_v1.resnet_v1(images, blocks, num_classes=5, is_training=is_training, scope="resnet")
        loss = cross_entropy(labels, tf.squeeze(logits, [1, 2]))
        return loss + tf.add_n(tf.compat.v1.losses.get_regularization_losses())

    return model_fn


def small_inception_v3(images, labels):
    slim = import_slim()
    from tf_slim.nets import inception_v3

    with slim.arg_scope(inception_v3.inception_v3_arg_scope()):
        logits, _ = inception_v3.inception_v3(images, num_classes=5, is_training=False, depth_multiplier=0.1,
                                              create_aux_logits=False)
    return cross_entropy(labels, logits)


def vgg_a(images, labels):
    import_slim()
    from tf_slim.nets import vgg

    logits, _ = vgg.vgg_a(images, num_classes=5, is_training=False)
    return cross_entropy(labels, logits)


def alexnet_v2(images, labels):
    import_slim()
    from tf_slim.nets import alexnet

    logits, _ = alexnet.alexnet_v2(images, num_classes=5, is_training=False)
    return cross_entropy(labels, logits)
