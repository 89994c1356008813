"""The lowering: the pipeline program of a build made into TensorFlow operations for the devices of one graph.

build_pipeline computes the program of its layout (planner.formats.program: each replica's rows, each device's
tasks, the transfers and the reductions: plain data) and lowers it for this graph: every device (one graph for the
cluster, `OneGraph`) or one task's (a per-host graph, PipelineOptions.own_task, `TaskGraph`). The builders (stages/,
update/, pipeline.py) get the lowered object and never ask whether a device is this task's: they build for the
devices it lists (`built`, `replicas`) and let it decide, case by case, what today's graph does with what crosses to
another task: a boundary tensor or a gradient piece sent there or kept as a tensor (boundary_exchange.py), a sum
over the tasks (task_sums.py), a reduction's means (`exchanges`: TF's collective or the graph's own exchange, the
rule program.reduction_means states), the exchange's transfers (`move`), the instance keys every task's graph
shares, what is combined once per step, which variables this graph initializes, and the step's extra sends and
receives. OneGraph's methods are the identity or do nothing (every device built, nothing queued); TaskGraph's are
the per-host graph's (host_part.HostPart: its queues to the other tasks' graphs).
"""

from typing import Callable, Iterable, List, Optional, Sequence

import tensorflow as tf

from dapple_tf.errors import PerHostError
from dapple_tf.rewrite.graphs import graph_walk
from dapple_tf.rewrite.batch import sync_batch_norm
from dapple_tf.rewrite.hosts import (boundary_exchange, host_part, host_sync_batch_norm, host_transform,
                                     lowered_gradients, queue_names, task_sums)
from dapple_tf.rewrite.stages import boundaries as stage_boundaries
from dapple_tf.rewrite.update import collectives, loss_scaling
from planner.formats import program as program_lib


def lowering(program: program_lib.PipelineProgram, own_task: Optional[str], plan_devices: Sequence[str]
             ) -> "OneGraph":
    """`program` (build_pipeline's: planner.formats.program) lowered for one graph of every device (own_task None) or
    for task `own_task`'s graph; `plan_devices`: the plan's devices (a task must run some of them)."""
    task = None if own_task is None else host_part.checked_task(own_task, plan_devices)
    lowered = program_lib.lower(program, task)
    plan_order = [r.device for replicas in program.stages for r in replicas]
    if task is None:
        return OneGraph(lowered, plan_order)
    return TaskGraph(lowered, plan_devices, plan_order)


