"""`build_pipeline`: the rewrite from a single-device model to a DAPPLE pipelined graph.

Passes, in order (paper section 5):
1. template: call model_fn once on the global batch with layer markers recorded; each layer's
   variables are created on its stage's first device (template.py cuts it into stages);
2. forward: per micro-batch and stage replica, import the stage's operations under the replica's
   device, fed by slices of the inputs and of earlier stages' outputs (microbatch.py);
3. backward: stage by stage in reverse, per micro-batch and replica, `tf.gradients` of the clone
   with grad_ys from later stages; variable gradients are accumulated as a running sum;
4. schedule: control edges make each device run its tasks in the planner.schedule order (tasks.py);
5. update: AllReduce of the accumulated gradients across the devices holding each variable
   (collectives.py), then one apply step of the user's optimizer on every copy (replicas.py).
"""

import dataclasses
from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from dapple_tf import collectives, microbatch, template as template_lib
from dapple_tf.errors import DappleError, LayerMarkerError, PlanError
from dapple_tf.layers import LayerRecorder
from dapple_tf.plan import Plan, ResolvedStage
from dapple_tf.replicas import VariableCopies, canonical_device
from dapple_tf.stage_builder import StageBuilder
from planner.schedule import BACKWARD, FORWARD, SCHEDULE_KINDS, Schedule, Task
from planner.schemas import plan_pb2


@dataclasses.dataclass
class PipelineHandle:
    """What build_pipeline made. Run `initializer` once, then `train_op` each step."""

    train_op: tf.Operation
    loss: tf.Tensor  # mean loss over the global batch
    grads_and_vars: List[Tuple[tf.Tensor, tf.Variable]]  # averaged gradients of the user's variables
    schedule: Schedule
    stages: Tuple[ResolvedStage, ...]
    micro_batch_size: int
    initializer: tf.Operation  # global init, then local init (variable copies), then broadcast
    local_init_op: tf.Operation  # after a checkpoint restore: local init, then broadcast
    broadcast_op: tf.Operation  # copies := the user's variables (and optimizer slots)
    task_op_names: Dict[Tuple[str, Task, int], Tuple[str, ...]]  # (device, task, replica) -> op names


def _as_plan(plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, plan_pb2.Plan):
        return Plan.from_proto(plan)
    if isinstance(plan, str):
        return Plan.from_file(plan)
    raise PlanError(f"plan must be a dapple_tf.Plan, a plan_pb2.Plan or a plan file path, got {type(plan).__name__}")


