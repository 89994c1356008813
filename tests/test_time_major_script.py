"""A time-major Transformer-XL-style script's own training step, pipelined unchanged (layers by scope): masks and a
position encoding built once before the first layer, per-layer biases sliced from one variable, Adam after
tf.clip_by_global_norm and layer-wise learning-rate decay (each gradient scaled by a constant chosen by a regex on its
variable's name); every global variable equal to the script on one device."""

import re

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from tests.pipeline_harness import cpu
from tests.script_harness import Spec, initial_values, largest_difference, train_one_device, train_pipelined

v1 = tf.compat.v1
LAYERS, LENGTH, DIM, HEADS, VOCAB, CLASSES, DECAY = 3, 6, 8, 2, 17, 3, 0.5
STEPS = 3


def _einsum_attention(h, mask, pos, r_w_bias, r_r_bias, i):
    """Relative attention of layer i on h [len, batch, dim], as XLNet writes it (heads split with a reshape)."""
    head = DIM // HEADS
    q, k, v = (tf.reshape(tf.einsum("ibh,hd->ibd", h, v1.get_variable(name, [DIM, DIM])), [LENGTH, -1, HEADS, head])
               for name in ("q", "k", "v"))
    r = tf.reshape(tf.einsum("ibh,hd->ibd", pos, v1.get_variable("r", [DIM, DIM])), [LENGTH, -1, HEADS, head])
    content = tf.einsum("ibnd,jbnd->ijbn", q + r_w_bias[i], k)
    position = tf.einsum("ibnd,jbnd->ijbn", q + r_r_bias[i], r)
    scores = (content + position) / np.sqrt(head) - 1e4 * mask  # mask [q, k, batch, 1]
    weights = tf.nn.softmax(scores, axis=1)
    out = tf.reshape(tf.einsum("ijbn,jbnd->ibnd", weights, v), [LENGTH, -1, DIM])
    return tf.tanh(out + h)


