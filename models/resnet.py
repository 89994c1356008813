"""ResNet-50 (He et al., v1.5: stride in the 3x3 conv): a stem, 16 bottleneck blocks, a head.

Layers: `stem` (7x7 conv, BN, ReLU, max-pool), `block{stage}_{i}` (one per bottleneck block, shortcut
included), `head` (global average pool, fc, loss). Convolutions have no bias; batch norm uses the batch's
statistics with a trainable scale and offset. `paper` is ImageNet ResNet-50 (25,557,032 parameters);
`tiny` divides the widths by `width_div` and uses one block per stage on 32x32 images.
"""

import tensorflow as tf

from models.base import image_classifier, resolve_config
from models.ops import batch_norm, conv2d, dense, layer_scope, softmax_loss

PRESETS = {
    "paper": {"image_size": 224, "num_classes": 1000, "width_div": 1, "blocks": [3, 4, 6, 3]},
    "tiny": {"image_size": 32, "num_classes": 10, "width_div": 16, "blocks": [1, 1, 1, 1]},
}


def _conv_bn(x, filters, kernel, name, stride=1, relu=True):
    x = batch_norm(conv2d(x, filters, kernel, name, stride=stride, use_bias=False), name + "_bn")
    return tf.nn.relu(x) if relu else x


def _bottleneck(x, width, stride):
    out_ch = 4 * width
    shortcut = x
    if stride != 1 or int(x.shape[-1]) != out_ch:
        shortcut = _conv_bn(x, out_ch, 1, "proj", stride=stride, relu=False)
    y = _conv_bn(x, width, 1, "conv1")
    y = _conv_bn(y, width, 3, "conv2", stride=stride)
    y = _conv_bn(y, out_ch, 1, "conv3", relu=False)
    return tf.nn.relu(y + shortcut)


def _build(features, labels, cfg):
    div = cfg["width_div"]
    with layer_scope("stem"):
        x = _conv_bn(features, 64 // div, 7, "conv", stride=2)
        x = tf.nn.max_pool2d(x, 3, 2, "SAME")
    for s, count in enumerate(cfg["blocks"]):
        for i in range(count):
            with layer_scope(f"block{s + 1}_{i + 1}"):
                x = _bottleneck(x, (64 << s) // div, 2 if (i == 0 and s > 0) else 1)
    with layer_scope("head"):
        x = tf.reduce_mean(x, axis=[1, 2])
        logits = dense(x, cfg["num_classes"], "fc")
        return logits, (softmax_loss(logits, labels) if labels is not None else None)


def make(config="tiny", **overrides):
    return image_classifier("resnet50", resolve_config(PRESETS, config, overrides), _build)