class OneGraph(host_part.InGraph):
    """The program lowered for one graph of every device: every device built here, every transfer a tensor."""

    def __init__(self, lowered: program_lib.Lowered, plan_devices: Sequence[str]):
        """plan_devices: every stage's devices in stage order (the plan's tasks are summed over in task_sums.py)."""
        self.lowered = lowered
        self.program = lowered.program
        self.devices = lowered.devices  # the devices this graph builds tasks on
        self.plan_devices = list(plan_devices)
        built = set(self.built(self.program.devices))
        # per stage, the replicas this graph builds (program.Replica: index, device, slice of each micro-batch)
        self.stage_replicas = tuple(tuple(r for r in replicas if r.device in built) for replicas in self.program.stages)

    # -- what this graph builds ------------------------------------------------------------------------------
    def built(self, devices: Iterable[str]) -> List[str]:
        """The devices among `devices` this graph builds, in their order."""
        return list(devices)

    def replicas(self, devices: Sequence[str]) -> List[tuple]:
        """(replica index, device) of the replicas among a stage's `devices` that this graph builds."""
        return list(enumerate(devices))

    def elsewhere(self, ops: Iterable[tf.Operation]) -> frozenset:
        """The operations among `ops` this graph made on other tasks' devices (a per-host graph's queues and
        enqueues there)."""
        del ops
        return frozenset()

    def elsewhere_variables(self, variables: Sequence[tf.Variable]) -> List[tf.Variable]:
        """The variables among `variables` on other tasks' devices, in their order."""
        del variables
        return []

    def boundaries(self, template, sizes: Sequence[Sequence[int]], differentiable: Callable
                   ) -> stage_boundaries.Boundaries:
        """The stage boundaries as this graph builds them (stages/boundaries.py): every replica's here."""
        return stage_boundaries.Boundaries(template, sizes, differentiable)

    # -- choices ---------------------------------------------------------------------------------------------
    def exchanges(self, devices: Sequence[str]) -> bool:
        """Whether a device set sums gradients by the graph's own exchange (update/collectives.exchange_sum), not
        TF's collectives: CPUs of several processes (program.reduction_means' rule)."""
        return collectives.uses_exchange(devices)

    def instance_key(self, keys: collectives.CollectiveKeys, devices: Sequence[str], name: str) -> int:
        """The instance key of a collective over `devices`: counted in this graph."""
        del devices, name
        return keys.instance_key()

    def statistics_hint(self, devices: Sequence[str]) -> str:
        """How sync batch norm sums a replicated stage's statistics over `devices`: a collective's hint."""
        return collectives.communication_hint(devices)

    def sync_keys(self, keys: collectives.CollectiveKeys, described: list) -> collectives.CollectiveKeys:
        """The keys of sync batch norm's collectives, given what they all-reduce (`described`): this graph's."""
        del described
        return keys

    def sum_marked_statistics(self, ops: Sequence[tf.Operation], key: str, replica: int, devices: Sequence[str]
                              ) -> None:
        """Sums sync batch norm's statistics marked among a clone's `ops` over the replicas on `devices`: one graph
        marks none (its statistics_hint is a collective's)."""
        del ops, key, replica, devices

    def loss_sum(self, by_device: dict, device: str, devices: Sequence[str], dtype: tf.DType) -> Optional[tf.Tensor]:
        """The loss's sums `by_device` summed per task, then over the tasks in order, on `device` (task_sums.py; None
        where `device` is another task's)."""
        return task_sums.summed_over_tasks(by_device, device, devices, self, queue_names.loss_key, dtype)

    # -- checks ----------------------------------------------------------------------------------------------
    def check_supported(self, options, optimizer, model_train) -> None:
        """Refuses what this graph does not build (nothing for one graph)."""
        del options, optimizer, model_train

    def check_sends_input_gradients(self, stage: int, producer_devices: Sequence[str]) -> None:
        """Called for a stage whose backward sends no input gradient to the replicas on `producer_devices`."""
        del stage, producer_devices

    # -- once per step ---------------------------------------------------------------------------------------
    def combined_once(self, builder, updates, summaries, device: str):
        """(extra outputs, update ops): what is combined over every clone once per step on `device` (the loss's),
        and the model's summaries built (StageBuilder, batch_norm's updates, summaries.Summaries)."""
        extra_outputs = builder.extra_outputs()
        update_ops = updates.build(builder.combined, device)
        summaries.build(builder.combined, device)
        return extra_outputs, update_ops

    def own_global_step(self, global_step):
        """The global step this graph's apply advances (None: another task's graph counts the steps)."""
        return global_step

    def cluster_gradients(self, builder, copies_of: Callable) -> lowered_gradients.GraphGradients:
        """The cluster's gradients as this graph reduces and transforms them (lowered_gradients.py)."""
        del copies_of
        return lowered_gradients.GraphGradients(self, builder.accumulator, self.plan_devices)

    def initializer(self, after_local_init: Callable[[], tf.Operation]) -> tf.Operation:
        """The handle's initializer: every global variable, then `after_local_init()` (local init, broadcast)."""
        with tf.control_dependencies([tf.compat.v1.global_variables_initializer()]):
            return after_local_init()

    def step_op(self, train_op: tf.Operation, loss: Optional[tf.Tensor]) -> tf.Operation:
        """The step: the apply."""
        del loss
        return train_op

    def ready_for_local_init(self, ops: Sequence[tf.Operation]) -> Optional[tf.Tensor]:
        """Other tasks' global variables `ops` read that are not yet initialized (None: no other task's)."""
        del ops
        return None


