"""Builds every stage's forward and backward tasks per micro-batch and replica.

Forward task (s, m, j): slices of the inputs and of earlier stages' outputs for micro-batch m,
replica j (split/concat between stages of different replication: boundaries.py, as the lowering gives it), then the
stage's operations imported under replica j's device. The replicas and their slices are the pipeline
program's, as the lowering lists those this graph builds. Backward task (s, m, j): the gradient pieces
later stages sent for this clone's outputs are concatenated into grad_ys; `tf.gradients` of the clone gives the
gradients of its inputs (cut into pieces for the producing replicas) and of its variables (added
to a running sum per variable and device, so no more than one accumulated copy is alive).
The loss of replica j is weighted by its slice's share of the global batch, so summing over
micro-batches and replicas gives exactly the full-batch mean and its gradient.
With sync batch norm (sync_batch_norm.py), a replicated stage's GraphDef is rewritten before cloning so
that its batch norms all-reduce their statistics across the replicas; each clone feeds the instance
keys of its micro-batch (shared by the replicas, distinct per micro-batch and per recomputation).
A stage with re-computation differentiates, in its backward task, a second clone fed by what
the forward clone was fed (recompute.py) instead of the forward clone.
With stage functions, a stage is built once as forward, input-gradient and weight-gradient functions,
and each task calls them (stage_function.py); a stage the function path does not cover is imported per
clone, and `function_fallbacks` says why. By default (stage_functions=None) the functions are used when
the clones would be large (`stage_function.use_functions`).
"""

import dataclasses
import random
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.rewrite.batch import sync_batch_norm
from dapple_tf.rewrite.graphs import graph_defs as graph_defs_lib, v1_control_flow
from dapple_tf.rewrite.stages import stage_function, tasks
from dapple_tf.rewrite.template import outputs as outputs_lib, recompute as recompute_lib
from dapple_tf.rewrite.update import collectives, gradient_kinds
from dapple_tf.errors import PerHostError, PlanError
from dapple_tf.rewrite.update.gradients import GradientAccumulator
from dapple_tf.rewrite.stages import weight_batching
from dapple_tf.rewrite.update.replicas import VariableCopies
from dapple_tf.rewrite.template.template import BOUNDARY, EXTERNAL, INPUT, SHAPE, VARIABLE, Template
from planner.formats.schedule import BACKWARD, BATCHED_W, FORWARD, Task


@dataclasses.dataclass
class _Clone:
    """One forward clone: what it was fed and what it produced."""

    inputs: Dict[str, tf.Tensor]  # template tensor name -> the tensor fed in its place
    outputs: Dict[str, tf.Tensor]  # template tensor name -> the clone's tensor
    loss: tf.Tensor = None
    extras: Dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)  # model_fn's extra outputs
    salt: int = 0  # its random ops' seed salt (graph_defs.private_copy)
    env: Dict[str, tf.Tensor] = None  # a function stage's call: what its F call produced (stage_function.py)


def _differentiable(t: tf.Tensor) -> bool:
    return t.dtype.base_dtype.is_floating or t.dtype.base_dtype.is_complex


def _wanted(stage, extras: bool = True) -> List[str]:
    """Names of the template tensors a clone of `stage` returns: its outputs, its loss, its extra outputs."""
    wanted = [t.name for t in stage.outputs] + ([stage.loss.name] if stage.loss is not None else [])
    if extras:
        wanted += [t.name for t in stage.extra_outputs if t.name not in wanted]
    return wanted


