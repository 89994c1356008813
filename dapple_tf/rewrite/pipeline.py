"""`build_pipeline`: the rewrite from a single-device model to a DAPPLE pipelined graph.

Passes, in order (paper section 5):
1. template: call model_fn once, on placeholders like the global batch with an unknown batch
   size, with layer markers recorded; each layer's variables are created on its stage's first
   device (template.py cuts it into stages); the plan resolved against it is the PipelineLayout
   (layout.py: stages, M, micro-batch size, schedule, re-computation) the later passes read;
2. forward: per micro-batch and stage replica, import the stage's operations under the replica's
   device, fed by slices of the inputs and of earlier stages' outputs (microbatch.py);
3. backward: stage by stage in reverse, per micro-batch and replica, `tf.gradients` of the clone
   with grad_ys from later stages; variable gradients are accumulated as a running sum;
4. schedule: control edges make each device run its tasks in the planner.formats.schedule order (tasks.py);
5. update: AllReduce of the accumulated gradients across the devices holding each variable, in
   buckets that start during the last micro-batch's backward (gradients.py, collectives.py), clipping
   and the gradient function (gradient_transforms.py), then one apply step of the user's optimizer on
   every copy (apply_step.py); the optimizer may come from dapple_tf.minimize in model_fn (minimize.py).
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Set, Tuple

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context

from dapple_tf.rewrite.batch import batch_norm as batch_norm_lib
from dapple_tf.rewrite.graphs import graph_walk
from dapple_tf.rewrite.hosts import host_graph, lowering as lowering_lib
from dapple_tf.rewrite.stages import stage_function
from dapple_tf.rewrite.template import (outputs as outputs_lib, random_ops, summaries, template as template_lib,
                                        template_devices)
from dapple_tf.rewrite.update import collectives, gradient_transforms, gradients, loss_scaling
from dapple_tf.errors import DappleError, LayerMarkerError, PlanError
from dapple_tf.model import minimize as minimize_lib, training_calls
from dapple_tf.model.model_training import ModelTraining
from dapple_tf.model.optimizers import check_optimizer
from dapple_tf.model.graph_mode import require_graph_mode
from dapple_tf.model.layers import LayerRecorder
from dapple_tf.plan import Plan, ResolvedStage
from dapple_tf.rewrite.template.layout import PipelineLayout
from dapple_tf.rewrite.options import PipelineOptions
from dapple_tf.rewrite.update.replicas import VariableCopies, canonical_device
from dapple_tf.model.scopes import ScopeLayers
from dapple_tf.rewrite.stages.stage_builder import StageBuilder
from planner.formats.schedule import Schedule, Task
from planner.formats import plan_pb2, program as program_lib

NO_DEADLINE = -1  # RewriterConfig.meta_optimizer_timeout_ms: grappler finishes however long it takes


@dataclasses.dataclass
class PipelineHandle:
    """What build_pipeline made. Run `initializer` once, then `train_op` each step."""

    train_op: tf.Operation
    loss: Optional[tf.Tensor]  # mean loss over the global batch (per-host graphs: on the loss's task only, else None)
    grads_and_vars: List[Tuple[tf.Tensor, tf.Variable]]  # averaged gradients of the user's variables
    schedule: Schedule
    stages: Tuple[ResolvedStage, ...]
    micro_batch_size: int
    initializer: tf.Operation  # global init, then local init (variable copies), then broadcast
    local_init_op: tf.Operation  # after a checkpoint restore: local init, then broadcast
    broadcast_op: tf.Operation  # copies := the user's variables (and optimizer slots)
    task_op_names: Dict[Tuple[str, Task, int], Tuple[str, ...]]  # (device, task, replica) -> op names
    outputs: Dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)  # model_fn's extra outputs
    update_ops: List[tf.Operation] = dataclasses.field(default_factory=list)  # UPDATE_OPS, run by train_op
    allreduce_op_names: Tuple[str, ...] = ()  # the operations that all-reduce gradients (timeline.py draws them)
    # backward tasks split into B and W (tasks.input_gradients_first): (device, task, replica) -> B's op names
    input_gradient_op_names: Dict[Tuple[str, Task, int], Tuple[str, ...]] = dataclasses.field(default_factory=dict)
    function_fallbacks: Dict[int, str] = dataclasses.field(default_factory=dict)  # stage -> why not a function call
    function_call_ops: Tuple[tf.Operation, ...] = ()  # the calls of the stages built as functions
    global_norm: Optional[tf.Tensor] = None  # with clip_global_norm: the gradients' global norm before clipping
    # per-host graphs: other tasks' variables this task's local_init_op reads, not yet initialized (empty: ready)
    ready_for_local_init_op: Optional[tf.Tensor] = None
    # per-host graphs: this task, then every other task the graph places operations on (its peers)
    tasks: Tuple[str, ...] = ()

    def session_config(self, config: Optional[tf.compat.v1.ConfigProto] = None) -> tf.compat.v1.ConfigProto:
        """The config to run this pipeline with: a copy of `config` (None: the one tf.compat.v1.Session would use,
        with this process's logical devices) in which grappler has no deadline, unless `config` sets one. TF's
        default deadline (5 minutes per graph) makes the result depend on the machine's load: past it, the graph
        runs partly optimized, and other fusions round differently (a fuzz case's weights changed in the last
        bits when a loaded machine took 495 s; a 1 ms deadline changes them every time). Where stages run as
        PartitionedCall functions (PipelineOptions.traced_functions) and nothing else in the graph calls
        functions, grappler's function optimizer is off for the outer graph too: its work per call site made the
        first step grow with M (BERT-24, 4 stages, M=64: 66.7 -> 43.7 s); each device still optimizes a stage's
        body when it first calls it, and the steady step is the same. The default RemoteCall ops are not the
        optimizer's."""
        out = tf.compat.v1.ConfigProto()
        out.CopyFrom(config if config is not None else context.context().config)
        rewrite = out.graph_options.rewrite_options
        if not rewrite.meta_optimizer_timeout_ms:
            rewrite.meta_optimizer_timeout_ms = NO_DEADLINE
        partitioned = [op for op in self.function_call_ops if op.type != "RemoteCall"]
        if partitioned and not stage_function.needs_function_optimizer(self.train_op.graph, self.function_call_ops):
            rewrite.function_optimization = rewriter_config_pb2.RewriterConfig.OFF
        if self.tasks and not out.device_filters:  # a per-host graph's session talks to its peers only
            out.device_filters.extend(self.tasks)
        return out


def as_plan(plan) -> Plan:
    """A dapple_tf.Plan from a Plan, a plan proto or a plan file's path."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, plan_pb2.Plan):
        return Plan.from_proto(plan)
    if isinstance(plan, str):
        return Plan.from_file(plan)
    raise PlanError(f"plan must be a dapple_tf.Plan, a plan_pb2.Plan or a plan file path, got {type(plan).__name__}")


def _check_devices(devices: Sequence[str]) -> None:
    """Local devices (canonical spellings) must exist; a cluster's are checked against the cluster
    (dapple_tf.cluster.servers.map_devices) by whoever opens the session to it."""
    local = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    missing = [d for d in devices if tf.DeviceSpec.from_string(d).job is None and d not in local]
    if missing:
        raise PlanError(
            f"the plan uses devices {missing} that this process does not have; available: {sorted(local)}. "
            "To get them: dapple_train --num_devices=N (N virtual CPU devices; or a plan for the devices you have: "
            "dapple_plan --num_devices=N), or in your own program, before TensorFlow starts, split the CPU into N "
            "virtual devices: tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0], "
            "[tf.config.LogicalDeviceConfiguration()] * N) (as in the README's example)"
        )


class _LayerPlacer:
    """Places each layer's template operations (and so its variables) on its stage's first device."""

    def __init__(self, plan: Plan):
        self._plan = plan
        self._stage = 0

    def __call__(self, name: str, index: int):
        stages = self._plan.stages
        for i, stage in enumerate(stages):
            if stage.first_layer in (name, index):
                self._stage = i
        return stages[self._stage].devices[0]


def build_pipeline(model_fn, features, labels, optimizer, plan, options: Optional[PipelineOptions] = None, *,
                   global_step=None, layers=None):
    """Builds the DAPPLE training graph of `model_fn` for `plan` in the default graph.

    model_fn(features, labels) -> scalar mean loss, or (loss, {name: tensor}) with extra outputs
    (batch-leading tensors or scalar means: handle.outputs), or an EstimatorSpec whose train_op comes from
    dapple_tf.minimize; layers marked by dapple_tf.layer; features and labels are the global batch (tensors
    or nests of tensors, leading dimension = batch);
    optimizer a tf.compat.v1.train.Optimizer, or None when model_fn calls dapple_tf.minimize;
    plan a dapple_tf.Plan, a plan proto or a plan file;
    options a dapple_tf.PipelineOptions (schedule, re-computation, batch norm, AllReduce buckets, stage
    functions, gradient clipping; default PipelineOptions());
    layers: None (dapple_tf.layer markers) or dapple_tf.layers_by_scope(...) (the model's name scopes).
    Returns a PipelineHandle.
    """
    require_graph_mode("build_pipeline")
    options, plan = _check_inputs(optimizer, plan, options)
    return host_graph.build_graph(
        tf.compat.v1.get_default_graph(),
        lambda graph, arguments: _build(graph, model_fn, arguments, optimizer, plan, options, layers),
        (features, labels, global_step), _GRAPH_FIELDS, options)


# The PipelineHandle's fields that hold tensors, operations or variables
_GRAPH_FIELDS = ("train_op", "loss", "grads_and_vars", "initializer", "local_init_op", "broadcast_op", "outputs",
                 "update_ops", "function_call_ops", "global_norm", "ready_for_local_init_op")


def _build(graph: tf.Graph, model_fn, arguments, optimizer, plan: Plan, options: PipelineOptions, layers
           ) -> Tuple[PipelineHandle, int]:
    """build_pipeline in `graph`, with (features, labels, global_step) `arguments`. Returns the handle and the
    number of operations in `graph` before the passes after the template."""
    features, labels, global_step = arguments
    template, created, model_train = _trace_template(graph, model_fn, features, labels, plan, layers)
    first_part_op = len(graph.get_operations())
    optimizer, options, global_step = _training(model_train, optimizer, options, global_step)
    layout = PipelineLayout.of(plan, template, options.schedule, options.recompute)
    random_ops.warn_per_slice(template.stages, layout)
    # the layout's program (plain data: each replica's rows, each device's tasks, the transfers, the reductions),
    # lowered for this graph: every device's (one graph) or options.own_task's
    program = program_lib.build_program([list(stage.devices) for stage in layout.stages],
                                        layout.num_micro_batches * layout.micro_batch_size, layout.schedule,
                                        recompute=layout.recompute)
    lowering = lowering_lib.lowering(program, options.own_task, plan.devices)
    lowering.check_supported(options, optimizer, model_train)
    trainable = set(model_train.script.variables) if model_train.script else set(tf.compat.v1.trainable_variables())
    keys = collectives.CollectiveKeys(graph)
    copies = VariableCopies()
    sync = options.batch_norm == batch_norm_lib.SYNC
    updates = batch_norm_lib.prepare(template, created, layout, sync)
    model_summaries = summaries.Summaries(graph, template, created,
                                          model_train.script.replaced if model_train.script else set())
    builder = StageBuilder(graph, template, copies, trainable, lowering, sync_keys=keys if sync else None,
                           stage_functions=options.stage_functions, traced_functions=options.traced_functions,
                           sync_statistics=updates.synchronized,
                           input_gradients_first=options.input_gradients_first,
                           square_sparse=options.clip_global_norm is not None or bool(
                               model_train.script and model_train.script.flow.substitutes),
                           loss_seed=loss_scaling.loss_seed(model_train))
    builder.build_forward()
    builder.build_backward()
    builder.chain()
    extra_outputs, update_ops = lowering.combined_once(builder, updates, model_summaries, layout.stages[-1].devices[0])
    loss_mean = builder.loss_mean(layout.stages[-1].devices[0])
    if loss_mean is not None:
        with tf.device(layout.stages[-1].devices[0]):
            loss_mean = tf.identity(loss_mean, name="dapple_loss")
    global_step = lowering.own_global_step(global_step)
    step = _reduce_and_apply(graph, builder, copies, keys, optimizer, options, global_step, update_ops,
                             layout.stages[-1].devices[0], model_train.script, lowering, first_part_op)
    initializer, local_init, broadcast = _initializers(graph, copies, step.slot_pairs, lowering)
    train_op = model_train.run_after(lowering.step_op(step.train_op, loss_mean))
    ready = lowering.ready_for_local_init([train_op, local_init])
    return PipelineHandle(
        train_op=train_op,
        loss=loss_mean,
        grads_and_vars=step.grads_and_vars,
        schedule=layout.schedule,
        stages=layout.stages,
        micro_batch_size=layout.micro_batch_size,
        initializer=initializer,
        local_init_op=local_init,
        broadcast_op=broadcast,
        task_op_names=builder.task_op_names(),
        input_gradient_op_names=builder.task_op_names(input_gradients=True),
        outputs=extra_outputs,
        update_ops=update_ops,
        allreduce_op_names=step.allreduce_op_names,
        function_fallbacks=dict(builder.function_fallbacks),
        function_call_ops=builder.function_call_ops(),
        global_norm=step.global_norm,
        ready_for_local_init_op=ready,
    ), first_part_op



def _check_inputs(optimizer, plan, options: Optional[PipelineOptions]) -> Tuple[PipelineOptions, Plan]:
    """The options (default PipelineOptions()) and the plan, its devices spelled canonically and checked."""
    options = options or PipelineOptions()
    if not isinstance(options, PipelineOptions):
        raise DappleError(f"options must be a dapple_tf.PipelineOptions, got {type(options).__name__}")
    plan = as_plan(plan)
    if optimizer is not None:
        check_optimizer(optimizer)
    plan = plan.with_devices(canonical_device)  # one spelling per device: duplicates are caught
    _check_devices(plan.devices)
    return options, plan


def _trace_template(graph: tf.Graph, model_fn, features, labels, plan: Plan, layers
                    ) -> Tuple[template_lib.Template, Set[tf.Operation], ModelTraining]:
    """model_fn called once on placeholders like the global batch, with its layers recorded, cut into the
    plan's stages (template.py). Returns the template, the operations model_fn created (but its own training
    step's) and how it asked to be trained (model_training.py)."""
    structure = (features, labels)
    flat = [None if t is None else tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    inputs = template_lib.template_inputs([t for t in flat if t is not None])
    placeholder_of = {t.name: graph.get_tensor_by_name(p) for p, t in inputs.items()}
    template_features, template_labels = tf.nest.pack_sequence_as(
        structure, [None if t is None else placeholder_of.get(t.name, t) for t in flat]
    )
    if layers is not None and not isinstance(layers, ScopeLayers):
        raise DappleError(f"layers must be None (markers) or dapple_tf.layers_by_scope(...), got {layers!r}")
    placer = _LayerPlacer(plan)
    recorder = layers.recorder(graph, placer) if layers is not None else LayerRecorder(graph, device_for_layer=placer)
    first_model_op = len(graph.get_operations())
    with recorder.activate(), minimize_lib.trace(graph) as requests, training_calls.observe(graph) as calls:
        result, spec_train_op = minimize_lib.spec_parts(model_fn(template_features, template_labels))
    loss, extras = outputs_lib.split_model_result(result)
    if not recorder.layers:
        raise LayerMarkerError("model_fn marked no layers; wrap each layer in `with dapple_tf.layer(name):`")
    loss = tf.convert_to_tensor(loss)
    if layers is not None:
        recorder.drop_layers_unused_by(loss)
    if not loss.dtype.is_floating:
        raise DappleError(f"model_fn must return a floating-point loss, got {loss.dtype.name} {loss.name}")
    created = set(graph.get_operations()[first_model_op:])
    template_devices.unify(graph.get_operations()[first_model_op:])
    stages = plan.resolve(recorder.names)
    variables = tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
    batch_dependent = graph_walk.descendants([graph.get_tensor_by_name(p).op for p in inputs])
    model_train = ModelTraining.of(requests, calls, loss, spec_train_op,
                                   set(batch_norm_lib.model_update_ops(graph, created)),
                                   {v.handle.name: v for v in variables if hasattr(v, "handle")}, batch_dependent)
    if model_train.script is not None:
        created -= model_train.script.replaced
    return template_lib.analyze(loss, inputs, recorder.layers, stages, variables, extras), created, model_train


def _training(model_train: ModelTraining, optimizer, options: PipelineOptions, global_step):
    """(optimizer, options, the global_step apply_gradients gets) from build_pipeline's arguments and what model_fn
    asked of dapple_tf.minimize or applied itself (then its global_step, as the script's apply_gradients had it)."""
    request, script = model_train.request, model_train.script
    if not model_train.asked:
        if optimizer is None:
            raise DappleError("build_pipeline got no optimizer (None) and model_fn applies no gradients itself: "
                              "pass a tf.compat.v1.train.Optimizer, or call dapple_tf.minimize in model_fn")
        loss_scaling.refuse_wrapper(optimizer, "build_pipeline's optimizer")
        return optimizer, options, global_step
    if optimizer is not None:
        how = "called dapple_tf.minimize" if request else f"applies gradients itself (at {script.where})"
        raise DappleError(f"model_fn {how} with its own optimizer and build_pipeline got one too: pass "
                          "optimizer=None (the Trainer and dapple_train do for an Estimator-style model_fn)")
    if script is not None:
        for field in ("clip_global_norm", "gradient_fn"):
            if getattr(options, field) is not None:
                raise DappleError(f"PipelineOptions.{field} is set, but model_fn computes what it applies itself "
                                  f"(apply_gradients at {script.where}): clip or transform the gradients in one place")
        return script.optimizer, options, script.global_step
    check_optimizer(request.optimizer)
    loss_scaling.refuse_wrapper(request.optimizer, "the optimizer given to dapple_tf.minimize")
    changes = {}
    for field in ("clip_global_norm", "gradient_fn"):
        asked, given = getattr(request, field), getattr(options, field)
        if asked is not None and given is not None and asked != given:
            raise DappleError(f"{field} is {asked!r} in dapple_tf.minimize and {given!r} in PipelineOptions: "
                              "set it in one place")
        if asked is not None:
            changes[field] = asked
    options = dataclasses.replace(options, **changes) if changes else options
    return request.optimizer, options, request.global_step  # what the script gives apply_gradients, as on one device


@dataclasses.dataclass
class _Step:
    train_op: tf.Operation
    grads_and_vars: List[Tuple[tf.Tensor, tf.Variable]]  # the averaged gradients, before clipping
    allreduce_op_names: Tuple[str, ...]
    slot_pairs: List[Tuple[tf.Variable, tf.Variable]]  # (user's slot, copy's slot)
    global_norm: Optional[tf.Tensor]


def _reduce_and_apply(graph: tf.Graph, builder: StageBuilder, copies: VariableCopies, keys, optimizer,
                      options: PipelineOptions, global_step, update_ops: List[tf.Operation], norm_device: str,
                      script, lowering, first_part_op: int) -> _Step:
    """AllReduce of the accumulated gradients (gradients.py), clipping and the gradient function
    (gradient_transforms.py), then the optimizer's step on every copy (apply_step.py), of the devices and gradients
    the lowering has this graph build (hosts/lowering.py)."""
    # Collectives wait for the stale-copy check (StaleCopyCheck), so a failing check stops the step with its own
    # message, not with the collectives it would otherwise cancel mid-flight.
    stale_copy_check = copies.stale_copy_check()
    stale_copy_check.hold_collectives(graph.get_operations()[first_part_op:])
    first_reduce_op = len(graph.get_operations())
    cluster = lowering.cluster_gradients(builder, copies.copies_of)
    grads_and_vars, apply_pairs = gradients.reduce_and_pair(
        builder.accumulator, copies, keys, options.cross_process_reduce, options.allreduce_bucket_bytes,
        start_after=stale_copy_check, lowering=lowering, devices_of=cluster.devices_of, gathered=cluster.gathered)
    allreduce_op_names = tuple(op.name for op in graph.get_operations()[first_reduce_op:])
    if not grads_and_vars:
        raise DappleError("the loss depends on no trainable variable: there is nothing to train")
    sparse_squares = {v: squares for v, squares in builder.accumulator.squares_of_sparse().items()
                      if cluster.gathered is None or v in cluster.gathered}
    squared = options.clip_global_norm is not None or bool(script and script.flow.substitutes)
    if squared and options.cross_process_reduce is not None and sparse_squares:
        what = "clip_global_norm" if options.clip_global_norm is not None else \
            f"the script's clipping by norm (apply_gradients at {script.where})"
        raise DappleError(
            f"{what} with gradients of gathered rows ({sorted(v.op.name for v in sparse_squares)}) is not "
            "supported across Horovod processes (tf.clip_by_global_norm counts every gathered row, which each "
            "process holds only its own of)")
    apply_pairs, norm = gradient_transforms.transform(
        grads_and_vars, apply_pairs, copies.copies_of, options.clip_global_norm, options.gradient_fn, norm_device,
        sparse_squares, tf.compat.v1.trainable_variables(), script.flow if script else None, cluster=cluster)
    applied_variables = {v for _, v in apply_pairs}
    users = [user for user, copy in copies.extra_copies() if copy in applied_variables]
    remote_users = {id(user): user for user in lowering.elsewhere_variables(users)}  # each once
    applied = loss_scaling.apply(optimizer, apply_pairs, global_step, copies, stale_copy_check.op,
                                 applied_before=script is not None, remote_users=list(remote_users.values()),
                                 elsewhere=lowering.elsewhere_variables)
    train_op = tf.group(applied.apply_op, *update_ops, name="dapple_train") if update_ops else applied.apply_op
    return _Step(train_op, grads_and_vars, allreduce_op_names, applied.slot_pairs, norm)


def _initializers(graph: tf.Graph, copies: VariableCopies, slot_pairs, lowering):
    """(initializer, local_init_op, broadcast_op) of the PipelineHandle; the local init joins LOCAL_INIT_OP. The
    initializer is the lowering's (hosts/lowering.py): in a per-host graph this task's global variables only, copies
    of other tasks' variables waiting for them (ready_for_local_init_op) in local_init_op."""
    broadcast = copies.broadcast_op(slot_pairs)
    local_init = _after_local_init(copies, slot_pairs, "dapple_local_init")
    initializer = lowering.initializer(lambda: _after_local_init(copies, slot_pairs, "dapple_initializer"))
    graph.add_to_collection(tf.compat.v1.GraphKeys.LOCAL_INIT_OP, local_init)
    return initializer, local_init, broadcast


def _after_local_init(copies: VariableCopies, slot_pairs, name: str) -> tf.Operation:
    """The default local initialization (local variables, lookup tables, local resources: what a
    Scaffold runs when LOCAL_INIT_OP is empty), then the broadcast of the user's variables to the copies."""
    with tf.control_dependencies([tf.compat.v1.train.Scaffold.default_local_init_op()]):
        return tf.group(copies.broadcast_op(slot_pairs), name=name)
