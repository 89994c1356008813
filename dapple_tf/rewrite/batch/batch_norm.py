"""Batch normalization in the pipelined graph: the model's UPDATE_OPS run once per step, and a warning.

In the template, an update op (a moving-average assign, or anything else in the UPDATE_OPS collection)
reads statistics computed by a stage (a batch mean, a batch variance) through ops of its own (the
decay arithmetic) and assigns a variable. In the pipelined graph every clone of that stage computes
the statistics of its own slice; `UpdateOps` adds those statistics to the clones' outputs, averages
them over micro-batches and replicas (weighted by each slice's share of the global batch: the mean of
the micro-batch statistics), and imports the update's own ops once, fed by the averages. The moving
averages are then those of a single-device model that saw each step's micro-batch statistics
averaged. Normalization itself uses each slice's statistics (micro-batch semantics): build_pipeline
warns (BatchNormWarning) naming the batch-norm ops. With batch_norm="sync" a replicated stage's
batch statistics are those of the whole micro-batch (sync_batch_norm.py), and so are the statistics
the update ops read: the warning is then about micro-batches only (none when there is one).

What is a batch norm is decided by what it computes (normalization.py): statistics reducing over the
sample axis, fused (FusedBatchNorm*) or not (tf.nn.moments' means). Per-sample normalizations (Keras
LayerNormalization, which Keras 2 computes with FusedBatchNormV3 over a reshaped tensor,
GroupNormalization, instance norms) are neither warned about nor synchronized; with batch_norm="sync"
non-fused batch statistics of replicated stages are synchronized too. Only statistics whose sample axis
is followed from the inputs are told apart: after an op the analysis does not follow (a Keras RNN's
loop) training-mode fused norms are batch norms, and sync refuses a replicated stage's keep-dims Mean or
Sum over axis 0, as before the analysis.

Variable assignments computed from the batch that nothing runs (Keras 3 layers assign their moving
statistics when called in training mode, and in a graph nothing runs those assignments unless they are
in UPDATE_OPS) get a MovingStatisticsWarning; `collect_updates` adds a block's assignments to UPDATE_OPS.
"""

import contextlib
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import tensorflow as tf

from dapple_tf.rewrite.batch import normalization
from dapple_tf.rewrite.graphs import graph_defs as graph_defs_lib
from dapple_tf.rewrite.template import outputs as outputs_lib
from dapple_tf.errors import DappleError

PER_SLICE, SYNC = "per_slice", "sync"
MODES = (PER_SLICE, SYNC)


class BatchNormWarning(UserWarning):
    """Batch statistics are computed per micro-batch slice, not over the global batch."""


class MovingStatisticsWarning(BatchNormWarning):
    """model_fn assigns variables from the batch (moving statistics) in ops that nothing runs."""


_ASSIGNS = ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp", "Assign", "AssignSub", "AssignAdd")


_READ_BACKS = ("ReadVariableOp", "Identity") + _ASSIGNS


def _unrun_assigns(ops: Sequence[tf.Operation], graph: tf.Graph, run: Set[tf.Operation]) -> List[tf.Operation]:
    """`ops`: every op created since some point, in creation order. The variable assignments among them that
    initialize no variable and that nothing in `run` (or computing anything) depends on: only reads of the
    value back (Keras 2's read after an assign) may."""
    control_outputs: Dict[tf.Operation, List[tf.Operation]] = {}
    for op in ops:  # what depends on them was created after them: among `ops` (all created since the first)
        for c in op.control_inputs:
            control_outputs.setdefault(c, []).append(op)
    variables = (graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                 + graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES))
    initializers = {getattr(v, "initializer", None) for v in variables}

    def unrun(op):
        seen, stack = {op}, [op]
        while stack:
            current = stack.pop()
            if current in run or current.type not in _READ_BACKS:
                return False
            for after in [c for t in current.outputs for c in t.consumers()] + control_outputs.get(current, []):
                if after not in seen:
                    seen.add(after)
                    stack.append(after)
        return True

    return [op for op in ops if op.type in _ASSIGNS and op not in initializers and unrun(op)]


def _collected_ops(graph: tf.Graph, collection: str) -> Set[tf.Operation]:
    items = graph.get_collection(collection)
    return {item if isinstance(item, tf.Operation) else item.op for item in items if hasattr(item, "graph")}


