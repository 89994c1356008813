"""model_fns that build their own training step the ways TF1 scripts do (test_script_training.py and
script_tf1_probe.py train each on one device as written and pipelined, unchanged).

Each returns Spec(loss, train_op). `bn=True` normalizes the input with its batch statistics (tf.nn.moments, moving
averages assigned in UPDATE_OPS, as slim writes batch norm); the idioms:
- group:      train_op = tf.group(optimizer.minimize(loss, global_step), update_ops), piecewise learning rate
- control:    with tf.control_dependencies(update_ops): train_op = optimizer.minimize(loss, global_step)
- group_more: the update ops listed in tf.group beside a counter's increment
- scaled:     compute_gradients(loss * 128), then g / 128, clip_by_norm per gradient, one variable left out
- bert:       tf.gradients(loss, tvars), tf.clip_by_global_norm, Adam's apply_gradients(zip(...)) without the
              global step, then global_step.assign_add(1) under a control dependency on it (TF1 BERT)
- ema:        minimize, then ExponentialMovingAverage(0.9).apply(trainable variables) under a control dependency
- adam:       AdamOptimizer's minimize (not in IDIOMS: tests/test_per_host.py trains it per host)
And the same for gathered rows (an embedding table): sparse_clip (tf.gradients + clip_by_global_norm + Adam),
sparse_unscale (loss scaled by 8, rows divided back, then clipped), sparse_clip_norm (clip_by_norm per gradient).
Mixed precision as TF1 scripts write it (MIXED_IDIOMS, `mixed_model_fn`): float32 variables read in float16 or
bfloat16 through a custom getter (TF1's official ResNet's _custom_dtype_getter), logits cast back to float32 for the
loss, the loss scaled before differentiating and the gradients unscaled before Momentum's apply_gradients.
"""

import collections

import numpy as np
import tensorflow as tf

import dapple_tf

v1 = tf.compat.v1
Spec = collections.namedtuple("Spec", ["loss", "train_op"])  # what an EstimatorSpec holds that training reads
IDIOMS = ("group", "control", "group_more", "scaled", "bert", "ema")
SPARSE_IDIOMS = ("sparse_clip", "sparse_unscale", "sparse_clip_norm")
LOSS_SCALE = 1000.0  # not a power of two: scaling rounds, in bfloat16 too
SMALL = 2.0 ** -14  # a loss weight that leaves float16 gradients below its normal range unless the loss is scaled
# idiom -> (compute dtype, scaling, initial loss scale); scaling:
# - fixed:    compute_gradients(loss * s), each gradient / s (the official ResNet's loss_scale)
# - wrapper:  its minimize through tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(optimizer, s)
# - dynamic:  the same with a DynamicLossScale doubling every step; from 2**20 float16 overflows: the first steps
#             are skipped and the scale halved
# - variable: the script's own loss-scale variable, doubled after every apply_gradients
# - rewrite:  tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite (dynamic; it turns grappler's
#             float16 rewrite on for every later session of the process: disable it after)
# "small": the loss weighted by SMALL (the learning rate divided by it) and scaled by 2**16, fixed
MIXED_IDIOMS = {
    "fp16_fixed": (tf.float16, "fixed", LOSS_SCALE), "bf16_fixed": (tf.bfloat16, "fixed", LOSS_SCALE),
    "fp32_fixed": (tf.float32, "fixed", LOSS_SCALE), "fp16_dynamic": (tf.float16, "dynamic", LOSS_SCALE),
    "bf16_dynamic": (tf.bfloat16, "dynamic", LOSS_SCALE), "fp32_dynamic": (tf.float32, "dynamic", LOSS_SCALE),
    "fp16_overflow": (tf.float16, "dynamic", 2.0 ** 20), "fp16_variable": (tf.float16, "variable", LOSS_SCALE),
    "bf16_variable": (tf.bfloat16, "variable", LOSS_SCALE), "fp32_variable": (tf.float32, "variable", LOSS_SCALE),
    "fp16_wrapper": (tf.float16, "wrapper", LOSS_SCALE), "rewrite": (tf.float32, "rewrite", LOSS_SCALE),
    "fp16_small": (tf.float16, "fixed", 2.0 ** 16, SMALL), "fp32_small": (tf.float32, "fixed", 2.0 ** 16, SMALL)}
IN, HIDDEN, CLASSES, VOCAB = 6, 8, 3, 12
_CPU = "/device:CPU:{}".format
# (stages, M, build_pipeline options): BN models at M=1 (each micro-batch would be batch norm's batch), statistics
# synchronized across the 2 replicas; BN-free ones at M=4
BN_CASES = [([("in", "mid", [_CPU(0), _CPU(1)]), ("head", "head", [_CPU(2)])], 1, dict(batch_norm="sync", **build))
            for build in (dict(schedule="dapple", stage_functions=False), dict(schedule="zb-h1", stage_functions=True))]
