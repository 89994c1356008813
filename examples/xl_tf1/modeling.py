"""A Transformer-XL encoder written the way TF1 Transformer-XL / XLNet code is: time-major activations
`[len, batch, d_model]` throughout, relative multi-head attention with einsum ('ibnd,jbnd->ijbn'), per-layer
biases sliced from one `[n_layer, n_head, d_head]` variable per kind (`r_w_bias[i]`, `r_r_bias[i]`,
`r_s_bias[i]`), and the attention mask `[qlen, klen, bsz, 1]`, the segment matrix `[qlen, klen, bsz, 2]` and the
relative position encoding `[klen + qlen, bsz, d_model]` built once before the first layer. Variables with
`tf.compat.v1.get_variable` (no tf.layers, no contrib). A single-device model; docs/user_guide.md ("Porting a
training script") says how it is pipelined.
"""

import tensorflow.compat.v1 as tf

CONFIG = {"vocab_size": 100, "n_layer": 4, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 64,
          "initializer_range": 0.02, "ff_activation": "gelu"}


def initializer(config):
    return tf.initializers.random_normal(stddev=config["initializer_range"])


def gelu(x):
    """The tanh approximation of GELU."""
    cdf = 0.5 * (1.0 + tf.tanh(0.7978845608028654 * (x + 0.044715 * tf.pow(x, 3))))
    return x * cdf


def layer_norm(x, scope="LayerNorm"):
    """Normalizes the last axis, with a gain and a bias (as tf.contrib.layers.layer_norm, begin_norm_axis=-1)."""
    with tf.variable_scope(scope):
        width = x.shape[-1]
        beta = tf.get_variable("beta", [width], initializer=tf.zeros_initializer())
        gamma = tf.get_variable("gamma", [width], initializer=tf.ones_initializer())
        mean, variance = tf.nn.moments(x, [-1], keep_dims=True)
        return (x - mean) * tf.rsqrt(variance + 1e-12) * gamma + beta


def dense(x, units, kernel_initializer, name, activation=None):
    """A position-wise dense layer over the last axis of a [len, bsz, d] tensor."""
    with tf.variable_scope(name):
        kernel = tf.get_variable("kernel", [x.shape[-1], units], initializer=kernel_initializer)
        bias = tf.get_variable("bias", [units], initializer=tf.zeros_initializer())
        y = tf.einsum("ibh,hk->ibk", x, kernel) + bias
        return activation(y) if activation is not None else y


def embedding_lookup(x, n_token, d_embed, kernel_initializer, scope="word_embedding"):
    """Token embeddings of the [len, bsz] ids x: [len, bsz, d_embed], and the table."""
    with tf.variable_scope(scope):
        lookup_table = tf.get_variable("lookup_table", [n_token, d_embed], initializer=kernel_initializer)
        return tf.nn.embedding_lookup(lookup_table, x), lookup_table


def positional_embedding(pos_seq, inv_freq, bsz=None):
    """Sinusoids of the positions pos_seq: [len, 1, d_model], tiled to [len, bsz, d_model] when bsz is given."""
    sinusoid_inp = tf.einsum("i,d->id", pos_seq, inv_freq)
    pos_emb = tf.concat([tf.sin(sinusoid_inp), tf.cos(sinusoid_inp)], -1)
    pos_emb = pos_emb[:, None, :]
    if bsz is not None:
        pos_emb = tf.tile(pos_emb, [1, bsz, 1])
    return pos_emb


def relative_positional_encoding(qlen, klen, d_model, bsz=None):
    """The encodings of the relative distances klen, klen - 1, ..., -qlen + 1 (bidirectional attention)."""
    freq_seq = tf.range(0, d_model, 2.0)
    inv_freq = 1.0 / (10000 ** (freq_seq / d_model))
    fwd_pos_seq = tf.range(tf.cast(klen, tf.float32), tf.cast(-qlen, tf.float32), -1.0)
    return positional_embedding(fwd_pos_seq, inv_freq, bsz)


