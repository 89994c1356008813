"""A traced step per host: every task traces the same step of its own part (TraceHook's step), and the loss's task
gathers every task's step stats and lists of operations and writes the one timeline of the whole pipeline, as
the one graph's TraceHook does.

Each task's RunMetadata holds its own devices' operations (and the enqueues its step runs on other tasks, left
out: another graph's names); the tasks' operation names are those of the one graph, so the merged stats place
every stage's forward and backward boxes. Transfers between tasks go through queues, not send/receive pairs, and are not drawn. The tasks' clocks are
one on a single machine; across machines they differ by what their clocks differ.
"""

import base64
import json
import types
from typing import Dict, Sequence

import tensorflow as tf

from dapple_tf.cluster import host_signals
from dapple_tf.trace.hook import TraceHook
from dapple_tf.trace import timeline
from planner.formats.schedule import Task


class HostTraceHook(TraceHook):
    """TraceHook in every task; `lead` (the loss's task) writes the merged timeline."""

    def __init__(self, path, handle, at_step, simulated, log, cluster, tasks: Sequence[int], lead: int,
                 timeout_s: float):
        super().__init__(path, handle, at_step, simulated, log)
        self._cluster, self._tasks, self._lead, self._timeout_s = cluster, list(tasks), lead, timeout_s

    def after_run(self, run_context, run_values):
        if self._steps != self.at_step:
            return
        texts = host_signals.gather_texts(self._cluster, self._tasks, _describe(run_values.run_metadata, self.handle),
                                          self._lead, self._timeout_s, name="trace")
        if texts:
            metadata, handle = _merged(texts, self.handle)
            self.write(timeline.measured_timeline(metadata, handle))
        else:
            self.written = f"(worker task {self._lead} writes {self.path})"

    def end(self, session):
        if self._cluster.task_index == self._lead:
            super().end(session)


def _describe(run_metadata, handle) -> str:
    """What the loss's task needs of this task's traced step: its RunMetadata and its tasks' operations."""
    def ops(names):
        return [[device, [task.stage, task.kind, task.micro_batch], replica, list(op_names)]
                for (device, task, replica), op_names in names.items()]

    return json.dumps({"metadata": base64.b64encode(run_metadata.SerializeToString()).decode(),
                       "task_ops": ops(handle.task_op_names), "input_gradient_ops": ops(handle.input_gradient_op_names),
                       "allreduce": list(handle.allreduce_op_names)})


def _on_task(device: str, task: int) -> bool:
    spec = tf.DeviceSpec.from_string(device)
    return (spec.task or 0) == task


def _merged(texts: Dict[int, str], handle):
    """(RunMetadata with every task's step stats and partition graphs, a handle whose lists are every task's)."""
    metadata = tf.compat.v1.RunMetadata()
    task_ops, input_gradient_ops, allreduce = {}, {}, []
    for task in sorted(texts):
        described = json.loads(texts[task])
        part = tf.compat.v1.RunMetadata.FromString(base64.b64decode(described["metadata"]))
        # only its own devices' stats: the partitions its session runs on other tasks (the enqueues into their
        # queues) are another graph's, whose operation names may be the same as other operations of this one's
        metadata.step_stats.dev_stats.extend(d for d in part.step_stats.dev_stats if _on_task(d.device, task))
        metadata.partition_graphs.extend(g for g in part.partition_graphs
                                         if g.node and _on_task(g.node[0].device, task))
        for merged, key in ((task_ops, "task_ops"), (input_gradient_ops, "input_gradient_ops")):
            for device, (stage, kind, micro_batch), replica, names in described[key]:
                merged.setdefault((device, Task(stage, kind, micro_batch), replica), tuple(names))
        allreduce += described["allreduce"]
    return metadata, types.SimpleNamespace(
        schedule=handle.schedule, stages=handle.stages, micro_batch_size=handle.micro_batch_size,
        train_op=handle.train_op, task_op_names=task_ops, input_gradient_op_names=input_gradient_ops,
        allreduce_op_names=tuple(allreduce))