FREE_CASES = [([("in", "in", [_CPU(0), _CPU(1)]), ("mid", "head", [_CPU(2)])], 4, build)
              for build in (dict(schedule="dapple", stage_functions=True), dict(schedule="zb-h1", stage_functions=False))]
SPARSE_STAGES = [("in", "in", [_CPU(0), _CPU(1)]), ("mid", "head", [_CPU(2)])]


def batch(n=16, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, IN).astype(np.float32), rng.randint(0, CLASSES, n).astype(np.int32)


def ids_batch(n=16, seed=1):
    rng = np.random.RandomState(seed)
    return rng.randint(0, VOCAB, (n, 3)).astype(np.int32), rng.randint(0, CLASSES, n).astype(np.int32)


def _update_ops():
    return v1.get_collection(v1.GraphKeys.UPDATE_OPS)


def _dense_loss(features, labels, bn):
    with dapple_tf.layer("in"):
        if bn:
            mean, variance = tf.nn.moments(features, [0])
            moving_mean = v1.get_variable("moving_mean", initializer=tf.zeros([IN]), trainable=False)
            moving_var = v1.get_variable("moving_var", initializer=tf.ones([IN]), trainable=False)
            for moving, value in ((moving_mean, mean), (moving_var, variance)):
                v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, moving.assign_sub((moving - value) * 0.1))
            features = (features - mean) * tf.math.rsqrt(variance + 1e-3)
        h = tf.tanh(tf.matmul(features, v1.get_variable("w_in", [IN, HIDDEN])) + v1.get_variable(
            "b_in", initializer=tf.fill([HIDDEN], 0.1)))
    return _mid_and_head(h, labels)


def _sparse_loss(ids, labels):
    with dapple_tf.layer("in"):
        table = v1.get_variable("table", [VOCAB, HIDDEN], initializer=v1.random_normal_initializer(stddev=2.0))
        h = tf.reduce_mean(tf.gather(table, ids), axis=1)
    return _mid_and_head(h, labels)


def _mid_and_head(h, labels):
    with dapple_tf.layer("mid"):
        h = tf.tanh(tf.matmul(h, v1.get_variable("w_mid", [HIDDEN, HIDDEN])))
    with dapple_tf.layer("head"):
        logits = tf.matmul(h, v1.get_variable("w_out", [HIDDEN, CLASSES]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _unscaled(grad, scale):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / scale, grad.indices, grad.dense_shape)
    return grad / scale


def cast_getter(getter, name, shape=None, dtype=None, *args, **kwargs):
    """A custom getter as TF1's official ResNet writes it (_custom_dtype_getter): a variable asked for in a
    low-precision dtype is made in float32 and read through a cast."""
    if dtype in (tf.float16, tf.bfloat16):
        return tf.cast(getter(name, shape, tf.float32, *args, **kwargs), dtype, name=f"{name}_cast")
    return getter(name, shape, dtype, *args, **kwargs)


def mixed_loss(features, labels, dtype, weight=1.0):
    """The dense model computed in `dtype` from float32 variables; the loss in float32, times `weight`."""
    with v1.variable_scope("model", custom_getter=cast_getter):
        with dapple_tf.layer("in"):
            h = tf.tanh(tf.matmul(tf.cast(features, dtype), v1.get_variable("w_in", [IN, HIDDEN], dtype)) +
                        v1.get_variable("b_in", [HIDDEN], dtype, initializer=v1.constant_initializer(0.1)))
        with dapple_tf.layer("mid"):
            h = tf.tanh(tf.matmul(h, v1.get_variable("w_mid", [HIDDEN, HIDDEN], dtype)))
        with dapple_tf.layer("head"):
            logits = tf.cast(tf.matmul(h, v1.get_variable("w_out", [HIDDEN, CLASSES], dtype)), tf.float32)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)) * weight


def mixed_model_fn(dtype, scaling: str, scale: float, weight: float = 1.0):
    """The model_fn of a MIXED_IDIOMS entry (see there); the loss times `weight`, the learning rate divided by it."""

    def fn(features, labels):
        loss = mixed_loss(features, labels, dtype, weight)
        global_step = v1.train.get_or_create_global_step()
        optimizer = v1.train.MomentumOptimizer(0.1 / weight, 0.9)
        if scaling in ("wrapper", "dynamic"):
            loss_scale = v1.mixed_precision.DynamicLossScale(initial_loss_scale=scale, increment_period=1) \
                if scaling == "dynamic" else scale
            optimizer = v1.mixed_precision.MixedPrecisionLossScaleOptimizer(optimizer, loss_scale)
            return Spec(loss, optimizer.minimize(loss, global_step))
        if scaling == "rewrite":
            optimizer = v1.mixed_precision.enable_mixed_precision_graph_rewrite(optimizer)
            return Spec(loss, optimizer.minimize(loss, global_step))
        loss_scale = scale if scaling == "fixed" else v1.get_variable("loss_scale", initializer=scale,
                                                                      trainable=False)
        pairs = [(g / loss_scale, v) for g, v in optimizer.compute_gradients(loss * loss_scale)]
        train_op = optimizer.apply_gradients(pairs, global_step)
        if scaling == "variable":
            with tf.control_dependencies([train_op]):
                train_op = loss_scale.assign(loss_scale * 2.0).op
        return Spec(loss, train_op)

    return fn