class TaskGraph(host_part.HostPart, OneGraph):
    """The program lowered for one task's graph (a per-host graph): its devices built, transfers to and from the
    other tasks' graphs through queues (host_part.HostPart)."""

    def __init__(self, lowered: program_lib.Lowered, plan_devices: Sequence[str], stage_devices: Sequence[str]):
        host_part.HostPart.__init__(self, lowered.own_task, plan_devices)
        OneGraph.__init__(self, lowered, stage_devices)
        differing = [d for d in lowered.program.devices if tf.DeviceSpec.from_string(d).job is not None
                     and self.is_local(d) != (d in self.devices)]
        if differing:
            raise AssertionError(f"the lowering and the graph disagree on which of {differing} are {self.task}'s")

    def built(self, devices: Iterable[str]) -> List[str]:
        return [d for d in devices if self.is_local(d)]

    def replicas(self, devices: Sequence[str]) -> List[tuple]:
        return [(j, d) for j, d in enumerate(devices) if self.is_local(d)]

    def elsewhere(self, ops: Iterable[tf.Operation]) -> frozenset:
        return frozenset(op for op in ops if not self.is_local(op.device))

    def elsewhere_variables(self, variables: Sequence[tf.Variable]) -> List[tf.Variable]:
        return [v for v in variables if not self.is_local(v.device)]

    def boundaries(self, template, sizes: Sequence[Sequence[int]], differentiable: Callable
                   ) -> boundary_exchange.BoundaryExchange:
        """What crosses to other tasks' replicas sent and received through queues (boundary_exchange.py)."""
        return boundary_exchange.BoundaryExchange(template, sizes, self, differentiable)

    def exchanges(self, devices: Sequence[str]) -> bool:
        """Every CPU group: TF's collectives across per-host sessions were not reliable (docs/design.md)."""
        return len(devices) > 1 and collectives.communication_hint(devices) != "nccl"

    def instance_key(self, keys: collectives.CollectiveKeys, devices: Sequence[str], name: str) -> int:
        """A group with other tasks' devices (GPUs: NCCL) takes the key every task's graph derives from `name`."""
        if any(not self.is_local(d) for d in devices):
            return keys.shared_instance_key(name)
        return keys.instance_key()

    def statistics_hint(self, devices: Sequence[str]) -> str:
        """CPU replicas sum through queues (host_sync_batch_norm.py); GPUs keep NCCL."""
        hint = collectives.communication_hint(devices)
        return hint if hint == "nccl" else sync_batch_norm.QUEUES

    def sum_marked_statistics(self, ops: Sequence[tf.Operation], key: str, replica: int, devices: Sequence[str]
                              ) -> None:
        """Through queues (host_sync_batch_norm.py)."""
        host_sync_batch_norm.replace_markers(ops, key, replica, devices)

    def sync_keys(self, keys: collectives.CollectiveKeys, described: list) -> collectives.CollectiveKeys:
        """A replica group's members in other tasks' graphs must use the same instance keys."""
        return collectives.CollectiveKeys.counted_alike(repr(described))

    def check_supported(self, options, optimizer, model_train) -> None:
        """Refuses, for a per-host graph, what it does not build yet: Horovod's reduction across processes, and a
        dynamic loss scale (each task would check only the gradients it applies)."""
        refused = []
        if options.cross_process_reduce is not None:
            refused.append("cross_process_reduce (Horovod)")
        if refused:
            raise PerHostError(f"per-host graphs (PipelineOptions.own_task) do not yet support {', '.join(refused)}: "
                               "build one graph for the cluster (own_task=None)")
        if loss_scaling.scales_dynamically(optimizer):
            raise PerHostError(
                f"per-host graphs (PipelineOptions.own_task) do not yet support a dynamic loss scale (the "
                f"MixedPrecisionLossScaleOptimizer applying gradients at {model_train.script.where}; "
                "enable_mixed_precision_graph_rewrite makes one by default): each task would skip or take the step "
                "by the gradients it holds. Give it a fixed loss scale (MixedPrecisionLossScaleOptimizer(optimizer, "
                "1024.0), enable_mixed_precision_graph_rewrite(optimizer, loss_scale=1024.0), or "
                "compute_gradients(loss * 1024.0) and each gradient / 1024.0), or build one graph for the cluster "
                "(own_task=None)")

    def check_sends_input_gradients(self, stage: int, producer_devices: Sequence[str]) -> None:
        """A producer replica on another task would wait for the input gradients."""
        if any(not self.is_local(d) for d in producer_devices):
            raise PerHostError(f"stage {stage}'s outputs get no gradient (nothing it computes reaches the loss), so "
                               "it sends no input gradients; per-host graphs (PipelineOptions.own_task) need every "
                               "stage to: move the stage boundary, or build one graph for the cluster "
                               "(own_task=None)")

    def combined_once(self, builder, updates, summaries, device: str):
        """On the loss's task, as one graph (the other tasks' clones' values received); on another task, its
        clones' values sent there (StageBuilder.send_extras), and none of them built."""
        if self.is_local(device):
            return OneGraph.combined_once(self, builder, updates, summaries, device)
        builder.send_extras(list(builder.template.extras) + updates.combined_extras() + summaries.combined_extras())
        summaries.build(None, device)
        return {}, []

    def own_global_step(self, global_step):
        if global_step is not None and not self.is_local(global_step.device):
            return None  # its own task's graph counts the steps
        return global_step

    def cluster_gradients(self, builder, copies_of: Callable) -> host_transform.TaskGradients:
        return host_transform.TaskGradients(self, builder, copies_of, self.plan_devices)

    def initializer(self, after_local_init: Callable[[], tf.Operation]) -> tf.Operation:
        """This task's global variables only (each is written once): copies of other tasks' variables wait for them
        (ready_for_local_init) in the local init."""
        del after_local_init
        own = [v for v in tf.compat.v1.global_variables() if self.is_local(v.device)]
        return tf.compat.v1.variables_initializer(own, name="dapple_initializer")

    def step_op(self, train_op: tf.Operation, loss: Optional[tf.Tensor]) -> tf.Operation:
        """The apply, every send (no later task waits for some), every receive (`takes`) and the loss where it is
        summed."""
        extra = self.sends() + self.takes() + ([loss.op] if loss is not None else [])
        return tf.group(train_op, *extra, name="dapple_host_step")

    def ready_for_local_init(self, ops: Sequence[tf.Operation]) -> tf.Tensor:
        read = set().union(*map(graph_walk.ancestors, ops))
        remote = [v for v in tf.compat.v1.global_variables() if not self.is_local(v.device) and v.op in read]
        uninitialized = tf.compat.v1.report_uninitialized_variables(remote, name="dapple_remote_uninitialized")
        uninitialized.mark_used()  # a handle's field, fetched by whoever starts the session (host_session.start)
        return uninitialized
