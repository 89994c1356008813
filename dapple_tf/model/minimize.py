"""`dapple_tf.minimize`: the train op, asked for inside model_fn the way TF1 training scripts build it.

A TF1 script computes its gradients and applies them inside its Estimator model_fn:

    grads = tf.gradients(loss, tvars)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
    train_op = optimizer.apply_gradients(zip(grads, tvars), global_step=global_step)

Pipelined, those lines become one:

    train_op = dapple_tf.minimize(loss, optimizer, global_step=global_step, clip_global_norm=1.0)

The model_fn runs once, on the template's placeholders, while build_pipeline traces it (the Estimator
front-end's `pipelined`, Trainer, dapple_train): `minimize` records what it was asked (a `MinimizeRequest` in
the graph's collection, while a trace is open) and returns a no-op. Once the pipeline is built, that no-op runs
after the pipeline's train op, so whatever the script groups with it (`global_step.assign_add(1)` under a
control dependency, as TF1 BERT does) runs after the step, as on one device.
"""

import contextlib
import dataclasses
import inspect
from typing import Callable, List, Optional

import tensorflow as tf

from dapple_tf.errors import DappleError

_TRACES = "dapple_tf_model_traces"  # graph collection: one list of requests per open trace


@dataclasses.dataclass
class MinimizeRequest:
    loss: tf.Tensor
    optimizer: object
    global_step: object
    clip_global_norm: Optional[float]
    gradient_fn: Optional[Callable]
    train_op: tf.Operation  # what minimize returned: made to run after the pipeline's train op


def minimize(loss, optimizer, global_step=None, clip_global_norm: Optional[float] = None,
             gradient_fn: Optional[Callable] = None) -> tf.Operation:
    """Inside a model_fn that dapple_tf builds: minimize `loss` (the loss model_fn returns) with `optimizer`
    (a tf.compat.v1.train.Optimizer) in the pipeline, `global_step` given to its apply_gradients, gradients
    clipped by their global norm and passed through `gradient_fn` as PipelineOptions says. Returns an op that
    runs after the pipeline's training step."""
    graph = getattr(loss, "graph", None) or tf.compat.v1.get_default_graph()
    traces = graph.get_collection_ref(_TRACES)
    if not traces:
        raise DappleError(
            "dapple_tf.minimize only works in a model_fn that dapple_tf builds (the Estimator front-end's "
            "dapple_tf.frontends.estimator.pipelined, dapple_tf.Trainer, dapple_train or build_pipeline); on one "
            "device use optimizer.minimize(loss) or apply_gradients"
        )
    with tf.control_dependencies(None):
        op = tf.no_op(name="dapple_minimize")
    traces[-1].append(MinimizeRequest(loss, optimizer, global_step, clip_global_norm, gradient_fn, op))
    return op


@contextlib.contextmanager
def trace(graph: tf.Graph):
    """While model_fn runs for the template: collects what dapple_tf.minimize is asked (the yielded list)."""
    requests: List[MinimizeRequest] = []
    traces = graph.get_collection_ref(_TRACES)
    traces.append(requests)
    try:
        yield requests
    finally:
        del traces[next(i for i, t in enumerate(traces) if t is requests)]


def is_estimator_style(model_fn: Callable) -> bool:
    """A model_fn(features, labels, mode, ...) as tf.estimator calls it."""
    try:
        return "mode" in inspect.signature(model_fn).parameters
    except (TypeError, ValueError):
        return False


def call_estimator_style(model_fn: Callable, features, labels, mode, params=None, config=None):
    """model_fn called with the arguments it declares, as tf.estimator does."""
    names = inspect.signature(model_fn).parameters
    kwargs = {"mode": mode}
    if "params" in names:
        kwargs["params"] = params if params is not None else {}
    if "config" in names:
        kwargs["config"] = config
    if "labels" in names:
        kwargs["labels"] = labels
    return model_fn(features, **kwargs)


def training_model_fn(model_fn: Callable, params=None, config=None) -> Callable:
    """A model_fn(features, labels) for build_pipeline: model_fn itself, or an Estimator-style one called in
    TRAIN mode (it returns an EstimatorSpec whose loss and train_op build_pipeline reads)."""
    if not is_estimator_style(model_fn):
        return model_fn
    return lambda features, labels: call_estimator_style(model_fn, features, labels, "train", params, config)


def spec_parts(result):
    """(what to read the loss from, the spec's train_op or None): an EstimatorSpec-like result (loss and
    train_op attributes) gives its loss and train_op; anything else is returned as it is."""
    if hasattr(result, "loss") and hasattr(result, "train_op") and not tf.is_tensor(result):
        if result.loss is None:
            raise DappleError("model_fn returned an EstimatorSpec without a loss in TRAIN mode")
        return result.loss, result.train_op
    return result, None
