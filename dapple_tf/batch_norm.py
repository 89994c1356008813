"""Batch normalization in the pipelined graph: the model's UPDATE_OPS run once per step, and a warning.

In the template, an update op (a moving-average assign, or anything else in the UPDATE_OPS collection)
reads statistics computed by a stage (a batch mean, a batch variance) through ops of its own (the
decay arithmetic) and assigns a variable. In the pipelined graph every clone of that stage computes
the statistics of its own slice; `UpdateOps` adds those statistics to the clones' outputs, averages
them over micro-batches and replicas (weighted by each slice's share of the global batch: the mean of
the micro-batch statistics), and imports the update's own ops once, fed by the averages. The moving
averages are then those of a single-device model that saw each step's micro-batch statistics
averaged. Normalization itself uses each slice's statistics (micro-batch semantics): build_pipeline
warns (BatchNormWarning) naming the batch-norm ops. With batch_norm="sync" a replicated stage's fused
batch norms use the statistics of the whole micro-batch (sync_batch_norm.py), and so do the statistics
the update ops read: the warning is then about micro-batches only (none when there is one).
"""

import warnings
from typing import Callable, Dict, List, Sequence, Set

import numpy as np
import tensorflow as tf

from dapple_tf import graph_defs as graph_defs_lib, outputs as outputs_lib
from dapple_tf.errors import DappleError
from dapple_tf.sync_batch_norm import is_training_norm

PER_SLICE, SYNC = "per_slice", "sync"
MODES = (PER_SLICE, SYNC)


class BatchNormWarning(UserWarning):
    """Batch statistics are computed per micro-batch slice, not over the global batch."""


def warn_per_micro_batch(norms: Sequence[tf.Operation], updates: "UpdateOps", replication: Sequence[int],
                          micro_batch_size: int, num_micro_batches: int, sync: bool) -> None:
    """Warns when batch statistics are not the global batch's: per micro-batch, or per replica's slice."""
    if not norms and not updates.update_ops:
        return
    stages = {updates.stage_of[op] for op in norms} | {extra.stage for extra in updates.statistics.values()}
    sliced = not sync and any(replication[s] > 1 for s in stages)
    if num_micro_batches == 1 and not sliced:
        return
    named = [op.name for op in norms] or [op.name for op in updates.update_ops]
    shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    if sliced:
        where = (f"each micro-batch slice with its own statistics (micro-batches of {micro_batch_size} samples, split "
                 "further across a stage's replicas; batch_norm='sync' joins the replicas' slices)")
    else:
        together = ", all replicas of a stage together (batch_norm='sync')" if sync else ""
        where = f"each micro-batch ({micro_batch_size} samples{together}) with its own statistics"
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


def reduces_over_batch(op: tf.Operation) -> bool:
    """A Mean or Sum keeping dimensions over constant axes that include the batch axis: tf.nn.moments' (and so
    non-fused batch norms') statistics."""
    if op.type not in ("Mean", "Sum") or not op.get_attr("keep_dims"):
        return False
    axes, rank = tf.get_static_value(op.inputs[1]), op.inputs[0].shape.rank
    return axes is not None and bool(rank) and 0 in {int(a) % rank for a in np.ravel(axes)}


def _check_synchronized(updates: UpdateOps, stage_ops, replication: Sequence[int]) -> None:
    """With sync batch norm, replicated stages must hold no batch statistics that it does not synchronize."""
    fix = ("make it fused (tf.compat.v1.nn.fused_batch_norm, slim.batch_norm(fused=True), keras BatchNormalization on "
           "4-D inputs) or use batch_norm='per_slice'")
    for s, ops in enumerate(stage_ops):
        batch_reductions = [op.name for op in ops if replication[s] > 1 and reduces_over_batch(op)]
        if batch_reductions:
            raise DappleError(
                f"batch_norm='sync' synchronizes fused batch norms (FusedBatchNorm*) only, but stage {s}, which is "
                f"replicated, computes statistics over the batch in {batch_reductions[0]} (tf.nn.moments, a "
                f"non-fused batch norm): they would stay per replica's slice; {fix}"
            )
    for extra in updates.statistics.values():
        op = extra.tensor.op
        if replication[extra.stage] > 1 and not (is_training_norm(op) and extra.tensor.value_index in (1, 2)):
            raise DappleError(
                f"batch_norm='sync' synchronizes fused batch norms (FusedBatchNorm*) only, but an update op reads "
                f"{extra.tensor.name} ({op.type}) from stage {extra.stage}, which is replicated: a statistic it does "
                f"not synchronize stays per replica's slice; {fix}"
            )


def prepare(template, created: Set[tf.Operation], micro_batch_size: int, num_micro_batches: int = 1,
            sync: bool = False) -> UpdateOps:
    """The UpdateOps of the UPDATE_OPS model_fn `created`, their statistics added to the stages' clone outputs
    (template.StageTemplate.extra_outputs); warns about per-micro-batch statistics; with `sync`, refuses
    statistics that sync batch norm does not synchronize."""
    graph = template.stages[0].ops[0].graph
    stage_ops = [st.ops for st in template.stages]
    replication = [st.stage.replication for st in template.stages]
    placeholders = [graph.get_tensor_by_name(name).op for name in template.inputs]
    updates = UpdateOps(model_update_ops(graph, created), stage_ops, placeholders)
    if sync:
        _check_synchronized(updates, stage_ops, replication)
    norms = [op for ops in stage_ops for op in ops if is_training_norm(op)]
    warn_per_micro_batch(norms, updates, replication, micro_batch_size, num_micro_batches, sync)
    for extra in updates.statistics.values():
        wanted = template.stages[extra.stage].extra_outputs
        if extra.tensor not in wanted:
            wanted.append(extra.tensor)
    return updates
