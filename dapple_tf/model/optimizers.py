"""Which optimizers the pipeline can apply: tf.compat.v1.train ones (graph mode, any subclass)."""

import tensorflow as tf

from dapple_tf.errors import DappleError

_KERAS_TO_V1 = {"Adam": "AdamOptimizer", "SGD": "GradientDescentOptimizer or MomentumOptimizer",
                "RMSprop": "RMSPropOptimizer", "Adagrad": "AdagradOptimizer", "Adadelta": "AdadeltaOptimizer",
                "Ftrl": "FtrlOptimizer"}


def check_optimizer(optimizer) -> None:
    """A tf.compat.v1.train.Optimizer, or a DappleError saying which one to use instead."""
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        kind = type(optimizer)
        if "keras" in kind.__module__ or any("keras" in b.__module__ for b in kind.__mro__):
            v1 = _KERAS_TO_V1.get(kind.__name__)
            instead = (f"tf.compat.v1.train.{v1}" if v1 else "the tf.compat.v1.train optimizer of the same rule (or "
                       "a tf.compat.v1.train.Optimizer subclass: AdamW as in examples/bert_tf1/optimization.py)")
            raise DappleError(
                f"optimizer is a Keras optimizer ({kind.__module__}.{kind.__name__}); the pipeline applies the "
                f"gradients itself in graph mode with a tf.compat.v1.train.Optimizer: use {instead}")
        raise DappleError(
            f"optimizer must be a tf.compat.v1.train.Optimizer (graph mode), got {kind.__name__}"
        )
    if type(optimizer).__module__.startswith("horovod."):
        raise DappleError(
            "hvd.DistributedOptimizer cannot be given to build_pipeline (it all-reduces in compute_gradients, which "
            "the pipeline never calls): pass the plain optimizer and use dapple_tf.frontends.horovod.build_pipeline"
        )
