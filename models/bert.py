"""BERT (Devlin et al.) encoder with a sequence-classification head.

Layers: `embeddings` (token + position + segment embeddings, layer norm; also the attention-mask bias,
which every encoder layer consumes: a branching layer DAG), `encoder_0 .. encoder_{L-1}` (self-attention
and feed-forward, post-layer-norm, GELU), `head` (pooler on the first token, classifier, loss).
`paper` is BERT-Large width with 48 layers, as in DAPPLE's BERT-48 (about 640M parameters); `tiny` is
2 layers of width 32.
"""

import math

import tensorflow as tf

from models.base import InputSpec, ModelSpec, resolve_config
from models.ops import dense, gelu, layer_norm, layer_scope, softmax_loss, variable

PRESETS = {
    "paper": {"num_layers": 48, "hidden": 1024, "heads": 16, "ffn": 4096, "vocab_size": 30522,
              "max_positions": 512, "type_vocab": 2, "seq_len": 128, "num_classes": 2},
    "tiny": {"num_layers": 2, "hidden": 32, "heads": 2, "ffn": 64, "vocab_size": 100,
             "max_positions": 64, "type_vocab": 2, "seq_len": 16, "num_classes": 2},
}


def _embeddings(features, cfg):
    ids, segments = features["input_ids"], features["segment_ids"]
    seq_len, hidden = int(ids.shape[1]), cfg["hidden"]
    word = variable("word_embeddings", [cfg["vocab_size"], hidden], stddev=0.02)
    position = variable("position_embeddings", [cfg["max_positions"], hidden], stddev=0.02)
    segment = variable("segment_embeddings", [cfg["type_vocab"], hidden], stddev=0.02)
    x = tf.gather(word, ids) + tf.gather(segment, segments) + position[:seq_len]
    x = layer_norm(x, "ln")
    mask = tf.cast(features["input_mask"], tf.float32)
    mask_bias = (1.0 - mask[:, tf.newaxis, tf.newaxis, :]) * -10000.0
    return x, mask_bias


def _encoder(x, mask_bias, cfg):
    seq_len, hidden, heads = int(x.shape[1]), cfg["hidden"], cfg["heads"]
    head_dim = hidden // heads
    flat = tf.reshape(x, [-1, hidden])

    def split_heads(t):
        return tf.transpose(tf.reshape(t, [-1, seq_len, heads, head_dim]), [0, 2, 1, 3])

    q = split_heads(dense(flat, hidden, "query", stddev=0.02))
    k = split_heads(dense(flat, hidden, "key", stddev=0.02))
    v = split_heads(dense(flat, hidden, "value", stddev=0.02))
    scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(head_dim)) + mask_bias
    context = tf.matmul(tf.nn.softmax(scores), v)
    context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [-1, hidden])
    attn = layer_norm(dense(context, hidden, "attention_output", stddev=0.02) + flat, "attention_ln")
    ffn = dense(dense(attn, cfg["ffn"], "intermediate", activation=gelu, stddev=0.02), hidden, "output",
                stddev=0.02)
    return tf.reshape(layer_norm(ffn + attn, "output_ln"), [-1, seq_len, hidden])


def _build(features, labels, cfg):
    with layer_scope("embeddings"):
        x, mask_bias = _embeddings(features, cfg)
    for i in range(cfg["num_layers"]):
        with layer_scope(f"encoder_{i}"):
            x = _encoder(x, mask_bias, cfg)
    with layer_scope("head"):
        pooled = dense(x[:, 0, :], cfg["hidden"], "pooler", activation=tf.tanh, stddev=0.02)
        logits = dense(pooled, cfg["num_classes"], "classifier", stddev=0.02)
        return logits, (softmax_loss(logits, labels) if labels is not None else None)


def make(config="tiny", **overrides):
    cfg = resolve_config(PRESETS, config, overrides)
    seq = (cfg["seq_len"],)
    features = {
        "input_ids": InputSpec(seq, tf.int32, high=cfg["vocab_size"]),
        "segment_ids": InputSpec(seq, tf.int32, high=cfg["type_vocab"]),
        "input_mask": InputSpec(seq, tf.int32, high=2),
    }
    return ModelSpec(
        "bert", cfg,
        model_fn=lambda f, labels: _build(f, labels, cfg)[1],
        feature_spec=features,
        label_spec=InputSpec((), tf.int32, high=cfg["num_classes"]),
        predict_fn=lambda f: _build(f, None, cfg)[0],
    )
