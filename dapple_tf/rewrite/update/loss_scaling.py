"""Loss scaling as TF1 mixed-precision scripts write it: the loss scale in each clone's seed, and the v1
MixedPrecisionLossScaleOptimizer's dynamic scale applied on the pipeline's gradients.

A script computing in float16 or bfloat16 (float32 variables read through a custom getter's cast) scales its loss
before differentiating, so that its backward's small values stay in range. The pipeline differentiates each clone's
loss with the same scale in its seed (gradient_replay.loss_seed), not the unscaled loss with the gradients scaled
afterwards: exact in float32, not in float16 (docs/design.md, "The loss scale is in each clone's seed").
"""

import dataclasses
import functools

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.model.model_training import ModelTraining
from dapple_tf.rewrite.update import apply_step, gradient_replay
from dapple_tf.rewrite.update.replicas import VariableCopies


def loss_seed(model_train: ModelTraining):
    """What StageBuilder seeds each clone's loss gradient with: a script's loss scale times the clone's weight
    (gradient_replay.loss_seed), or None (the weight alone)."""
    script = model_train.script
    if script is None or not script.flow.loss_factors:
        return None
    return functools.partial(gradient_replay.loss_seed, script.flow.loss_factors)


def _wrapper_class():
    """tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer where TensorFlow still has it, else None."""
    return getattr(getattr(tf.compat.v1, "mixed_precision", None), "MixedPrecisionLossScaleOptimizer", None)


def refuse_wrapper(optimizer, what: str) -> None:
    """A loss-scaling optimizer wrapper scales the loss in its compute_gradients, which the pipeline never calls."""
    wrapper = _wrapper_class()
    if wrapper is not None and isinstance(optimizer, wrapper):
        raise DappleError(
            f"{what} is a tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer, which scales the loss in its "
            "compute_gradients; the pipeline differentiates each micro-batch's loss itself and would leave the loss "
            "scale out. Call the wrapper's minimize (or compute_gradients and apply_gradients) in model_fn and pass "
            "optimizer=None: the pipeline then seeds every micro-batch's gradient with the loss scale")


def scales_dynamically(optimizer) -> bool:
    """Whether `optimizer` is a v1 MixedPrecisionLossScaleOptimizer with a dynamic loss scale, which applies its step
    only when every gradient is finite (per-host graphs refuse it: hosts/lowering.py)."""
    return _conditional_inner(optimizer) is not None


def apply(optimizer, apply_pairs, global_step, copies: VariableCopies, after: tf.Operation, **how
           ) -> apply_step.AppliedStep:
    """apply_step.apply (`how`: its keyword arguments). An optimizer that applies its step under a tf.cond (a v1
    MixedPrecisionLossScaleOptimizer scaling dynamically: only when every gradient is finite) hides the updates in
    the cond's branch, where apply_step cannot find the copies' slots nor check their updates; so apply_step reads
    the optimizer it wraps from a call that never runs (making the copies' slots), and the step runs the wrapper's
    own apply_gradients, which updates the loss scale and applies with those slots."""
    inner = _conditional_inner(optimizer)
    if inner is None:
        return apply_step.apply(optimizer, apply_pairs, global_step, copies, after, **how)
    read = apply_step.apply(inner, apply_pairs, None, copies, after, **how)
    reuse = tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=tf.compat.v1.AUTO_REUSE)
    with tf.control_dependencies([after]), reuse:
        apply_op = optimizer.apply_gradients(apply_pairs, global_step=global_step)
    return dataclasses.replace(read, apply_op=apply_op)


def _conditional_inner(optimizer):
    """The optimizer a v1 MixedPrecisionLossScaleOptimizer with a dynamic loss scale wraps, or None."""
    wrapper = _wrapper_class()
    if wrapper is None or not isinstance(optimizer, wrapper):
        return None
    return optimizer._optimizer if optimizer._doing_dynamic_loss_scaling() else None  # pylint: disable=protected-access
