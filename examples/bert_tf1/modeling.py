"""A BERT encoder written the way TF1 BERT code is: a variable scope per layer, `tf.compat.v1.get_variable`,
the batch size read with `tf.shape` once and used by every reshape, and the attention mask built from the
input mask. A single-device model; docs/user_guide.md ("Porting a training script") says how it is pipelined.
"""

import math

import tensorflow.compat.v1 as tf

CONFIG = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
          "intermediate_size": 64, "max_position_embeddings": 32, "type_vocab_size": 2,
          "initializer_range": 0.02}


def dims_of(tensor):
    """The tensor's dimensions: Python ints where the static shape knows them, scalar tensors elsewhere."""
    static = tensor.shape.as_list()
    dynamic = tf.shape(tensor)
    return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


def initializer(config):
    return tf.truncated_normal_initializer(stddev=config["initializer_range"])


def layer_norm(x, name="LayerNorm"):
    with tf.variable_scope(name):
        width = x.shape[-1]
        gamma = tf.get_variable("gamma", [width], initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", [width], initializer=tf.zeros_initializer())
        mean, variance = tf.nn.moments(x, [-1], keepdims=True)
        return (x - mean) * tf.rsqrt(variance + 1e-12) * gamma + beta


def dense(x, units, name, config, activation=None):
    with tf.variable_scope(name):
        kernel = tf.get_variable("kernel", [x.shape[-1], units], initializer=initializer(config))
        bias = tf.get_variable("bias", [units], initializer=tf.zeros_initializer())
        y = tf.nn.bias_add(tf.matmul(x, kernel), bias)
        return activation(y) if activation is not None else y


def gelu(x):
    return 0.5 * x * (1.0 + tf.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * tf.pow(x, 3))))


def embeddings(input_ids, token_type_ids, config):
    """Word + token type + position embeddings, normalized: [batch, seq, hidden]."""
    batch_size, seq_length = dims_of(input_ids)
    width = config["hidden_size"]
    table = tf.get_variable("word_embeddings", [config["vocab_size"], width], initializer=initializer(config))
    output = tf.gather(table, input_ids)
    types = tf.get_variable("token_type_embeddings", [config["type_vocab_size"], width],
                            initializer=initializer(config))
    flat_types = tf.reshape(token_type_ids, [-1])
    output += tf.reshape(tf.matmul(tf.one_hot(flat_types, config["type_vocab_size"]), types),
                         [batch_size, seq_length, width])
    positions = tf.get_variable("position_embeddings", [config["max_position_embeddings"], width],
                                initializer=initializer(config))
    output += tf.expand_dims(tf.slice(positions, [0, 0], [seq_length, -1]), 0)
    return layer_norm(output)


def attention_mask(from_tensor, input_mask):
    """[batch, from_seq, to_seq] ones where attention may look, from the [batch, to_seq] input mask."""
    batch_size, from_length = dims_of(from_tensor)[:2]
    to_length = dims_of(input_mask)[1]
    to_mask = tf.cast(tf.reshape(input_mask, [batch_size, 1, to_length]), tf.float32)
    return tf.ones([batch_size, from_length, 1], tf.float32) * to_mask


def attention(x, mask, batch_size, seq_length, config):
    """Self-attention over x, [batch * seq, hidden] -> [batch * seq, hidden]."""
    heads = config["num_attention_heads"]
    size = config["hidden_size"] // heads

    def by_head(t):
        return tf.transpose(tf.reshape(t, [batch_size, seq_length, heads, size]), [0, 2, 1, 3])

    query = by_head(dense(x, heads * size, "query", config))
    key = by_head(dense(x, heads * size, "key", config))
    value = by_head(dense(x, heads * size, "value", config))
    scores = tf.matmul(query, key, transpose_b=True) * (1.0 / math.sqrt(size))
    scores += (1.0 - tf.expand_dims(mask, 1)) * -10000.0
    context = tf.matmul(tf.nn.softmax(scores), value)
    return tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [batch_size * seq_length, heads * size])


def encoder(x, mask, config):
    """The transformer layers, each in variable scope layer_<i>: [batch, seq, hidden] -> the same."""
    batch_size, seq_length, width = dims_of(x)
    hidden = tf.reshape(x, [-1, width])
    for i in range(config["num_hidden_layers"]):
        with tf.variable_scope(f"layer_{i}"):
            with tf.variable_scope("attention"):
                with tf.variable_scope("self"):
                    context = attention(hidden, mask, batch_size, seq_length, config)
                with tf.variable_scope("output"):
                    attended = layer_norm(dense(context, width, "dense", config) + hidden)
            with tf.variable_scope("intermediate"):
                inner = dense(attended, config["intermediate_size"], "dense", config, activation=gelu)
            with tf.variable_scope("output"):
                hidden = layer_norm(dense(inner, width, "dense", config) + attended)
    return tf.reshape(hidden, [batch_size, seq_length, width])


def bert(input_ids, input_mask, token_type_ids, config):
    """The encoder's output for the first token, pooled: [batch, hidden]."""
    with tf.variable_scope("bert"):
        with tf.variable_scope("embeddings"):
            x = embeddings(input_ids, token_type_ids, config)
        with tf.variable_scope("encoder"):
            sequence = encoder(x, attention_mask(input_ids, input_mask), config)
        with tf.variable_scope("pooler"):
            first = tf.squeeze(sequence[:, 0:1, :], axis=1)
            return dense(first, config["hidden_size"], "dense", config, activation=tf.tanh)