@contextlib.contextmanager
def collect_updates(collection: str = tf.compat.v1.GraphKeys.UPDATE_OPS):
    """Adds the variable assignments created in the block that nothing runs (Keras 3 BatchNormalization's
    moving statistics when called with training=True; Keras 2's too) to `collection`; yields the list of them.

        with dapple_tf.collect_updates():
            h = keras.layers.BatchNormalization()(x, training=True)
    """
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    collected: List[tf.Operation] = []
    yield collected
    for op in _unrun_assigns(graph.get_operations()[first:], graph, _collected_ops(graph, collection)):
        graph.add_to_collection(collection, op)
        collected.append(op)


def warn_unrun_assigns(created: Set[tf.Operation], run: Set[tf.Operation], batch_dependent: Set[tf.Operation]) -> None:
    """Warns about assignments computed from the batch that model_fn created and nothing in `run` (the stages'
    and the update ops) depends on."""
    if not created:
        return
    graph = next(iter(created)).graph
    ordered = sorted(created, key=lambda op: op._id)  # pylint: disable=protected-access
    unrun = [op for op in _unrun_assigns(ordered, graph, run) if op in batch_dependent]
    if not unrun:
        return
    shown = ", ".join(op.name for op in unrun[:4]) + (f" and {len(unrun) - 4} more" if len(unrun) > 4 else "")
    warnings.warn(
        f"model_fn assigns variables from the batch in {len(unrun)} op(s) that nothing runs ({shown}): they are not "
        "in UPDATE_OPS and no op depends on them, so those variables never change (Keras 3 BatchNormalization "
        "assigns its moving_mean/moving_variance this way when called with training=True, and a graph runs only "
        "what is fetched). Add them to UPDATE_OPS, e.g. `with dapple_tf.collect_updates(): h = bn(x, "
        "training=True)`; build_pipeline then runs them once per step",
        MovingStatisticsWarning,
        stacklevel=4,
    )


def warn_per_micro_batch(norms: Sequence[tf.Operation], updates: "UpdateOps", layout, sync: bool) -> None:
    """Warns when batch statistics are not the global batch's: per micro-batch, or per replica's slice
    (`layout`: the build's layout.PipelineLayout)."""
    if not norms and not updates.update_ops:
        return
    stages = {updates.stage_of[op] for op in norms} | {extra.stage for extra in updates.statistics.values()}
    sliced = not sync and any(layout.stages[s].replication > 1 for s in stages)
    if layout.num_micro_batches == 1 and not sliced:
        return
    named = [op.name for op in norms] or [op.name for op in updates.update_ops]
    shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    if sliced:
        where = (f"each micro-batch slice with its own statistics (micro-batches of {layout.micro_batch_size} "
                 "samples, split further across a stage's replicas; batch_norm='sync' joins the replicas' slices)")
    else:
        together = ", all replicas of a stage together (batch_norm='sync')" if sync else ""
        where = f"each micro-batch ({layout.micro_batch_size} samples{together}) with its own statistics"
    warnings.warn(
        f"batch normalization in training mode ({shown}) normalizes {where}, not the global batch's; the moving "
        "averages are updated once per step from the mean of those statistics",
        BatchNormWarning,
        stacklevel=4,
    )


def _depends_on(sources: Sequence[tf.Operation], graph: tf.Graph) -> Set[tf.Operation]:
    """Ops depending on `sources` through data or control edges (an assign behind a read_value)."""
    dependent = set(sources)
    for op in graph.get_operations():  # creation order is a topological order
        if any(t.op in dependent for t in op.inputs) or any(c in dependent for c in op.control_inputs):
            dependent.add(op)
    return dependent


def model_update_ops(graph: tf.Graph, created: Set[tf.Operation]) -> List[tf.Operation]:
    """The operations in UPDATE_OPS that model_fn created (ops or tensors in the collection)."""
    found = []
    for item in graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS):
        op = item if isinstance(item, tf.Operation) else getattr(item, "op", None)
        if op in created and op not in found:
            found.append(op)
    return found


