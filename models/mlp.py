"""A small multi-layer perceptron classifier: one layer per dense block, the last one holds the loss.

Layers: `dense_0 .. dense_{n-1}` (ReLU) then `head` (logits + softmax cross-entropy).
The `tiny` config fits scikit-learn's digits (8x8 images = 64 features, 10 classes).
"""

import tensorflow as tf

from models.base import InputSpec, ModelSpec, resolve_config
from models.ops import dense, layer_scope, softmax_loss

PRESETS = {
    "tiny": {"input_dim": 64, "hidden": [64, 64], "num_classes": 10},
    "paper": {"input_dim": 784, "hidden": [1024, 1024, 1024, 1024], "num_classes": 10},
}


def _build(features, labels, cfg):
    """(logits, loss); loss is None without labels."""
    x = features
    for i, units in enumerate(cfg["hidden"]):
        with layer_scope(f"dense_{i}"):
            x = dense(x, units, "fc", activation=tf.nn.relu)
    with layer_scope("head"):
        logits = dense(x, cfg["num_classes"], "logits")
        return logits, (softmax_loss(logits, labels) if labels is not None else None)


def make(config="tiny", **overrides):
    cfg = resolve_config(PRESETS, config, overrides)
    return ModelSpec(
        "mlp", cfg,
        model_fn=lambda features, labels: _build(features, labels, cfg)[1],
        feature_spec=InputSpec((cfg["input_dim"],), tf.float32),
        label_spec=InputSpec((), tf.int32, high=cfg["num_classes"]),
        predict_fn=lambda features: _build(features, None, cfg)[0],
    )
