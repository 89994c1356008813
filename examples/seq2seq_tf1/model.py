"""A GNMT-style sequence-to-sequence model written the way TF1 NMT code is: time-major throughout (the batch-major
ids are transposed once, every activation after is `[time, batch, ...]`), a bidirectional LSTM layer then a stack
of LSTMs with a residual connection, each run by `tf.compat.v1.nn.(bidirectional_)dynamic_rnn(..., time_major=True)`
with the sentences' lengths, a decoder LSTM stack started from the encoder's final state and fed the target
(teacher forcing), Luong attention over the encoder's outputs computed with plain ops after the decoder's RNN,
the projection to the vocabulary, and NMT's loss: the masked cross entropy summed over time, averaged over the
batch. The training step as NMT writes it: warmup and decay of the learning rate with `tf.cond` on the global step,
`tf.gradients`, `tf.clip_by_global_norm`, `apply_gradients`. Variables take one seeded uniform initializer.
A single-device model; docs/user_guide.md ("Porting a training script") says how it is pipelined.

Scopes (the model's layers): dynamic_seq2seq/embeddings, dynamic_seq2seq/encoder/bidirectional_rnn,
dynamic_seq2seq/encoder/rnn, dynamic_seq2seq/decoder/rnn, dynamic_seq2seq/decoder/attention,
dynamic_seq2seq/decoder/output_projection.
"""

import math

import tensorflow.compat.v1 as tf

HPARAMS = {"src_vocab_size": 30, "tgt_vocab_size": 30, "embed_size": 16, "num_units": 32, "num_encoder_layers": 3,
           "num_decoder_layers": 2, "init_weight": 0.1, "random_seed": 7, "optimizer": "adam",
           "learning_rate": 0.01, "warmup_steps": 10, "warmup_scheme": "t2t", "decay_start": 200, "decay_steps": 100,
           "decay_factor": 0.5, "max_gradient_norm": 5.0, "colocate_gradients_with_ops": True}


def get_initializer(init_weight, seed):
    return tf.random_uniform_initializer(-init_weight, init_weight, seed=seed)


def single_cell(num_units, residual=False):
    cell = tf.nn.rnn_cell.LSTMCell(num_units, forget_bias=1.0)
    if residual:
        cell = tf.nn.rnn_cell.ResidualWrapper(cell)
    return cell


def cell_list(num_units, num_layers, num_residual_layers):
    """An LSTM per layer, the last num_residual_layers with a residual connection (as GNMT stacks them)."""
    return [single_cell(num_units, residual=i >= num_layers - num_residual_layers) for i in range(num_layers)]


def create_emb_for_encoder_and_decoder(src_vocab_size, tgt_vocab_size, embed_size):
    embedding_encoder = tf.get_variable("embedding_encoder", [src_vocab_size, embed_size], tf.float32)
    embedding_decoder = tf.get_variable("embedding_decoder", [tgt_vocab_size, embed_size], tf.float32)
    return embedding_encoder, embedding_decoder


def build_encoder(encoder_emb_inp, source_sequence_length, hparams):
    """A bidirectional LSTM, then num_encoder_layers - 1 LSTMs (the last residual): outputs [src_time, batch,
    num_units] and the stack's final states."""
    num_units = hparams["num_units"]
    with tf.variable_scope("encoder"):
        fw_cell, bw_cell = single_cell(num_units), single_cell(num_units)
        bi_outputs, _ = tf.nn.bidirectional_dynamic_rnn(
            fw_cell, bw_cell, encoder_emb_inp, dtype=tf.float32, sequence_length=source_sequence_length,
            time_major=True)
        bi_encoder_outputs = tf.concat(bi_outputs, -1)
        num_uni_layers = hparams["num_encoder_layers"] - 1
        uni_cell = tf.nn.rnn_cell.MultiRNNCell(cell_list(num_units, num_uni_layers, num_uni_layers - 1))
        encoder_outputs, encoder_state = tf.nn.dynamic_rnn(
            uni_cell, bi_encoder_outputs, dtype=tf.float32, sequence_length=source_sequence_length,
            time_major=True)
    return encoder_outputs, encoder_state


def luong_attention(decoder_outputs, memory, memory_sequence_length, num_units):
    """Luong's general score of each decoder output against the memory [src_time, batch, units], masked past
    each source's length, and the attention layer on [output; context]: [tgt_time, batch, num_units]."""
    memory_layer = tf.get_variable("memory_layer/kernel", [memory.shape[-1], num_units])
    keys = tf.einsum("sbh,hk->sbk", memory, memory_layer)
    score = tf.einsum("tbk,sbk->tbs", decoder_outputs, keys)
    score_mask = tf.sequence_mask(memory_sequence_length, maxlen=tf.shape(memory)[0], dtype=score.dtype)
    score += (1.0 - score_mask[None, :, :]) * -1e9
    alignments = tf.nn.softmax(score)
    context = tf.einsum("tbs,sbh->tbh", alignments, memory)
    attention_layer = tf.get_variable("attention_layer/kernel", [decoder_outputs.shape[-1] + memory.shape[-1],
                                                                  num_units])
    return tf.tanh(tf.einsum("tbi,ik->tbk", tf.concat([decoder_outputs, context], -1), attention_layer))