class UpdateOps:
    """The UPDATE_OPS of a template, rebuilt on the clones' averaged statistics; see the module docstring."""

    def __init__(self, update_ops: Sequence[tf.Operation], stage_ops: Sequence[Sequence[tf.Operation]], placeholders):
        batch_dependent = _depends_on(placeholders, placeholders[0].graph)
        self.unchanged = [op for op in update_ops if op not in batch_dependent]  # e.g. a counter: runs as it is
        self.update_ops = [op for op in update_ops if op in batch_dependent]
        stage_of = {op: s for s, ops in enumerate(stage_ops) for op in ops}
        self.stage_of = stage_of
        self.subgraph: Set[tf.Operation] = set()
        self.statistics: Dict[str, outputs_lib.ExtraOutput] = {}  # stage tensor name -> what to average
        self.fixed: Dict[str, tf.Tensor] = {}  # batch-independent inputs, used as they are
        # with batch_norm="sync", per stage: the batch statistics sync_batch_norm.rewrite synchronizes (prepare)
        self.synchronized: List[Dict[str, Optional[Tuple[int, Tuple[int, ...]]]]] = [{} for _ in stage_ops]
        stack = list(self.update_ops)
        while stack:
            op = stack.pop()
            if op in self.subgraph:
                continue
            if op in stage_of:
                raise DappleError(
                    f"update op {op.name} ({op.type}) runs inside stage {stage_of[op]} (the loss depends on it, e.g. "
                    "through tf.control_dependencies); leave UPDATE_OPS to build_pipeline, which runs them once per step"
                )
            self.subgraph.add(op)
            for t in op.inputs:
                if t.op in stage_of:
                    self.statistics[t.name] = outputs_lib.ExtraOutput(t.name, t, outputs_lib.MEAN, stage_of[t.op])
                elif t.op in batch_dependent:
                    if t.op.type == "Placeholder":
                        raise DappleError(f"update op {op.name} reads the model's inputs directly ({t.name})")
                    stack.append(t.op)
                else:
                    self.fixed[t.name] = t
            stack.extend(c for c in op.control_inputs if c not in stage_of and c in batch_dependent)

    def combined_extras(self) -> List[outputs_lib.ExtraOutput]:
        """What `build` combines over the clones, in the order it asks for them."""
        return list(self.statistics.values()) if self.update_ops else []

    def build(self, combined: Callable[[outputs_lib.ExtraOutput], tf.Tensor], device: str) -> List[tf.Operation]:
        """The update ops, imported once, fed by the statistics averaged by `combined` (StageBuilder.combined)."""
        if not self.update_ops:
            return list(self.unchanged)
        averaged = {name: combined(extra) for name, extra in self.statistics.items()}
        ordered = sorted(self.subgraph, key=lambda op: op._id)  # pylint: disable=protected-access
        graph_def = graph_defs_lib.stage_graph_defs(ordered[0].graph, [ordered])[0].graph_def
        input_map = dict(self.fixed)
        input_map.update(averaged)
        with tf.device(device):
            imported = tf.compat.v1.import_graph_def(
                graph_def, input_map=input_map, return_elements=[op.name for op in self.update_ops],
                name="dapple/update_ops",
            )
        return list(self.unchanged) + list(imported)


def _sliced_tensors(graph: tf.Graph, analysis: normalization.SampleAxes, synced: Set[str]) -> Set[str]:
    """Names of the tensors computed from a replica's slice without going through a synchronized statistic."""
    sliced: Set[str] = set()
    for op in graph.get_operations():
        if op not in analysis.batch_dependent:
            continue
        from_slice = op in analysis.inputs or any(t.name in sliced for t in op.inputs)
        for t in op.outputs:
            consistent = op.name in synced and (op.type in normalization.REDUCTIONS or t.value_index in (1, 2))
            if from_slice and not consistent:
                sliced.add(t.name)
    return sliced


def _check_synchronized(updates: UpdateOps, analysis: normalization.SampleAxes, synced: Set[str],
                        replication: Sequence[int]) -> None:
    """With sync batch norm, update ops must read statistics that are the same on every replica."""
    replicated = [extra for extra in updates.statistics.values() if replication[extra.stage] > 1]
    if not replicated:
        return
    sliced = _sliced_tensors(replicated[0].tensor.graph, analysis, synced)
    for extra in replicated:
        if extra.tensor.name in sliced:
            raise DappleError(
                f"batch_norm='sync' synchronizes batch statistics (fused batch norms, and means or sums over the "
                f"batch axis keeping dims, as tf.nn.moments computes them), but an update op reads "
                f"{extra.tensor.name} ({extra.tensor.op.type}) from stage {extra.stage}, which is replicated: it is "
                "computed from the replica's own slice, not from synchronized statistics, so it would stay per "
                "replica's slice; compute it from the batch norm's statistics or use batch_norm='per_slice'"
            )


