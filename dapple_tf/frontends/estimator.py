"""`dapple_tf.frontends.estimator.model_fn`: pipelined training behind a tf.estimator.Estimator (TF 2.15 only).

    estimator = tf.estimator.Estimator(
        model_fn=dapple_tf.frontends.estimator.model_fn(user_model_fn, lambda: tf.compat.v1.train.AdamOptimizer(1e-3), plan),
        config=tf.estimator.RunConfig(model_dir="run1", session_config=...))
    estimator.train(input_fn, max_steps=1000)       # TRAIN: build_pipeline, global_step += 1 per step
    estimator.evaluate(eval_input_fn)               # EVAL: the user's single-device graph
    estimator.train(dapple_tf.model.inputs.estimator_input_fn(input_fn, 64), max_steps=1000)
        # the input_fn(step, batch_size) of dapple_profile / dapple_train / Trainer (dapple_tf/model/inputs.py)

A TF1 script's own Estimator model_fn(features, labels, mode, params), which builds its train op in TRAIN mode,
is pipelined by `pipelined` once its gradient lines call dapple_tf.minimize (docs/user_guide.md, "Porting a
training script"):

    estimator = tf.estimator.Estimator(model_fn=dapple_tf.frontends.estimator.pipelined(
        model_fn, plan, layers=dapple_tf.layers_by_scope(patterns=["bert/encoder/layer_*", ...])), ...)

TRAIN builds the pipeline (`build_pipeline(..., global_step=...)`); its Scaffold runs the
pipeline's local init op, which initializes local resources (lookup tables) and broadcasts the
user's variables to their copies after every initialization and every restore. Copies live in
LOCAL_VARIABLES, so checkpoints hold exactly the single-device variables: single-device and
pipelined checkpoints warm-start each other. EVAL and PREDICT call the user's model once, on one
device, under a fresh LayerRecorder (markers are plain name scopes, misuse still caught).

Summaries the user's model adds are built again on what the pipeline computes (scalar means averaged
over micro-batches, metrics from the whole batch: dapple_tf/rewrite/template/summaries.py), so the Estimator
records them as on one device. The model's UPDATE_OPS (batch-norm moving averages) run once per step in
the pipeline's train_op (build_pipeline, batch_norm.py).
Per host (every task of a cluster building its own part): make the RunConfig with `cluster_task(plan)`
(host_estimator.py); TRAIN then builds this task's part.
This module imports tensorflow_estimator: the TF 2.21 environment has none.
"""

from typing import Callable, Optional

import tensorflow as tf
import tensorflow_estimator as tf_estimator

from dapple_tf.rewrite.options import PipelineOptions
from dapple_tf.errors import DappleError, PerHostError, PlanError
from dapple_tf.frontends import host_estimator
from dapple_tf.frontends.host_estimator import cluster_task  # noqa: F401  (dapple_tf.frontends.estimator.cluster_task)
from dapple_tf.model.layers import LayerRecorder
from dapple_tf.model import minimize as minimize_lib
from dapple_tf.model.optimizers import check_optimizer
from dapple_tf.rewrite.pipeline import as_plan, build_pipeline
from dapple_tf.rewrite.update.replicas import canonical_device

ModeKeys = tf_estimator.estimator.ModeKeys
EstimatorSpec = tf_estimator.estimator.EstimatorSpec


def model_fn(user_model_fn: Callable, optimizer_fn: Callable, plan, *, schedule: Optional[str] = None,
             predict_fn: Optional[Callable] = None, batch_norm: str = "per_slice",
             options: Optional[PipelineOptions] = None, layers=None) -> Callable:
    """An Estimator model_fn training `user_model_fn` pipelined for `plan`.

    user_model_fn(features, labels) -> scalar mean loss, layers marked by dapple_tf.layer (as for
    build_pipeline); optimizer_fn() -> a tf.compat.v1.train.Optimizer; plan as for build_pipeline.
    predict_fn(features) -> predictions (a tensor or dict), single-device, for PREDICT mode.
    batch_norm: as for build_pipeline ("per_slice" or "sync"); options: a PipelineOptions (clipping, ...) instead
    of schedule and batch_norm; layers: build_pipeline's.
    """
    options = _options(options, schedule, batch_norm)

    def estimator_model_fn(features, labels, mode, config):
        if mode == ModeKeys.TRAIN:
            optimizer = optimizer_fn()
            _check_optimizer(optimizer)
            _check_session_devices(plan, config)
            return _train_spec(user_model_fn, optimizer, plan, options, layers, features, labels, config)
        graph = tf.compat.v1.get_default_graph()
        with LayerRecorder(graph).activate():
            if mode == ModeKeys.EVAL:
                return EstimatorSpec(mode, loss=tf.convert_to_tensor(user_model_fn(features, labels)))
            if predict_fn is None:
                raise DappleError("PREDICT needs dapple_tf.frontends.estimator.model_fn(..., predict_fn=fn(features) -> predictions)")
            return EstimatorSpec(mode, predictions=predict_fn(features))

    return estimator_model_fn