def head_projection(h, d_model, n_head, d_head, kernel_initializer, name):
    """[len, bsz, d_model] -> [len, bsz, n_head, d_head]."""
    proj_weight = tf.get_variable(f"{name}/kernel", [d_model, n_head, d_head], initializer=kernel_initializer)
    return tf.einsum("ibh,hnd->ibnd", h, proj_weight)


def rel_shift(x, klen):
    """Shifts the position scores [qlen, rlen, bsz, n_head] so that entry (i, j) scores the distance i - j."""
    x_size = tf.shape(x)
    x = tf.reshape(x, [x_size[1], x_size[0], x_size[2], x_size[3]])
    x = tf.slice(x, [1, 0, 0, 0], [-1, -1, -1, -1])
    x = tf.reshape(x, [x_size[0], x_size[1] - 1, x_size[2], x_size[3]])
    return tf.slice(x, [0, 0, 0, 0], [-1, klen, -1, -1])


def rel_attn_core(q_head, k_head_h, v_head_h, k_head_r, seg_embed, seg_mat, r_w_bias, r_r_bias, r_s_bias,
                  attn_mask, scale):
    """Scores from content (ac), relative position (bd) and segment (ef); the attention vector."""
    ac = tf.einsum("ibnd,jbnd->ijbn", q_head + r_w_bias, k_head_h)
    bd = tf.einsum("ibnd,jbnd->ijbn", q_head + r_r_bias, k_head_r)
    bd = rel_shift(bd, klen=tf.shape(ac)[1])
    ef = tf.einsum("ibnd,snd->ibns", q_head + r_s_bias, seg_embed)
    ef = tf.einsum("ijbs,ibns->ijbn", seg_mat, ef)
    attn_score = (ac + bd + ef) * scale
    attn_score = attn_score - 1e30 * attn_mask
    attn_prob = tf.nn.softmax(attn_score, 1)
    return tf.einsum("ijbn,jbnd->ibnd", attn_prob, v_head_h)


def post_attention(h, attn_vec, d_model, n_head, d_head, kernel_initializer):
    """The output projection, the residual and LayerNorm."""
    proj_o = tf.get_variable("o/kernel", [d_model, n_head, d_head], initializer=kernel_initializer)
    attn_out = tf.einsum("ibnd,hnd->ibh", attn_vec, proj_o)
    return layer_norm(attn_out + h)


def rel_multihead_attn(h, r, r_w_bias, r_r_bias, seg_mat, r_s_bias, seg_embed, attn_mask, d_model, n_head, d_head,
                       kernel_initializer, scope="rel_attn"):
    scale = 1.0 / (d_head ** 0.5)
    with tf.variable_scope(scope):
        q_head_h = head_projection(h, d_model, n_head, d_head, kernel_initializer, "q")
        k_head_h = head_projection(h, d_model, n_head, d_head, kernel_initializer, "k")
        v_head_h = head_projection(h, d_model, n_head, d_head, kernel_initializer, "v")
        k_head_r = head_projection(r, d_model, n_head, d_head, kernel_initializer, "r")
        attn_vec = rel_attn_core(q_head_h, k_head_h, v_head_h, k_head_r, seg_embed, seg_mat, r_w_bias, r_r_bias,
                                 r_s_bias, attn_mask, scale)
        return post_attention(h, attn_vec, d_model, n_head, d_head, kernel_initializer)


def positionwise_ffn(inp, d_model, d_inner, kernel_initializer, activation_type="relu", scope="ff"):
    activation = {"relu": tf.nn.relu, "gelu": gelu}[activation_type]
    with tf.variable_scope(scope):
        output = dense(inp, d_inner, kernel_initializer, "layer_1", activation=activation)
        output = dense(output, d_model, kernel_initializer, "layer_2")
        return layer_norm(output + inp)


