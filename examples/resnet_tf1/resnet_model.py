"""A small residual network written the way TF1 image code is: `tf.compat.v1.layers` convolutions and fused batch
normalization (its moving averages in UPDATE_OPS), residual blocks with no scope of their own (the layers number
themselves: conv2d, conv2d_1, ..., batch_normalization_1, ...), one variable scope around the model. A single-device
model; docs/user_guide.md ("Porting a training script") says how it is pipelined.
"""

import tensorflow.compat.v1 as tf

CONFIG = {"image_size": 8, "channels": 3, "num_classes": 4, "filters": 8, "num_blocks": 2}
BATCH_NORM_DECAY = 0.9
BATCH_NORM_EPSILON = 1e-5


def batch_norm(inputs, training):
    return tf.layers.batch_normalization(inputs, momentum=BATCH_NORM_DECAY, epsilon=BATCH_NORM_EPSILON, center=True,
                                         scale=True, training=training, fused=True)


def conv(inputs, filters, strides=1):
    return tf.layers.conv2d(inputs, filters, kernel_size=3, strides=strides, padding="SAME", use_bias=False,
                            kernel_initializer=tf.variance_scaling_initializer())


def residual_block(inputs, filters, training):
    """conv-bn-relu-conv-bn, plus the input: a block as TF1 ResNet code builds it, with no scope of its own."""
    shortcut = inputs
    x = tf.nn.relu(batch_norm(conv(inputs, filters), training))
    x = batch_norm(conv(x, filters), training)
    return tf.nn.relu(x + shortcut)


def resnet(images, training, config=CONFIG):
    """Logits of a batch of images [batch, size, size, channels]."""
    with tf.variable_scope("resnet_model"):
        x = tf.nn.relu(batch_norm(conv(images, config["filters"]), training))
        for _ in range(config["num_blocks"]):
            x = residual_block(x, config["filters"], training)
        x = tf.reduce_mean(x, axis=[1, 2])
        return tf.layers.dense(x, config["num_classes"])
