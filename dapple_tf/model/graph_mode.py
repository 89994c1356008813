"""build_pipeline (and the profiler) write a tf.compat.v1 graph: refuse eager mode and tf.function
with a message that says what to do instead."""

import tensorflow as tf

from dapple_tf.errors import DappleError

_HOW = (
    "build it in graph mode, once: `with tf.Graph().as_default():` around the model, the input tensors and "
    "build_pipeline (or tf.compat.v1.disable_eager_execution() at program start), then run handle.initializer "
    "and handle.train_op with a tf.compat.v1.Session"
)


def require_graph_mode(what: str) -> None:
    if tf.inside_function():
        raise DappleError(f"{what} was called inside a tf.function; it builds a whole training graph itself: {_HOW}")
    if tf.executing_eagerly():
        raise DappleError(f"{what} needs graph mode but TensorFlow is executing eagerly: {_HOW}")