def model_fn(idiom: str, bn: bool = False):
    """The model_fn of `idiom` (IDIOMS on the dense model, SPARSE_IDIOMS on the embedding model, MIXED_IDIOMS in
    mixed precision)."""
    if idiom in MIXED_IDIOMS:
        return mixed_model_fn(*MIXED_IDIOMS[idiom])

    def fn(features, labels):
        sparse = idiom.startswith("sparse")
        loss = _sparse_loss(features, labels) if sparse else _dense_loss(features, labels, bn)
        global_step = v1.train.get_or_create_global_step()
        if idiom in ("bert", "sparse_clip"):
            optimizer = v1.train.AdamOptimizer(0.05)
            tvars = v1.trainable_variables()
            grads, _ = tf.clip_by_global_norm(tf.gradients(loss, tvars), clip_norm=0.5)
            train_op = optimizer.apply_gradients(zip(grads, tvars))
            with tf.control_dependencies([train_op]):
                return Spec(loss, tf.group(train_op, global_step.assign_add(1), *_update_ops()))
        learning_rate = v1.train.piecewise_constant(global_step, [1], [0.1, 0.05])
        optimizer = v1.train.MomentumOptimizer(learning_rate, 0.9)
        if idiom == "group":
            minimize_op = optimizer.minimize(loss, global_step)
            return Spec(loss, tf.group(minimize_op, _update_ops()))
        if idiom == "control":
            with tf.control_dependencies(_update_ops()):
                return Spec(loss, optimizer.minimize(loss, global_step))
        if idiom == "group_more":
            counter = v1.get_variable("steps_seen", initializer=0, trainable=False)
            return Spec(loss, tf.group(optimizer.minimize(loss, global_step), *_update_ops(), counter.assign_add(1)))
        if idiom in ("scaled", "sparse_unscale"):
            pairs = [(_unscaled(g, 128.0), v) for g, v in optimizer.compute_gradients(loss * 128.0)]
            if idiom == "scaled":
                pairs = [(tf.clip_by_norm(g, 0.2), v) for g, v in pairs if v.op.name != "b_in"]
            else:
                grads, _ = tf.clip_by_global_norm([g for g, _ in pairs], 0.5)
                pairs = list(zip(grads, [v for _, v in pairs]))
            with tf.control_dependencies(_update_ops()):
                return Spec(loss, optimizer.apply_gradients(pairs, global_step))
        if idiom == "sparse_clip_norm":
            pairs = [(tf.clip_by_norm(g, 0.2), v) for g, v in optimizer.compute_gradients(loss)]
            return Spec(loss, optimizer.apply_gradients(pairs, global_step))
        if idiom == "adam":  # Adam's own minimize: its beta powers are variables of the optimizer, not of a slot
            return Spec(loss, v1.train.AdamOptimizer(0.05).minimize(loss, global_step))
        if idiom == "ema":
            train_op = optimizer.minimize(loss, global_step)
            averages = v1.train.ExponentialMovingAverage(0.9)
            with tf.control_dependencies([train_op]):
                train_op = averages.apply(v1.trainable_variables())
            return Spec(loss, tf.group(train_op, *_update_ops()))
        raise ValueError(f"unknown idiom {idiom!r}")

    return fn


def micro_batch_reference(micro_batches: int):
    """One device normalizing as a pipeline at M micro-batches does: the batch split into M parts along the batch,
    the model on each (variables reused), the losses averaged; Momentum as the `control` idiom has it."""

    def fn(features, labels):
        losses = []
        for x, y in zip(tf.split(features, micro_batches), tf.split(labels, micro_batches)):
            with v1.variable_scope(v1.get_variable_scope(), reuse=v1.AUTO_REUSE):
                losses.append(_dense_loss(x, y, bn=True))
        loss = tf.add_n(losses) / micro_batches
        global_step = v1.train.get_or_create_global_step()
        learning_rate = v1.train.piecewise_constant(global_step, [1], [0.1, 0.05])
        return Spec(loss, v1.train.MomentumOptimizer(learning_rate, 0.9).minimize(loss, global_step))

    return fn