class StageBuilder:
    """Forward and backward tasks of every stage; see the module docstring."""

    def __init__(
        self,
        graph: tf.Graph,
        template: Template,
        copies: VariableCopies,
        trainable: set,
        lowering,
        sync_keys: collectives.CollectiveKeys = None,
        stage_functions: bool = None,
        traced_functions: bool = False,
        sync_statistics: Sequence[Dict[str, object]] = None,
        input_gradients_first: bool = True,
        square_sparse: bool = False,
        loss_seed=None,
    ):
        """lowering: the program lowered for this graph (hosts/lowering.py: OneGraph, every device's tasks, or a
        per-host graph's TaskGraph, one task's): its `program` (M, the schedule, which stages recompute, every
        stage's replicas and their slices), the replicas this graph builds, and what crosses to other tasks;
        sync_keys: given, replicated stages synchronize their batch norms (sync_batch_norm.py) with these keys;
        sync_statistics: per stage, the batch statistics to synchronize (batch_norm.prepare's `synchronized`;
        None: every training-mode fused norm).
        stage_functions: build stages as functions (stage_function.py) where they can be: True, False, or None
        (when the clones would be large).
        traced_functions: their calls are PartitionedCall ops, whose bodies a traced step records (PipelineOptions).
        input_gradients_first: each backward task runs its input gradients first (PipelineOptions).
        square_sparse: the accumulator keeps the squares of gathered rows' gradients (global-norm clipping).
        loss_seed: (loss weight n_mj / N, the loss's dtype) -> the gradient each clone's loss is differentiated with
        (a script's loss scale: gradient_replay.loss_seed); None: the weight."""
        program = lowering.program
        if not input_gradients_first and (program.schedule.splits_backward or program.schedule.kind == BATCHED_W):
            raise PlanError(f"schedule {program.schedule.kind!r} splits every backward into input and weight "
                            "gradients: input_gradients_first=False applies to schedules dapple, gpipe and interleaved")
        self.graph = graph
        self.template = template
        self.program = program
        self.copies = copies
        self.trainable = trainable
        self._graph_defs: List[graph_defs_lib.StageGraphDef] = []
        self.task_ops = tasks.TaskOps(graph)
        self.clones: Dict[Tuple[int, int, int], _Clone] = {}
        self.lowering = lowering
        # per stage, the replicas this graph builds (planner.formats.program.Replica: device, slice of rows)
        self._built = lowering.stage_replicas
        self._loss_seed = loss_seed or (lambda weight, dtype: tf.constant(weight, dtype=dtype))
        self._weighted_losses: Dict[Tuple[int, int], tf.Tensor] = {}  # (micro-batch, replica) -> loss term
        self.accumulator = GradientAccumulator(square_sparse)
        self._sizes = [tuple(r.rows for r in replicas) for replicas in program.stages]
        # the stage boundaries as this graph builds them (boundaries.py; a per-host graph's send and receive what
        # crosses to other tasks' replicas)
        self.boundaries = lowering.boundaries(template, self._sizes, self._differentiable_boundary)
        self._sync_keys = sync_keys
        self._sync_statistics = sync_statistics
        self._recompute_sync_bases: Dict[Tuple[int, int], int] = {}
        self._keys_per_clone_group = [0] * len(template.stages)  # instance keys of a stage's synced batch norms
        self._queued_statistics = set()  # stages whose synchronized statistics are summed through queues (per host)
        self._gradient_split: Dict[Tuple[int, int, int], tuple] = {}  # backward task -> (input, weight grads, device)
        self._stage_functions = stage_functions
        self._traced_functions = traced_functions
        self._input_gradients_first = input_gradients_first
        self._functions: Dict[int, stage_function.StageFunctions] = {}
        self.function_fallbacks: Dict[int, str] = {}  # stage -> why it is imported per clone

    # -- forward ---------------------------------------------------------------------------
    def _micro_batch_inputs(self) -> List[Dict[str, tf.Tensor]]:
        b = self.program.micro_batch_size
        per_micro = []
        for m in range(self.program.num_micro_batches):
            slices = {}
            for name, t in self.template.inputs.items():
                with tf.device(t.device or None), tf.name_scope(f"dapple/inputs/mb{m}"):
                    slices[name] = t[m * b : (m + 1) * b]
            per_micro.append(slices)
        return per_micro

    def build_forward(self) -> None:
        # Variable copies first, so that no task captures their creation.
        for stage, replicas in zip(self.template.stages, self._built):
            for ext in stage.externals:
                variable = self.template.variable_of_handle.get(ext.tensor.name)
                if ext.kind == VARIABLE and variable in self.trainable:
                    for replica in replicas:
                        self.copies.handle_for(variable, replica.device)
        graph_defs = graph_defs_lib.stage_graph_defs(self.graph, [st.ops for st in self.template.stages])
        seeds = random.Random()  # for unseeded random ops of recomputed stages, like TF's own choice
        for s, again in enumerate(self.program.recompute):
            if again:
                recompute_lib.check_repeatable(graph_defs[s], s)
                graph_defs[s] = recompute_lib.with_fixed_seeds(graph_defs[s], seeds)
        if self._sync_keys is not None:
            self._synchronize_batch_norms(graph_defs)
        self._graph_defs = graph_defs
        if self._uses_functions():
            self._define_functions(graph_defs)
        imported = self._imported_micro_batches()
        micro_inputs = self._micro_batch_inputs()
        n = self.template.global_batch_size
        clones_before = 0  # every clone of the plan counted, built here or not: its seeds do not depend on the host
        for m in range(self.program.num_micro_batches):
            for s, stage in enumerate(self.template.stages):
                sizes = self._sizes[s]
                sync_base = self._sync_base(s)
                if self.program.recompute[s]:  # allocated here, in the same order by every task's graph
                    self._recompute_sync_bases[(s, m)] = self._sync_base(s)
                for replica in self._built[s]:
                    j, device, start = replica.index, replica.device, replica.first_row
                    clone_id = clones_before + j + 1
                    with self.task_ops.capture(Task(s, FORWARD, m), j), tf.device(device):
                        feed = {}
                        with tf.name_scope(f"dapple/feed/stage{s}/mb{m}/r{j}"):
                            for ext in stage.externals:
                                feed[ext.tensor.name] = self._feed(ext, m, (s, j), start, sizes[j], micro_inputs[m],
                                                                   device)
                        wanted = _wanted(stage)
                        env = None
                        if s in self._functions and (s, m) not in imported:
                            with tf.name_scope(f"dapple/stage{s}/mb{m}/r{j}"):
                                env = self._functions[s].forward(feed, device)
                            by_name = self._functions[s].outputs(env)
                        else:
                            graph_def = graph_defs_lib.private_copy(graph_defs[s], f"_dapple_s{s}_m{m}_r{j}", clone_id)
                            input_map = dict(feed, **self._sync_feed(sync_base))
                            first_op = len(self.graph.get_operations())
                            results = v1_control_flow.import_clone(graph_def, graph_defs[s].contexts, input_map,
                                                                   wanted, f"dapple/stage{s}/mb{m}/r{j}")
                            self._sum_queued_statistics(s, j, f"{s}/{m}/forward", first_op)
                            by_name = dict(zip(wanted, results))
                    clone = _Clone(inputs=feed, outputs={t.name: by_name[t.name] for t in stage.outputs}, salt=clone_id,
                                   env=env)
                    clone.extras = {t.name: by_name[t.name] for t in stage.extra_outputs}
                    if stage.loss is not None:
                        clone.loss = by_name[stage.loss.name]
                        with tf.device(device):
                            weight = tf.constant(sizes[j] / n, dtype=clone.loss.dtype)
                            self._weighted_losses[(m, j)] = clone.loss * weight
                    self.clones[(s, m, j)] = clone
                    with self.task_ops.capture(Task(s, FORWARD, m), j), tf.device(device):
                        self.boundaries.send_outputs(s, m, j, clone.outputs)
                clones_before += len(stage.stage.devices)

    def _imported_micro_batches(self) -> set:
        """(stage, micro-batch) imported per clone even where the stage is a function: a replicated stage's last
        backward, whose gradients are all-reduced bucket by bucket as soon as each is ready (gradients.py); a
        function call returns all its outputs at once, at its end."""
        imported = set()
        for s, stage in enumerate(self.template.stages):
            backward = [t.micro_batch for t in self.program.schedule.stage_tasks[s] if t.kind == BACKWARD]
            if s in self._functions and len(stage.stage.devices) > 1 and backward:
                imported.add((s, backward[-1]))
        return imported

    def _define_functions(self, graph_defs: List[graph_defs_lib.StageGraphDef]) -> None:
        for s, stage in enumerate(self.template.stages):
            if not self._built[s]:
                continue
            reason = stage_function.unsupported_reason(graph_defs[s], self.program.recompute[s],
                                                       self._keys_per_clone_group[s] > 0)
            if reason is not None:
                self.function_fallbacks[s] = reason
                continue
            signature = stage_function.StageSignature(
                inputs=[ext.tensor for ext in stage.externals],
                outputs=_wanted(stage),
                differentiable_outputs=[t.name for t in stage.outputs if _differentiable(t)],
                loss=stage.loss.name if stage.loss is not None else None,
                differentiable_inputs=[e.tensor.name for e in self._differentiable_boundary(stage)],
                weights=[e.tensor.name for e in self._trainable_externals(stage)],
            )
            try:
                self._functions[s] = stage_function.StageFunctions(graph_defs[s].graph_def, signature,
                                                                   f"dapple_stage{s}", self._traced_functions)
            except (ValueError, TypeError) as e:  # a stage shape the cut does not handle: clones, with the reason
                self.function_fallbacks[s] = f"it could not be built as functions: {e}"

    def _synchronize_batch_norms(self, graph_defs: List[graph_defs_lib.StageGraphDef]) -> None:
        described = []
        for s, stage in enumerate(self.template.stages):
            devices = stage.stage.devices
            if len(devices) > 1:
                statistics = self._sync_statistics[s] if self._sync_statistics is not None else None
                hint = self.lowering.statistics_hint(devices)
                if hint == sync_batch_norm.QUEUES:
                    self._queued_statistics.add(s)
                synced = sync_batch_norm.rewrite(graph_defs[s], s, devices, self._sync_keys.group_key(devices), hint,
                                                 statistics)
                graph_defs[s] = synced.stage
                self._keys_per_clone_group[s] = synced.num_keys
                described.append((s, tuple(devices), [self._described_statistic(n) for n in synced.synchronized]))
        # per host: a replica group's members in other tasks' graphs must use the same instance keys
        self._sync_keys = self.lowering.sync_keys(self._sync_keys, described)

    def _described_statistic(self, name: str) -> tuple:
        """What a synchronized statistic all-reduces, as far as its shapes go: its node's inputs in the template."""
        op = self.graph.get_operation_by_name(name)
        return name, tuple((t.dtype.name, str(t.shape)) for t in op.inputs)

    def _sync_base(self, s: int):
        """The first instance key of a new clone group of stage s (None when it synchronizes nothing, or through
        queues)."""
        count = self._keys_per_clone_group[s]
        return self._sync_keys.instance_keys(count) if count and s not in self._queued_statistics else None

    def _sum_queued_statistics(self, s: int, j: int, key: str, first_op: int) -> None:
        """Sums the synchronized statistics of the clone of replica j imported since operation `first_op` through
        queues (the lowering's), where stage s does so."""
        if s in self._queued_statistics:
            self.lowering.sum_marked_statistics(self.graph.get_operations()[first_op:], f"dapple/sync/{key}", j,
                                                self.template.stages[s].stage.devices)

    @staticmethod
    def _sync_feed(base) -> Dict[str, tf.Tensor]:
        return sync_batch_norm.instance_base_feed(base) if base is not None else {}

    def _feed(self, ext, m, consumer: Tuple[int, int], start, size, micro_inputs, device) -> tf.Tensor:
        """What clone `consumer` (stage, replica) of micro-batch m reads for external `ext`."""
        if ext.kind == INPUT:
            return micro_inputs[ext.tensor.name][start : start + size]
        if ext.kind == VARIABLE:
            variable = self.template.variable_of_handle[ext.tensor.name]
            if variable not in self.trainable:
                return variable.handle  # read the user's own: nothing keeps a copy of it current
            return self.copies.handle_for(variable, device)
        if ext.kind == EXTERNAL:
            return ext.tensor
        if ext.kind == SHAPE:  # read at this clone's slice size
            return tf.constant(self.template.shapes.value(ext.tensor, size), name="shape_value")
        p = ext.producer_stage
        return self.boundaries.read(ext, m, consumer, start, size, device,
                                  lambda i: self.clones[(p, m, i)].outputs[ext.tensor.name])

    def loss_mean(self, device: str) -> Optional[tf.Tensor]:
        """The mean loss over the global batch on `device`: each clone's loss weighted by its slice's share of the
        batch, summed over the micro-batches on its replica's device, then per task and over the tasks in order
        (the lowering's: hosts/task_sums.py), so that the loss's task receives one term per task. None in a per-host graph where `device`
        is another task's (this task's sum is sent there)."""
        loss_stage = next(st for st in self.template.stages if st.loss is not None)
        devices = loss_stage.stage.devices
        terms: Dict[str, List[tf.Tensor]] = {}
        for (_, j), term in sorted(self._weighted_losses.items()):
            terms.setdefault(devices[j], []).append(term)
        sums = {}
        for d, per_micro_batch in terms.items():
            with tf.device(d):
                sums[d] = collectives.ordered_sum(per_micro_batch)
        return self.lowering.loss_sum(sums, device, devices, loss_stage.loss.dtype.base_dtype)

    def variable_devices(self) -> Dict[tf.Variable, Tuple[str, ...]]:
        """Per trainable variable this graph holds a gradient of, every device of the cluster that accumulates
        one (what GradientAccumulator.devices_of gives in one graph, in the same order): the devices of the
        stages that read it, but those of a stage whose replica here got no gradient of it."""
        out: Dict[tf.Variable, Tuple[str, ...]] = {}
        local = self.accumulator.devices_of()
        for stage in reversed(self.template.stages):
            devices = stage.stage.devices
            for ext in self._trainable_externals(stage):
                variable = self.template.variable_of_handle[ext.tensor.name]
                here = [r.device for r in self._built[stage.stage.index]]
                if here and not set(here) <= set(local.get(variable, ())):
                    continue
                out[variable] = out.get(variable, ()) + tuple(d for d in devices if d not in out.get(variable, ()))
        return {v: devices for v, devices in out.items() if v in local}

    def gradient_kinds(self) -> Dict[tf.Variable, bool]:
        """Per trainable variable some stage of the cluster gives a gradient, whether every such stage gives gathered
        rows (gradient_kinds.py): read from the template for other tasks' stages, from the clones for this task's
        (which must agree with the template on the kind)."""
        kinds: Dict[tf.Variable, bool] = {}
        for stage in self.template.stages:
            targets = [t.op for t in stage.outputs if _differentiable(t)] + ([stage.loss.op] if stage.loss is not None
                                                                             else [])
            ops = gradient_kinds.carrying_gradients(targets, set(stage.ops))
            for ext in self._trainable_externals(stage):
                variable = self.template.variable_of_handle[ext.tensor.name]
                gathered = gradient_kinds.gathered_rows_only(ext.tensor, ops)
                local = [r.device for r in self._built[stage.stage.index]]
                here = [d for d in local if (variable, d) in self.accumulator.sums]
                if here and self.accumulator.is_sparse(variable, here) != gathered:
                    got = "gathered rows" if not gathered else "a dense gradient"
                    raise PerHostError(
                        f"per-host graphs (PipelineOptions.own_task): the uses of {variable.op.name} in stage "
                        f"{stage.stage.index} give {got}, which its operations do not tell the other tasks: build one "
                        "graph for the cluster (own_task=None)")
                if here or (not local and any(op in ops for op in ext.tensor.consumers())):
                    kinds[variable] = kinds.get(variable, True) and gathered
        return kinds

    def copy_devices(self) -> Dict[tf.Variable, Tuple[str, ...]]:
        """Per trainable variable a stage reads, every device of the cluster whose replica reads it (where the one
        graph has its copies), in order."""
        out: Dict[tf.Variable, Tuple[str, ...]] = {}
        for stage in self.template.stages:
            for ext in self._trainable_externals(stage):
                variable = self.template.variable_of_handle[ext.tensor.name]
                out[variable] = tuple(sorted(set(out.get(variable, ())) | set(stage.stage.devices)))
        return out

    def extra_outputs(self) -> Dict[str, tf.Tensor]:
        """model_fn's extra outputs, each combined over micro-batches and replicas (outputs.py)."""
        return {extra.name: self.combined(extra) for extra in self.template.extras}

    def combined(self, extra) -> tf.Tensor:
        """One outputs.ExtraOutput's global-batch value, from the clones of its stage. In a per-host graph that
        combines on the loss's device (StageBuilder.send_extras), the values of other tasks' clones are received;
        and a stage whose first device is another task's is combined on the loss's device."""
        s = extra.stage
        sizes = self._sizes[s] if s >= 0 else ()
        devices = self.template.stages[s].stage.devices if s >= 0 else ()
        loss_device = self.program.stages[-1][0].device
        per_clone = {}
        for m, j in outputs_lib.clone_keys(extra, self.program.num_micro_batches, len(sizes)):
            per_clone[(m, j)] = self.boundaries.extra_value(extra.tensor, s, m, j, self._extra_of(s, m, j, extra),
                                                          loss_device)
        devices = self.boundaries.combining_devices(devices, loss_device)
        return outputs_lib.combine(extra, per_clone, sizes, self.program.num_micro_batches, devices,
                                   self.template.inputs)

    def send_extras(self, extras) -> None:
        """In a per-host graph of a task that is not the loss's: sends this task's clones' values of `extras`
        (outputs.ExtraOutput) to the loss's device, where `combined` combines them, in the same order."""
        loss_device = self.program.stages[-1][0].device
        for extra in extras:
            s = extra.stage
            sizes = self._sizes[s] if s >= 0 else ()
            for m, j in outputs_lib.clone_keys(extra, self.program.num_micro_batches, len(sizes)):
                self.boundaries.send_extra(extra.tensor, s, m, j, self._extra_of(s, m, j, extra), loss_device)

    def _extra_of(self, s: int, m: int, j: int, extra) -> Callable[[], tf.Tensor]:
        """Clone (s, m, j)'s value of an outputs.ExtraOutput, when this graph built the clone."""
        return lambda: self.clones[(s, m, j)].extras[extra.tensor.name]

    # -- backward --------------------------------------------------------------------------
    def build_backward(self) -> None:
        stages = self.template.stages
        for s in reversed(range(len(stages))):
            order = [t.micro_batch for t in self.program.schedule.stage_tasks[s] if t.kind == BACKWARD]
            for m in order:
                for replica in self._built[s]:
                    j, device = replica.index, replica.device
                    with self.task_ops.capture(Task(s, BACKWARD, m), j), tf.device(device):
                        self._backward_task(s, m, j, device)

    def _recomputed(self, s: int, m: int, j: int) -> _Clone:
        """The forward clone (s, m, j) imported again from its inputs, in the current task."""
        stage, forward = self.template.stages[s], self.clones[(s, m, j)]
        wanted = _wanted(stage, extras=False)
        graph_def = graph_defs_lib.private_copy(self._graph_defs[s], f"_dapple_s{s}_m{m}_r{j}_rc", forward.salt)
        first_op = len(self.graph.get_operations())
        feed, outputs = recompute_lib.recomputed_clone(
            stage, graph_def, forward.inputs, wanted, name=f"dapple/stage{s}/mb{m}/r{j}/recompute",
            extra_feed=self._sync_feed(self._recompute_sync_bases[(s, m)]), contexts=self._graph_defs[s].contexts,
        )
        self._sum_queued_statistics(s, j, f"{s}/{m}/recomputed", first_op)
        loss = outputs.pop(stage.loss.name) if stage.loss is not None else None
        return _Clone(inputs=feed, outputs=outputs, loss=loss, salt=forward.salt)

    def _differentiable_boundary(self, stage) -> list:
        return [e for e in stage.externals if e.kind == BOUNDARY and _differentiable(e.tensor)]

    def _trainable_externals(self, stage) -> list:
        return [e for e in stage.externals
                if e.kind == VARIABLE and self.template.variable_of_handle[e.tensor.name] in self.trainable]

    def _backward_task(self, s: int, m: int, j: int, device: str) -> None:
        stage, clone = self.template.stages[s], self.clones[(s, m, j)]
        output_grads = {name: self.boundaries.output_gradient(s, m, j, name, out, device)
                        for name, out in clone.outputs.items()}
        boundary = self._differentiable_boundary(stage)
        if not any(g is not None for g in output_grads.values()) and clone.loss is None:
            self._check_nothing_expected(s, boundary)
            return
        trainable = self._trainable_externals(stage)
        loss_weight = self._sizes[s][j] / self.template.global_batch_size
        summed = False
        if clone.env is not None:
            input_grads, weight_grads, summed = self._function_gradients(s, clone, output_grads, loss_weight,
                                                                         trainable, device)
        else:
            input_grads, weight_grads = self._clone_gradients(s, m, j, clone, output_grads, loss_weight,
                                                              boundary, trainable)
        if input_grads is None:
            return
        sent, accumulated = [], []
        for ext in boundary:
            grad = input_grads.get(ext.tensor.name)
            if grad is None:
                grad = tf.zeros_like(clone.inputs[ext.tensor.name])
            sent.extend(self.boundaries.cut_input_gradient(ext, s, m, j, tf.convert_to_tensor(grad)))
        for ext in trainable:
            grad = weight_grads.get(ext.tensor.name)
            if grad is not None:
                variable = self.template.variable_of_handle[ext.tensor.name]
                if summed and not isinstance(grad, tf.IndexedSlices):
                    self.accumulator.set_sum(variable, device, grad)
                else:
                    self.accumulator.add(variable, device, grad)
                accumulated.extend([grad.values, grad.indices] if isinstance(grad, tf.IndexedSlices) else [grad])
        self._gradient_split[(s, m, j)] = (sent, accumulated, device)

    def _function_gradients(self, s: int, clone: _Clone, output_grads, loss_weight, trainable, device):
        """A function stage's B and W calls (stage_function.py), W adding to the device's running sums once they
        exist; an output no later stage sent a gradient for gets zeros."""
        functions = self._functions[s]
        grads = {name: output_grads[name] if output_grads[name] is not None else tf.zeros_like(clone.outputs[name])
                 for name in functions.signature.differentiable_outputs}
        weight = self._loss_seed(loss_weight, clone.loss.dtype) if clone.loss is not None else None
        sums = {e.tensor.name: self.accumulator.running_sum(self.template.variable_of_handle[e.tensor.name], device)
                for e in trainable}
        return functions.backward(clone.env, grads, weight, device,
                                  {n: t for n, t in sums.items() if t is not None})

    def _clone_gradients(self, s, m, j, clone, output_grads, loss_weight, boundary, trainable):
        """`tf.gradients` of an imported clone (or of its recomputed twin): ({input name: gradient},
        {handle name: gradient}), or (None, None) when there is nothing to differentiate."""
        if self.program.recompute[s]:
            clone = self._recomputed(s, m, j)
        ys, grad_ys = [], []
        for name, out in clone.outputs.items():
            if output_grads[name] is not None:
                ys.append(out)
                grad_ys.append(output_grads[name])
        if clone.loss is not None:
            ys.append(clone.loss)
            grad_ys.append(self._loss_seed(loss_weight, clone.loss.dtype))
        xs = [clone.inputs[e.tensor.name] for e in boundary] + [clone.inputs[e.tensor.name] for e in trainable]
        if not ys or not xs:
            return None, None
        # A stage whose input gradients an earlier stage waits for computes them first (tasks.input_gradients_first).
        # The first stage gates its gradients instead (as Optimizer.minimize's default GATE_OP): an op's gradients
        # all complete before any is used, so each layer's weight gradient is ready before the backward moves to
        # earlier layers, and a gradient bucket can be all-reduced while they run (gradients.py). Not where the
        # weight gradients are stacked after the last backward (weight_batching.py): the gates would keep the
        # per-micro-batch products running.
        gate = not boundary and self.program.schedule.kind != BATCHED_W
        grads = tf.compat.v1.gradients(ys, xs, grad_ys=grad_ys, colocate_gradients_with_ops=True, gate_gradients=gate)
        names = [e.tensor.name for e in boundary] + [e.tensor.name for e in trainable]
        by_name = dict(zip(names, grads))
        return ({e.tensor.name: by_name[e.tensor.name] for e in boundary},
                {e.tensor.name: by_name[e.tensor.name] for e in trainable})

    def _check_nothing_expected(self, s: int, boundary) -> None:
        """A backward task that sends no input gradient (no gradient reached its stage): in a per-host graph, a
        producer replica on another task would wait for it (the lowering refuses it)."""
        self.lowering.check_sends_input_gradients(
            s, [d for e in boundary for d in self.template.stages[e.producer_stage].stage.devices])

    def _uses_functions(self) -> bool:
        """stage_function.use_functions, except that schedule dapple-batched-w stacks weight gradients of clones
        only: by default its stages are cloned; asked for functions, it warns that they are not stacked."""
        if self.program.schedule.kind != BATCHED_W:
            functions = stage_function.use_functions(self._stage_functions, self.template.stages,
                                                     self.program.num_micro_batches)
            if functions and not self._input_gradients_first:
                warnings.warn("input_gradients_first=False with stage functions: each backward is still a B call "
                              "(input gradients) then a W call", UserWarning, stacklevel=4)
            return functions
        if self._stage_functions:
            warnings.warn(f"schedule {BATCHED_W!r} with stage_functions=True: each call computes its weight gradients "
                          "itself, so they are not stacked over the micro-batches (stages cloned per micro-batch "
                          "are: stage_functions=None or False)", UserWarning, stacklevel=4)
        return bool(self._stage_functions)

    # -- schedule --------------------------------------------------------------------------
    def chain(self) -> None:
        schedule = self.program.schedule
        self.task_ops.release_forward_inputs()
        if schedule.splits_backward and schedule.kind != BATCHED_W:  # B and W are tasks of their own (zero bubble)
            for key in [key for key in self.task_ops.ops if key[0].kind == BACKWARD]:
                input_grads = self._gradient_split.get((key[0].stage, key[0].micro_batch, key[1]), ((),))[0]
                self.task_ops.split_weight_task(key, input_grads)
        elif self._input_gradients_first:
            for (s, m, j), (input_grads, weight_grads, device) in self._gradient_split.items():
                self.task_ops.input_gradients_first((Task(s, BACKWARD, m), j), input_grads, weight_grads, device)
            if schedule.kind == BATCHED_W:  # W: the weight gradients stacked over all micro-batches
                weight_batching.batch_weight_gradients(self.task_ops, self.accumulator)
        elsewhere = self.lowering.elsewhere(op for ops in self.task_ops.ops.values() for op in ops)
        for lane, lane_tasks in enumerate(schedule.lane_tasks):  # a device group runs the tasks of all its stages
            for j, device in enumerate(self.template.stages[lane].stage.devices):
                tasks.chain(self.task_ops, lane_tasks, j, device, elsewhere)

    def function_call_ops(self) -> Tuple[tf.Operation, ...]:
        """The call operations of the stages built as functions."""
        return tuple(op for functions in self._functions.values() for op in functions.call_ops)

    def task_op_names(self, input_gradients: bool = False) -> Dict[Tuple[str, Task, int], Tuple[str, ...]]:
        """(device, task, replica) -> names of the task's operations (or, with input_gradients, of those its
        input gradients need: backward tasks split into B and W only)."""
        devices = {(st.stage.index, j): d for st in self.template.stages for j, d in enumerate(st.stage.devices)}
        names = self.task_ops.names(self.task_ops.input_gradient_ops if input_gradients else None)
        return {(devices[(task.stage, replica)], task, replica): n for (task, replica), n in names.items()}
