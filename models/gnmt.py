"""GNMT-style LSTM encoder/decoder (Wu et al.) with attention, unrolled over a fixed sequence length.

Layers: `encoder_embedding`, `encoder_lstm_0 .. encoder_lstm_{L/2-1}` (the first bidirectional, residual
connections from the third on), `decoder_embedding`, `decoder_lstm_0` (also computes the attention
context over the encoder outputs, which every later decoder layer consumes: a branching DAG),
`decoder_lstm_1 .. decoder_lstm_{L/2-1}` (input: previous output + attention context; residual from the
third on), `softmax` (projection to the vocabulary and the loss, mean over tokens). `paper` is GNMT-16
(8 + 8 layers of 1024 units, 32k vocabulary); `tiny` is 2 + 2 layers of 16 units.
"""

import tensorflow as tf

from models.base import InputSpec, ModelSpec, resolve_config
from models.ops import dense, layer_scope, softmax_loss, variable

PRESETS = {
    "paper": {"num_layers": 16, "hidden": 1024, "vocab_size": 32000, "seq_len": 50},
    "tiny": {"num_layers": 4, "hidden": 16, "vocab_size": 50, "seq_len": 6},
}


def lstm(x, hidden, name, reverse=False):
    """A unidirectional LSTM over x [batch, time, dim]; returns the outputs [batch, time, hidden]."""
    steps, dim = int(x.shape[1]), int(x.shape[2])
    w_x = variable(name + "_wx", [dim, 4 * hidden])
    w_h = variable(name + "_wh", [hidden, 4 * hidden])
    bias = variable(name + "_bias", [4 * hidden], initializer=tf.compat.v1.zeros_initializer())
    gates_x = tf.reshape(tf.matmul(tf.reshape(x, [-1, dim]), w_x) + bias, [-1, steps, 4 * hidden])
    h = c = tf.zeros_like(gates_x[:, 0, :hidden])
    outputs = [None] * steps
    for t in (reversed(range(steps)) if reverse else range(steps)):
        i, f, g, o = tf.split(gates_x[:, t] + tf.matmul(h, w_h), 4, axis=1)
        c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
        outputs[t] = h
    return tf.stack(outputs, axis=1)


def _build(features, labels, cfg):
    hidden, half = cfg["hidden"], cfg["num_layers"] // 2
    with layer_scope("encoder_embedding"):
        x = tf.gather(variable("embedding", [cfg["vocab_size"], hidden], stddev=0.1), features["source"])
    for i in range(half):
        with layer_scope(f"encoder_lstm_{i}"):
            if i == 0:
                x = tf.concat([lstm(x, hidden, "fw"), lstm(x, hidden, "bw", reverse=True)], axis=2)
            else:
                y = lstm(x, hidden, "lstm")
                x = y + x if i >= 2 else y
    memory = x
    with layer_scope("decoder_embedding"):
        y = tf.gather(variable("embedding", [cfg["vocab_size"], hidden], stddev=0.1), features["target_in"])
    with layer_scope("decoder_lstm_0"):
        y = lstm(y, hidden, "lstm")
        keys = dense(memory, hidden, "attention_keys", use_bias=False)
        weights = tf.nn.softmax(tf.matmul(y, keys, transpose_b=True))
        context = tf.matmul(weights, memory)  # [batch, target time, encoder width]
    for i in range(1, half):
        with layer_scope(f"decoder_lstm_{i}"):
            out = lstm(tf.concat([y, context], axis=2), hidden, "lstm")
            y = out + y if i >= 2 else out
    with layer_scope("softmax"):
        logits = dense(tf.concat([y, context], axis=2), cfg["vocab_size"], "projection")
        return logits, (softmax_loss(logits, labels) if labels is not None else None)


def make(config="tiny", **overrides):
    cfg = resolve_config(PRESETS, config, overrides)
    if cfg["num_layers"] < 2 or cfg["num_layers"] % 2:
        raise ValueError(f"gnmt num_layers must be even and >= 2, got {cfg['num_layers']}")
    seq = (cfg["seq_len"],)
    tokens = InputSpec(seq, tf.int32, high=cfg["vocab_size"])
    return ModelSpec(
        "gnmt", cfg,
        model_fn=lambda f, labels: _build(f, labels, cfg)[1],
        feature_spec={"source": tokens, "target_in": tokens},
        label_spec=tokens,
        predict_fn=lambda f: _build(f, None, cfg)[0],
    )