def model_fn(features, labels):
    ids = tf.transpose(features["ids"], [1, 0])  # [len, batch]
    keep = tf.cast(tf.transpose(features["mask"], [1, 0]), tf.float32)
    # built once, before the first layer, read by every layer
    mask = (1.0 - keep)[None, :, :, None] * tf.ones([LENGTH, 1, 1, 1])  # [q, k, batch, 1]
    bsz = tf.shape(ids)[1]
    positions = tf.range(LENGTH, dtype=tf.float32)[:, None] / tf.pow(10.0, tf.range(DIM, dtype=tf.float32)[None] / DIM)
    pos = tf.tile(tf.sin(positions)[:, None, :], [1, bsz, 1])  # [len, batch, dim]
    with v1.variable_scope("model", initializer=v1.glorot_uniform_initializer(seed=3)):
        r_w_bias = v1.get_variable("r_w_bias", [LAYERS, HEADS, DIM // HEADS])
        r_r_bias = v1.get_variable("r_r_bias", [LAYERS, HEADS, DIM // HEADS])
        with v1.variable_scope("embedding"):
            h = tf.nn.embedding_lookup(v1.get_variable("table", [VOCAB, DIM]), ids)
        for i in range(LAYERS):
            with v1.variable_scope(f"layer_{i}"):
                h = _einsum_attention(h, mask, pos, r_w_bias, r_r_bias, i)
        with v1.variable_scope("head"):
            logits = tf.matmul(h[-1], v1.get_variable("out", [DIM, CLASSES]))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    global_step = v1.train.get_or_create_global_step()
    learning_rate = tf.where(global_step < 2, 0.01 * tf.cast(global_step + 1, tf.float32) / 2,
                             v1.train.polynomial_decay(0.01, global_step, 10, 0.0))
    tvars = v1.trainable_variables()
    grads, _ = tf.clip_by_global_norm(tf.gradients(loss, tvars), 1.0)
    for j, variable in enumerate(tvars):  # layer-wise learning-rate decay
        found = re.search(r"layer_(\d+)/", variable.name)
        if found:
            grads[j] = grads[j] * DECAY ** (LAYERS - 1 - int(found.group(1)))
    train_op = v1.train.AdamOptimizer(learning_rate).apply_gradients(zip(grads, tvars), global_step)
    return Spec(loss, train_op)


LAYER_SCOPES = dapple_tf.layers_by_scope(patterns=["model/embedding", "model/layer_*", "model/head"])


def batch(n=16, seed=5):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(3, LENGTH + 1, size=n)
    return ({"ids": rng.randint(0, VOCAB, size=(n, LENGTH)).astype(np.int32),
             "mask": (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)},
            rng.randint(0, CLASSES, size=n).astype(np.int32))


PLANS = {
    "straight-M1": ([(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], 1, {}),
    "straight-M4-zb-h1": ([(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], 4, {"schedule": "zb-h1"}),
    "2:1-M4": ([(0, 2, [cpu(0), cpu(1)]), (3, 4, [cpu(2)])], 4, {}),
    "2:1-M4-functions-recompute": ([(0, 2, [cpu(0), cpu(1)]), (3, 4, [cpu(2)])], 4,
                                   {"stage_functions": True, "recompute": True}),
}


@pytest.mark.parametrize("name", PLANS)
def test_time_major_script_trains_as_on_one_device(name):
    stages, micro_batches, build = PLANS[name]
    x, y = batch()
    initial = initial_values(model_fn, x, y)
    want, want_losses = train_one_device(model_fn, x, y, STEPS, initial)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=micro_batches)
    got, got_losses = train_pipelined(model_fn, x, y, plan, STEPS, initial, layers=LAYER_SCOPES, **build)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    # (not bit for bit at M=1: the shared biases' gradient adds the stages' sums of their layers' contributions, one
    # device adds the three at once; the first step is bit for bit, the rounding then moves everything by ~1e-8)
    assert largest_difference(want, got) < 1e-5
    assert int(got["global_step"]) == STEPS
    # the decay reached the layers: the first layer moved less than without it would have
    assert not np.array_equal(got["model/layer_0/q"], initial["model/layer_0/q"])


@pytest.fixture
def control_flow_v1():
    """TF1 control flow (what disable_v2_behavior gives TF1 scripts) for this test only."""
    from tensorflow.python.ops import control_flow_util  # pylint: disable=import-outside-toplevel

    before = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    yield
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = before


def rnn_model_fn(features, labels):
    """A GNMT-style time-major dynamic_rnn whose input is the embedding layer's output: with TF1 control flow its
    TensorArray is written next to that input and read in the loop (template_devices.py)."""
    with v1.variable_scope("embed"):
        table = v1.get_variable("table", [VOCAB, DIM], initializer=v1.glorot_uniform_initializer(seed=1))
        inputs = tf.nn.embedding_lookup(table, tf.transpose(features["ids"], [1, 0]))  # [len, batch, dim]
    with v1.variable_scope("rnn"):
        cell = v1.nn.rnn_cell.BasicRNNCell(DIM)
        lengths = tf.reduce_sum(features["mask"], axis=1)
        outputs, _ = v1.nn.dynamic_rnn(cell, inputs, sequence_length=lengths, time_major=True, dtype=tf.float32)
    with v1.variable_scope("head"):
        logits = tf.matmul(outputs[-1], v1.get_variable("out", [DIM, CLASSES]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    tvars = v1.trainable_variables()
    grads = v1.gradients(loss, tvars, colocate_gradients_with_ops=True)
    return Spec(loss, v1.train.GradientDescentOptimizer(0.5).apply_gradients(zip(grads, tvars)))


def _legacy_rnn_cells() -> bool:
    """Whether tf.compat.v1.nn.rnn_cell's cells exist (not with Keras 3: TF 2.16 on)."""
    try:
        v1.nn.rnn_cell.BasicRNNCell(1)
    except (AttributeError, ImportError):
        return False
    return True


@pytest.mark.skipif(not _legacy_rnn_cells(), reason="tf.compat.v1.nn.rnn_cell's cells are gone with Keras 3")
@pytest.mark.parametrize("stages", [[(0, 0, [cpu(0)]), (1, 2, [cpu(1)])], [(0, 0, [cpu(0), cpu(1)]), (1, 2, [cpu(2)])]],
                         ids=["straight", "2:1"])
def test_dynamic_rnn_fed_by_an_earlier_stage(control_flow_v1, stages):
    """The loop's TensorArray spans the embedding's stage and the loop's in the template; the session refused it
    ('Cannot colocate nodes ... incompatible ids') until the template's placement put each TensorArray on one device."""
    x, y = batch()
    initial = initial_values(rnn_model_fn, x, y)
    want, _ = train_one_device(rnn_model_fn, x, y, STEPS, initial)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    got, _ = train_pipelined(rnn_model_fn, x, y, plan, STEPS, initial, layers=dapple_tf.layers_by_scope(depth=1))
    assert largest_difference(want, got) < 1e-5