def transformer_xl(inp_k, seg_id, input_mask, config, scope="transformer"):
    """The encoder over time-major inputs: inp_k, seg_id [len, bsz] ints, input_mask [len, bsz] floats, 1.0 at
    padding. Returns the last layer's output [len, bsz, d_model] and the embedding table."""
    n_layer, d_model = config["n_layer"], config["d_model"]
    n_head, d_head = config["n_head"], config["d_head"]
    kernel_initializer = initializer(config)
    with tf.variable_scope(scope):
        r_w_bias = tf.get_variable("r_w_bias", [n_layer, n_head, d_head], initializer=kernel_initializer)
        r_r_bias = tf.get_variable("r_r_bias", [n_layer, n_head, d_head], initializer=kernel_initializer)
        bsz = tf.shape(inp_k)[1]
        qlen = tf.shape(inp_k)[0]
        klen = qlen

        # attention mask [qlen, klen, bsz, 1]: 1.0 where a query may not look (padding), except at itself
        data_mask = input_mask[None]
        attn_mask = tf.cast(data_mask[:, :, :, None] > 0, tf.float32)
        non_tgt_mask = -tf.eye(qlen, dtype=tf.float32)
        non_tgt_mask = tf.cast((attn_mask + non_tgt_mask[:, :, None, None]) > 0, tf.float32)

        word_emb_k, lookup_table = embedding_lookup(inp_k, config["vocab_size"], d_model, kernel_initializer)
        output_h = word_emb_k

        # segment matrix [qlen, klen, bsz, 2]: one_hot(1 where query and key are in different segments)
        r_s_bias = tf.get_variable("r_s_bias", [n_layer, n_head, d_head], initializer=kernel_initializer)
        seg_embed = tf.get_variable("seg_embed", [n_layer, 2, n_head, d_head], initializer=kernel_initializer)
        seg_mat = tf.cast(tf.logical_not(tf.equal(seg_id[:, None], seg_id[None, :])), tf.int32)
        seg_mat = tf.one_hot(seg_mat, 2, dtype=tf.float32)

        # relative positional encoding [klen + qlen, bsz, d_model]
        pos_emb = relative_positional_encoding(qlen, klen, d_model, bsz=bsz)

        for i in range(n_layer):
            with tf.variable_scope(f"layer_{i}"):
                output_h = rel_multihead_attn(
                    h=output_h, r=pos_emb, r_w_bias=r_w_bias[i], r_r_bias=r_r_bias[i], seg_mat=seg_mat,
                    r_s_bias=r_s_bias[i], seg_embed=seg_embed[i], attn_mask=non_tgt_mask, d_model=d_model,
                    n_head=n_head, d_head=d_head, kernel_initializer=kernel_initializer)
                output_h = positionwise_ffn(output_h, d_model, config["d_inner"], kernel_initializer,
                                            activation_type=config["ff_activation"])
        return output_h, lookup_table


def summarize_sequence(hidden, d_model, initializer_, scope="sequence_summary"):
    """The last position's output (the classifier token), projected: [bsz, d_model]."""
    with tf.variable_scope(scope):
        summary = hidden[-1]
        kernel = tf.get_variable("summary/kernel", [d_model, d_model], initializer=initializer_)
        bias = tf.get_variable("summary/bias", [d_model], initializer=tf.zeros_initializer())
        return tf.tanh(tf.matmul(summary, kernel) + bias)


def classification_loss(hidden, labels, n_class, initializer_, scope):
    """Per-example cross entropy of a linear classifier on hidden [bsz, d] (None without labels), and the
    logits."""
    with tf.variable_scope(scope):
        kernel = tf.get_variable("logit/kernel", [hidden.shape[-1], n_class], initializer=initializer_)
        bias = tf.get_variable("logit/bias", [n_class], initializer=tf.zeros_initializer())
        logits = tf.matmul(hidden, kernel) + bias
        if labels is None:
            return None, logits
        one_hot_target = tf.one_hot(labels, n_class, dtype=hidden.dtype)
        per_example_loss = -tf.reduce_sum(tf.nn.log_softmax(logits) * one_hot_target, -1)
        return per_example_loss, logits
