"""`dapple_tf.frontends.estimator.model_fn`: pipelined training behind a tf.estimator.Estimator (TF 2.15 only).

    estimator = tf.estimator.Estimator(
        model_fn=dapple_tf.frontends.estimator.model_fn(user_model_fn, lambda: tf.compat.v1.train.AdamOptimizer(1e-3), plan),
        config=tf.estimator.RunConfig(model_dir="run1", session_config=...))
    estimator.train(input_fn, max_steps=1000)       # TRAIN: build_pipeline, global_step += 1 per step
    estimator.evaluate(eval_input_fn)               # EVAL: the user's single-device graph
    estimator.train(dapple_tf.model.inputs.estimator_input_fn(input_fn, 64), max_steps=1000)
        # the input_fn(step, batch_size) of dapple_profile / dapple_train / Trainer (dapple_tf/model/inputs.py)

TRAIN builds the pipeline (`build_pipeline(..., global_step=...)`); its Scaffold runs the
pipeline's local init op, which initializes local resources (lookup tables) and broadcasts the
user's variables to their copies after every initialization and every restore. Copies live in
LOCAL_VARIABLES, so checkpoints hold exactly the single-device variables: single-device and
pipelined checkpoints warm-start each other. EVAL and PREDICT call the user's model once, on one
device, under a fresh LayerRecorder (markers are plain name scopes, misuse still caught).

Summaries the user's model adds while the pipeline's template is built read the template's
placeholders, which no step feeds: summaries that read them are dropped from the SUMMARIES
collection (with a warning; the Estimator still records the pipeline's loss). The model's
UPDATE_OPS (batch-norm moving averages) run once per step in the pipeline's train_op
(build_pipeline, batch_norm.py).
This module imports tensorflow_estimator: the TF 2.21 environment has none.
"""

from typing import Callable, Optional

import tensorflow as tf
import tensorflow_estimator as tf_estimator

from dapple_tf.rewrite.options import PipelineOptions
from dapple_tf.errors import DappleError
from dapple_tf.rewrite.graph_walk import depends_on_any
from dapple_tf.model.layers import LayerRecorder
from dapple_tf.rewrite.pipeline import build_pipeline

ModeKeys = tf_estimator.estimator.ModeKeys
EstimatorSpec = tf_estimator.estimator.EstimatorSpec


def model_fn(user_model_fn: Callable, optimizer_fn: Callable, plan, *, schedule: Optional[str] = None,
             predict_fn: Optional[Callable] = None, batch_norm: str = "per_slice") -> Callable:
    """An Estimator model_fn training `user_model_fn` pipelined for `plan`.

    user_model_fn(features, labels) -> scalar mean loss, layers marked by dapple_tf.layer (as for
    build_pipeline); optimizer_fn() -> a tf.compat.v1.train.Optimizer; plan as for build_pipeline.
    predict_fn(features) -> predictions (a tensor or dict), single-device, for PREDICT mode.
    batch_norm: as for build_pipeline ("per_slice" or "sync").
    """

    def estimator_model_fn(features, labels, mode):
        if mode == ModeKeys.TRAIN:
            return _train_spec(user_model_fn, optimizer_fn, plan, schedule, features, labels, batch_norm)
        graph = tf.compat.v1.get_default_graph()
        with LayerRecorder(graph).activate():
            if mode == ModeKeys.EVAL:
                return EstimatorSpec(mode, loss=tf.convert_to_tensor(user_model_fn(features, labels)))
            if predict_fn is None:
                raise DappleError("PREDICT needs dapple_tf.frontends.estimator.model_fn(..., predict_fn=fn(features) -> predictions)")
            return EstimatorSpec(mode, predictions=predict_fn(features))

    return estimator_model_fn


def _train_spec(user_model_fn, optimizer_fn, plan, schedule, features, labels, batch_norm) -> EstimatorSpec:
    optimizer = optimizer_fn()
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise DappleError(
            f"optimizer_fn must return a tf.compat.v1.train.Optimizer, got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}: the pipeline applies gradients itself in graph mode (a tf.keras "
            "optimizer is not supported; use e.g. tf.compat.v1.train.AdamOptimizer)"
        )
    for tensor in tf.nest.flatten((features, labels)):
        if tensor is not None and (tensor.shape.rank == 0 or tensor.shape.rank is None or tensor.shape[0] is None):
            raise DappleError(
                f"input_fn gave {tensor.name} with shape {tensor.shape}: the pipeline needs batches of a known "
                "size (the plan's global batch); batch with dataset.batch(n, drop_remainder=True)"
            )
    graph = tf.compat.v1.get_default_graph()
    first_new_op = len(graph.get_operations())
    handle = build_pipeline(user_model_fn, features, labels, optimizer, plan,
                            PipelineOptions(schedule=schedule, batch_norm=batch_norm),
                            global_step=tf.compat.v1.train.get_or_create_global_step())
    _drop_template_summaries(graph, first_new_op)
    scaffold = tf.compat.v1.train.Scaffold(local_init_op=handle.local_init_op)
    return EstimatorSpec(ModeKeys.TRAIN, loss=handle.loss, train_op=handle.train_op, scaffold=scaffold)


def _drop_template_summaries(graph: tf.Graph, first_new_op: int) -> None:
    """Removes from SUMMARIES the summaries that read a placeholder the pipeline build created."""
    new_placeholders = {op for op in graph.get_operations()[first_new_op:] if op.type == "Placeholder"}
    summaries = graph.get_collection_ref(tf.compat.v1.GraphKeys.SUMMARIES)
    dropped = [s for s in summaries if depends_on_any(s.op, new_placeholders)]
    for summary in dropped:
        summaries.remove(summary)
    if dropped:
        tf.compat.v1.logging.warning(
            "dapple_tf.frontends.estimator: summaries %s read the model's inputs and are not recorded in pipelined training "
            "(the loss is); summaries of variables are", [s.op.name for s in dropped])