def _refuse_unproven(analysis: normalization.SampleAxes, stage_ops, replication: Sequence[int]) -> None:
    """With sync batch norm, replicated stages must hold no Mean or Sum keeping dims over axis 0 of a tensor whose
    sample axis the analysis cannot tell (after an op it does not follow, such as a Keras RNN's loop): it may be
    a batch statistic, which would stay per replica's slice (the rule from before the sample-axis analysis)."""
    for s, ops in enumerate(stage_ops):
        unproven = analysis.unproven_reductions(ops) if replication[s] > 1 else []
        if unproven:
            op = unproven[0]
            raise DappleError(
                f"batch_norm='sync' synchronizes batch statistics whose sample axis it can follow from the inputs, but "
                f"stage {s}, which is replicated, computes a {op.type} keeping dims over axis 0 in {op.name} of a "
                f"tensor whose sample axis cannot be told (it comes from {_unfollowed(analysis, op.inputs[0])}, which "
                "the analysis does not follow): if it is a statistic over the batch it would stay per replica's "
                "slice; compute it before that op, with tf.nn.moments on a batch-leading tensor, or use "
                "batch_norm='per_slice'"
            )


def _unfollowed(analysis: normalization.SampleAxes, tensor: tf.Tensor) -> str:
    """The first op (name and type) on the way back from `tensor` whose inputs' sample axes are all known."""
    seen, stack = set(), [tensor]
    while stack:
        t = stack.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        unknown = [i for i in t.op.inputs if analysis.of(i) is None]
        if not unknown:
            return f"{t.op.name} ({t.op.type})"
        stack.extend(reversed(unknown))
    return f"{tensor.op.name} ({tensor.op.type})"


def prepare(template, created: Set[tf.Operation], layout, sync: bool = False) -> UpdateOps:
    """The UpdateOps of the UPDATE_OPS model_fn `created`, their statistics added to the stages' clone outputs
    (template.StageTemplate.extra_outputs); warns about per-micro-batch statistics and about assignments
    nothing runs; with `sync`, records the batch statistics of replicated stages to synchronize
    (`synchronized`: per stage, name -> None for a fused norm or (rank, axes) for a Mean) and refuses
    update ops reading statistics that are not synchronized. `layout`: the build's layout.PipelineLayout."""
    graph = template.stages[0].ops[0].graph
    stage_ops = [st.ops for st in template.stages]
    replication = layout.replication
    placeholders = [graph.get_tensor_by_name(name).op for name in template.inputs]
    update_ops = model_update_ops(graph, created)
    updates = UpdateOps(update_ops, stage_ops, placeholders)
    analysis = normalization.SampleAxes(graph, placeholders)
    norms = analysis.batch_statistics(op for ops in stage_ops for op in ops)
    if sync:
        for op in norms:
            s = updates.stage_of[op]
            if replication[s] <= 1:
                continue
            if op.type == "Sum":
                raise DappleError(
                    f"batch_norm='sync' synchronizes batch statistics (fused batch norms, and means over the batch "
                    f"axis keeping dims, as tf.nn.moments computes them), but stage {s}, which is replicated, sums "
                    f"over the batch in {op.name} (a Sum keeping dims): what the sum is divided by cannot be told "
                    "from the graph, so it would stay per replica's slice; compute the statistic with "
                    "tf.reduce_mean(..., keepdims=True) or tf.nn.moments, or use batch_norm='per_slice'"
                )
            if op.type not in ("Mean", "Sum") and analysis.of(op.inputs[0]) is None:
                raise DappleError(
                    f"batch_norm='sync' synchronizes batch norms whose sample axis it can follow from the inputs, but "
                    f"stage {s}, which is replicated, runs the fused norm {op.name} on a tensor whose sample axis "
                    f"cannot be told (it comes from {_unfollowed(analysis, op.inputs[0])}, which the analysis does not "
                    "follow): it may be a per-sample normalization (Keras 2 computes LayerNormalization with this op) "
                    "that synchronizing would change; use batch_norm='per_slice' for this model"
                )
            updates.synchronized[s][op.name] = _reduction(op)
        _refuse_unproven(analysis, stage_ops, replication)
        _check_synchronized(updates, analysis, {n for names in updates.synchronized for n in names}, replication)
    warn_per_micro_batch(norms, updates, layout, sync)
    run = {op for ops in stage_ops for op in ops} | set(update_ops) | _collected_ops(
        graph, tf.compat.v1.GraphKeys.UPDATE_OPS)
    warn_unrun_assigns(created, run, analysis.batch_dependent)
    for extra in updates.statistics.values():
        wanted = template.stages[extra.stage].extra_outputs
        if extra.tensor not in wanted:
            wanted.append(extra.tensor)
    return updates


def _reduction(op: tf.Operation) -> Optional[Tuple[int, Tuple[int, ...]]]:
    """None for a fused norm; (input rank, reduction axes) for a Mean."""
    if op.type in normalization.TRAINING_NORMS:
        return None
    rank = op.inputs[0].shape.rank
    axes = np.ravel(tf.get_static_value(op.inputs[1]))
    return rank, tuple(sorted({int(a) % rank for a in axes}))