def build_decoder(decoder_emb_inp, target_sequence_length, encoder_outputs, encoder_state,
                  source_sequence_length, hparams):
    """The decoder stack started from the encoder's final states, fed the target (teacher forcing), attention
    over the encoder outputs, the vocabulary projection: logits [tgt_time, batch, tgt_vocab_size]."""
    num_units = hparams["num_units"]
    num_layers = hparams["num_decoder_layers"]
    with tf.variable_scope("decoder"):
        cell = tf.nn.rnn_cell.MultiRNNCell(cell_list(num_units, num_layers, num_layers - 1))
        decoder_outputs, _ = tf.nn.dynamic_rnn(
            cell, decoder_emb_inp, initial_state=encoder_state, sequence_length=target_sequence_length,
            time_major=True)
        with tf.variable_scope("attention"):
            attention_output = luong_attention(decoder_outputs, encoder_outputs, source_sequence_length, num_units)
        with tf.variable_scope("output_projection"):
            kernel = tf.get_variable("kernel", [num_units, hparams["tgt_vocab_size"]])
            logits = tf.einsum("tbh,hv->tbv", attention_output, kernel)
    return logits


def compute_loss(logits, target_output, target_sequence_length, batch_size):
    """The cross entropy of every target token, masked past each target's length, summed, over the batch size."""
    target_output = tf.transpose(target_output)
    max_time = tf.shape(target_output)[0]
    crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=target_output, logits=logits)
    target_weights = tf.sequence_mask(target_sequence_length, max_time, dtype=logits.dtype)
    target_weights = tf.transpose(target_weights)
    return tf.reduce_sum(crossent * target_weights) / tf.to_float(batch_size)


def build_graph(features, target_output, hparams):
    """The training loss and the logits. features: source, target_input [batch, time] ids and
    source_sequence_length, target_sequence_length [batch]; target_output [batch, tgt_time] ids (None: no loss)."""
    initializer = get_initializer(hparams["init_weight"], hparams["random_seed"])
    with tf.variable_scope("dynamic_seq2seq", initializer=initializer):
        source_sequence_length = features["source_sequence_length"]
        target_sequence_length = features["target_sequence_length"]
        batch_size = tf.size(source_sequence_length)
        source = tf.transpose(features["source"])  # time-major from here on
        target_input = tf.transpose(features["target_input"])
        with tf.variable_scope("embeddings"):
            embedding_encoder, embedding_decoder = create_emb_for_encoder_and_decoder(
                hparams["src_vocab_size"], hparams["tgt_vocab_size"], hparams["embed_size"])
            encoder_emb_inp = tf.nn.embedding_lookup(embedding_encoder, source)
            decoder_emb_inp = tf.nn.embedding_lookup(embedding_decoder, target_input)
        encoder_outputs, encoder_state = build_encoder(encoder_emb_inp, source_sequence_length, hparams)
        logits = build_decoder(decoder_emb_inp, target_sequence_length, encoder_outputs, encoder_state,
                               source_sequence_length, hparams)
        loss = None
        if target_output is not None:
            loss = compute_loss(logits, target_output, target_sequence_length, batch_size)
    return loss, logits


def get_learning_rate_warmup(learning_rate, global_step, hparams):
    """t2t's warmup: the rate times 0.01 ** ((warmup_steps - step) / warmup_steps) before warmup_steps."""
    warmup_steps = hparams["warmup_steps"]
    warmup_factor = tf.exp(math.log(0.01) / warmup_steps)
    inv_decay = warmup_factor ** tf.to_float(warmup_steps - global_step)
    return tf.cond(global_step < warmup_steps, lambda: inv_decay * learning_rate, lambda: learning_rate,
                   name="learning_rate_warmup_cond")


def get_learning_rate_decay(learning_rate, global_step, hparams):
    """Halved every decay_steps from decay_start on (staircase)."""
    start = hparams["decay_start"]
    return tf.cond(global_step < start, lambda: learning_rate,
                   lambda: tf.train.exponential_decay(learning_rate, global_step - start, hparams["decay_steps"],
                                                      hparams["decay_factor"], staircase=True),
                   name="learning_rate_decay_cond")


def build_train_op(loss, hparams):
    """The train op: the optimizer on the gradients clipped by their global norm; summaries of the rate, the
    loss and the gradients' norms."""
    global_step = tf.train.get_or_create_global_step()
    learning_rate = tf.constant(hparams["learning_rate"])
    learning_rate = get_learning_rate_warmup(learning_rate, global_step, hparams)
    learning_rate = get_learning_rate_decay(learning_rate, global_step, hparams)
    if hparams["optimizer"] == "sgd":
        opt = tf.train.GradientDescentOptimizer(learning_rate)
    elif hparams["optimizer"] == "adam":
        opt = tf.train.AdamOptimizer(learning_rate)
    else:
        raise ValueError(f"Unknown optimizer {hparams['optimizer']}")
    params = tf.trainable_variables()
    gradients = tf.gradients(loss, params, colocate_gradients_with_ops=hparams["colocate_gradients_with_ops"])
    clipped_gradients, gradient_norm = tf.clip_by_global_norm(gradients, hparams["max_gradient_norm"])
    tf.summary.scalar("lr", learning_rate)
    tf.summary.scalar("train_loss", loss)
    tf.summary.scalar("grad_norm", gradient_norm)
    tf.summary.scalar("clipped_gradient", tf.global_norm(clipped_gradients))
    return opt.apply_gradients(zip(clipped_gradients, params), global_step=global_step)