def pipelined(estimator_model_fn: Callable, plan, options: Optional[PipelineOptions] = None, *,
              layers=None) -> Callable:
    """An Estimator model_fn that trains a script's own model_fn(features, labels, mode, params) pipelined for
    `plan`: in TRAIN mode its EstimatorSpec's train_op must come from dapple_tf.minimize (the optimizer, global
    step and clipping it names are used); EVAL and PREDICT run it as written, on one device.
    options: a PipelineOptions; layers: build_pipeline's (None: dapple_tf.layer markers)."""

    def wrapped(features, labels, mode, params, config):
        if mode != ModeKeys.TRAIN:
            with LayerRecorder(tf.compat.v1.get_default_graph()).activate():
                return minimize_lib.call_estimator_style(estimator_model_fn, features, labels, mode, params, config)
        _check_session_devices(plan, config)
        captured = {}

        def train_model_fn(template_features, template_labels):
            captured["spec"] = minimize_lib.call_estimator_style(estimator_model_fn, template_features,
                                                                 template_labels, mode, params, config)
            return captured["spec"]

        spec = _train_spec(train_model_fn, None, plan, options or PipelineOptions(), layers, features, labels, config)
        user = captured["spec"]
        if host_estimator.per_host_cluster() is not None:
            return _per_host_with_script_spec(spec, user)
        local_init = spec.scaffold.local_init_op
        if user.scaffold.local_init_op is not None:
            local_init = tf.group(user.scaffold.local_init_op, local_init)
        return spec._replace(
            training_hooks=tuple(user.training_hooks), training_chief_hooks=tuple(user.training_chief_hooks),
            scaffold=tf.compat.v1.train.Scaffold(local_init_op=local_init, copy_from_scaffold=user.scaffold))

    return wrapped


def _per_host_with_script_spec(spec: EstimatorSpec, user: EstimatorSpec) -> EstimatorSpec:
    """The per-host spec with the script's hooks; a script's Scaffold that initializes or restores by itself is
    refused (each task restores its own variables)."""
    own = user.scaffold
    if own.init_fn is not None or own.init_op is not None or own.saver is not None:
        raise PerHostError("training per host starts each task's session itself (its variables restored or "
                           "initialized, then the other tasks' it copies): the script's EstimatorSpec Scaffold must "
                           "not set init_op, init_fn or saver")
    # the per-host Scaffold's init_fn runs the pipeline's local init; the script's runs as its local_init_op
    scaffold = tf.compat.v1.train.Scaffold(local_init_op=own.local_init_op, copy_from_scaffold=spec.scaffold)
    return spec._replace(training_hooks=tuple(user.training_hooks), scaffold=scaffold,
                         training_chief_hooks=tuple(spec.training_chief_hooks) + tuple(user.training_chief_hooks))


def _check_session_devices(plan, config) -> None:
    """A session given a ConfigProto sees one CPU device unless its device_count says more: a plan on virtual CPU
    devices would be soft-placed on one (and its replicas' collectives would wait forever). Devices the process
    lacks are build_pipeline's to name."""
    if config is None:
        return
    local = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    devices = [tf.DeviceSpec.from_string(d) for d in as_plan(plan).with_devices(canonical_device).devices
               if d in local]
    highest = max((d.device_index or 0 for d in devices if (d.device_type or "").upper() == "CPU"), default=0)
    session_config = getattr(config, "session_config", None)
    count = dict(session_config.device_count).get("CPU", 1) if session_config is not None else 1
    if highest >= count:
        raise PlanError(
            f"the plan uses /device:CPU:{highest}, but the Estimator's session sees {count} CPU device(s): give it "
            f"tf.estimator.RunConfig(session_config=tf.compat.v1.ConfigProto(device_count={{'CPU': {highest + 1}}}))")


def _options(options: Optional[PipelineOptions], schedule, batch_norm) -> PipelineOptions:
    if options is None:
        return PipelineOptions(schedule=schedule, batch_norm=batch_norm)
    if schedule is not None or batch_norm != "per_slice":
        raise DappleError("give schedule and batch_norm in options=PipelineOptions(...), not beside it")
    return options


def _check_optimizer(optimizer) -> None:
    try:
        check_optimizer(optimizer)
    except DappleError as e:
        raise DappleError(f"optimizer_fn must return a tf.compat.v1.train.Optimizer: {e}") from None


def _train_spec(user_model_fn, optimizer, plan, options, layers, features, labels, config) -> EstimatorSpec:
    for tensor in tf.nest.flatten((features, labels)):
        if tensor is not None and (not tensor.shape.rank or tf.compat.dimension_value(tensor.shape[0]) is None):
            raise DappleError(
                f"input_fn gave {tensor.name} with shape {tensor.shape}: the pipeline needs batches of a known "
                "size (the plan's global batch); batch with dataset.batch(n, drop_remainder=True)"
            )
    cluster = host_estimator.per_host_cluster()
    if cluster is not None:
        return host_estimator.train_spec(cluster, user_model_fn, optimizer, plan, options, layers, features, labels,
                                         config)
    handle = build_pipeline(user_model_fn, features, labels, optimizer, plan, options,
                            global_step=tf.compat.v1.train.get_or_create_global_step(), layers=layers)
    scaffold = tf.compat.v1.train.Scaffold(local_init_op=handle.local_init_op)
    return EstimatorSpec(ModeKeys.TRAIN, loss=handle.loss, train_op=handle.train_op, scaffold=scaffold)
