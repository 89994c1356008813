"""VGG-19 (Simonyan & Zisserman): 16 conv layers in 5 blocks, then 3 fully connected layers.

One dapple_tf layer per weight layer (19); each block's max-pool belongs to the block's last conv layer,
the flatten to `fc6`, the loss to `fc8`. `paper` is ImageNet VGG-19 (224x224x3, 1000 classes,
143,667,240 parameters); `tiny` divides the widths by `width_div` on 32x32 images.
"""

import tensorflow as tf

from models.base import image_classifier, resolve_config
from models.ops import conv2d, dense, layer_scope, softmax_loss

BLOCKS = [(2, 64), (2, 128), (4, 256), (4, 512), (4, 512)]  # (convs, channels)

PRESETS = {
    "paper": {"image_size": 224, "num_classes": 1000, "width_div": 1, "fc_units": 4096},
    "tiny": {"image_size": 32, "num_classes": 10, "width_div": 16, "fc_units": 64},
}


def _build(features, labels, cfg):
    x = features
    for b, (convs, channels) in enumerate(BLOCKS, start=1):
        for c in range(1, convs + 1):
            with layer_scope(f"conv{b}_{c}"):
                x = tf.nn.relu(conv2d(x, channels // cfg["width_div"], 3, "conv"))
                if c == convs:
                    x = tf.nn.max_pool2d(x, 2, 2, "VALID")
    with layer_scope("fc6"):
        x = tf.reshape(x, [-1, int(x.shape[1] * x.shape[2] * x.shape[3])])
        x = dense(x, cfg["fc_units"], "fc", activation=tf.nn.relu)
    with layer_scope("fc7"):
        x = dense(x, cfg["fc_units"], "fc", activation=tf.nn.relu)
    with layer_scope("fc8"):
        logits = dense(x, cfg["num_classes"], "fc")
        return logits, (softmax_loss(logits, labels) if labels is not None else None)


def make(config="tiny", **overrides):
    return image_classifier("vgg19", resolve_config(PRESETS, config, overrides), _build)