def _check_devices(devices: Sequence[str]) -> None:
    local = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    local_short = {tf.DeviceSpec.from_string(d).replace(job=None, replica=None, task=None).to_string() for d in local}
    missing = []
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        if spec.job not in (None, "localhost"):
            continue  # a remote task's device: the cluster checks it when the session starts
        short = spec.replace(job=None, replica=None, task=None).to_string()
        if short not in local_short:
            missing.append(device)
    if missing:
        raise PlanError(
            f"the plan uses devices {missing} that this process does not have; available: {sorted(local_short)} "
            "(split the CPU with tf.config.set_logical_device_configuration for virtual devices)"
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


def build_pipeline(model_fn, features, labels, optimizer, plan, schedule="dapple", global_step=None):
    """Builds the DAPPLE training graph of `model_fn` for `plan` in the default graph.

    model_fn(features, labels) -> scalar mean loss, with layers marked by dapple_tf.layer; features
    and labels are the global batch (tensors or nests of tensors, leading dimension = batch);
    optimizer a tf.compat.v1.train.Optimizer; plan a dapple_tf.Plan, a plan proto or a plan file;
    schedule "dapple" (early backward) or "gpipe". Returns a PipelineHandle.
    """
    if schedule not in SCHEDULE_KINDS:
        raise PlanError(f"unknown schedule {schedule!r}; expected one of {SCHEDULE_KINDS}")
    plan = _as_plan(plan)
    plan = Plan(
        [dataclasses.replace(s, devices=tuple(canonical_device(d) for d in s.devices)) for s in plan.stages],
        plan.num_micro_batches,
        policy=plan.policy,
        warmup=plan.warmup,
        expected_layer_names=plan.expected_layer_names,
        source=plan.source,
    )
    _check_devices(plan.devices)
    graph = tf.compat.v1.get_default_graph()
    structure = (features, labels)
    real_inputs = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    if not real_inputs:
        raise DappleError("build_pipeline needs at least one feature or label tensor")
    placeholders, _ = template_lib.template_inputs(real_inputs)
    template_features, template_labels = tf.nest.pack_sequence_as(structure, placeholders)

    recorder = LayerRecorder(graph, device_for_layer=_LayerPlacer(plan))
    with recorder.activate():
        loss = model_fn(template_features, template_labels)
    if not recorder.layers:
        raise LayerMarkerError("model_fn marked no layers; wrap each layer in `with dapple_tf.layer(name):`")
    loss = tf.convert_to_tensor(loss)
    stages = plan.resolve(recorder.names)
    variables = tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
    inputs = {p.name: t for p, t in zip(placeholders, real_inputs)}
    template = template_lib.analyze(loss, inputs, recorder.layers, stages, variables)
    micro_size = microbatch.micro_batch_size(
        template.global_batch_size, plan.num_micro_batches, [s.replication for s in stages]
    )
    sched = plan.schedule(schedule)
    trainable = set(tf.compat.v1.trainable_variables())

    keys = collectives.CollectiveKeys(graph)
    copies = VariableCopies()
    builder = StageBuilder(graph, template, micro_size, plan.num_micro_batches, copies, trainable)
    builder.build_forward()
    builder.build_backward(sched)
    builder.chain(sched)

    with tf.device(stages[-1].devices[0]):
        loss_mean = tf.add_n(builder.weighted_losses, name="dapple_loss")

    grads_and_vars, apply_pairs = _reduce_gradients(builder.accumulated, copies, keys)
    train_op = optimizer.apply_gradients(apply_pairs, global_step=global_step)
    slot_pairs = copies.localize_slots(optimizer)
    broadcast = copies.broadcast_op(slot_pairs)
    local_init = _after_local_init(copies, slot_pairs, "dapple_local_init")
    with tf.control_dependencies([tf.compat.v1.global_variables_initializer()]):
        initializer = _after_local_init(copies, slot_pairs, "dapple_initializer")
    graph.add_to_collection(tf.compat.v1.GraphKeys.LOCAL_INIT_OP, local_init)
    return PipelineHandle(
        train_op=train_op,
        loss=loss_mean,
        grads_and_vars=grads_and_vars,
        schedule=sched,
        stages=stages,
        micro_batch_size=micro_size,
        initializer=initializer,
        local_init_op=local_init,
        broadcast_op=broadcast,
        task_op_names=builder.task_op_names(),
    )


def _after_local_init(copies: VariableCopies, slot_pairs, name: str) -> tf.Operation:
    """Local variable initialization, then the broadcast of the user's variables to the copies."""
    with tf.control_dependencies([tf.compat.v1.local_variables_initializer()]):
        return tf.group(copies.broadcast_op(slot_pairs), name=name)


def _reduce_gradients(accumulated, copies: VariableCopies, keys: collectives.CollectiveKeys):
    """AllReduce per (device set, dtype); returns (grads_and_vars, pairs to apply on every copy)."""
    devices_of: Dict[tf.Variable, Tuple[str, ...]] = {}
    for (variable, device) in accumulated:
        devices_of.setdefault(variable, ())
        devices_of[variable] += (device,)
    groups: Dict[Tuple[Tuple[str, ...], tf.DType], List[tf.Variable]] = {}
    for variable, devices in devices_of.items():
        groups.setdefault((tuple(sorted(devices)), variable.dtype.base_dtype), []).append(variable)
    reduced: Dict[Tuple[tf.Variable, str], tf.Tensor] = {}
    for (devices, _), group in groups.items():
        sums = collectives.all_reduce_sum({d: [accumulated[(v, d)] for v in group] for d in devices}, keys)
        everyone = [t for d in devices for t in sums[d]]
        for d in devices:
            for v, t in zip(group, sums[d]):
                reduced[(v, d)] = t
        for v in group:
            home = next((d for d, c in copies.copies_of(v).items() if c is v), devices[0])
            source = home if (v, home) in reduced else devices[0]
            if len(devices) > 1:
                # Fetching one device's sum must run every participant's collective.
                with tf.device(source), tf.control_dependencies(everyone):
                    reduced[(v, "exposed")] = tf.identity(reduced[(v, source)])
            else:
                reduced[(v, "exposed")] = reduced[(v, source)]
    grads_and_vars, apply_pairs = [], []
    for variable, devices in devices_of.items():
        grads_and_vars.append((reduced[(variable, "exposed")], variable))
        for device, copy in copies.copies_of(variable).items():
            grad = reduced.get((variable, device), reduced[(variable, "exposed")])
            apply_pairs.append((grad, copy))
    return grads_and_vars, apply_pairs
