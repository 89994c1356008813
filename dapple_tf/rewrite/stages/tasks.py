"""Tasks in the graph: the operations of one forward or backward pass of one micro-batch on one
replica, and the control edges that make each device run its tasks in the schedule's order.

An operation belongs to the task during whose construction it was created (`TaskOps.capture`).
`chain` gives each task's entry operations (those with no data input from their own task) a
control input on the previous task's completion marker, a NoOp that waits for all its operations.
`input_gradients_first` orders the inside of a backward task: the gradients the previous stage
waits for before the weight gradients, which nobody waits for until the AllReduce and apply step
(zero-bubble pipelines' B/W split, inside one task): on a device that runs one op at a time, the
previous stage starts its backward after this task's B part instead of after all of it.
`split_weight_task` makes that W part a task of its own, for schedules that place W elsewhere (zero
bubble): the operations the input gradients need stay in the B task, every other operation of the
backward (weight gradients, their accumulation) moves to the W task, so no operation runs twice.
"""

import contextlib
import dataclasses
from typing import AbstractSet, Dict, List, Sequence, Tuple

import tensorflow as tf

from dapple_tf.rewrite.graphs import v1_control_flow
from dapple_tf.rewrite.graphs.graph_walk import ancestors_within
from planner.formats.schedule import FORWARD, WEIGHT, Task

TaskKey = Tuple[Task, int]  # (task, replica)


@dataclasses.dataclass
class TaskOps:
    """The operations each (task, replica) created, keyed by (task, replica)."""

    graph: tf.Graph
    ops: Dict[TaskKey, List[tf.Operation]] = dataclasses.field(default_factory=dict)
    # backward tasks split by input_gradients_first: the operations their input gradients need (B; the rest is W)
    input_gradient_ops: Dict[TaskKey, List[tf.Operation]] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def capture(self, task: Task, replica: int):
        first = len(self.graph.get_operations())
        yield
        self.ops.setdefault((task, replica), []).extend(self.graph.get_operations()[first:])

    def release_forward_inputs(self) -> None:
        """Takes out of backward tasks the operations that feed a forward task.

        Gradients of functional control flow (tf.while_loop) add inputs to the forward op (e.g.
        empty accumulators): created while the backward task was built, they must not wait for
        it, or the forward and backward tasks would wait for each other.
        """
        forward = {op for (task, _), ops in self.ops.items() if task.kind == FORWARD for op in ops}
        for key, ops in self.ops.items():
            if key[0].kind == FORWARD:
                continue
            feeding = [op for op in ops if any(c in forward for t in op.outputs for c in t.consumers())]
            released = ancestors_within(feeding, set(ops), control=False)
            if released:
                self.ops[key] = [op for op in ops if op not in released]

    def input_gradients_first(self, key: TaskKey, input_grads: Sequence[tf.Tensor],
                              weight_grads: Sequence[tf.Tensor], device: str) -> None:
        """Makes the weight-gradient operations of task `key` (those only weight gradients need) wait
        for its input gradients, and records the operations the input gradients need (`input_gradient_ops`)."""
        ops = self.ops.get(key, [])
        own = set(ops)
        needed_by_inputs = ancestors_within([g.op for g in input_grads], own)
        weight_only = ancestors_within([g.op for g in weight_grads], own) - needed_by_inputs
        if not needed_by_inputs or not weight_only:
            return
        self.input_gradient_ops[key] = [op for op in ops if op in needed_by_inputs]
        with tf.device(device), tf.control_dependencies(None):
            inputs_done = tf.group(*[g.op for g in input_grads], name=f"input_grads_{key[0]}_stage{key[0].stage}")
        ops.append(inputs_done)
        for op in weight_only:
            # ops inside a TF1 while loop's frame cannot wait for an op outside it; the loop's Enter ops wait instead
            if not any(t.op in weight_only for t in op.inputs) and v1_control_flow.may_wait_outside(op):
                op._add_control_inputs([inputs_done])  # pylint: disable=protected-access

    def split_weight_task(self, key: TaskKey, input_grads: Sequence[tf.Tensor]) -> None:
        """Moves the operations of backward task `key` that its input gradients do not need into its W task
        (all of them when it sends no input gradient: the first stage)."""
        ops = self.ops.get(key, [])
        needed = ancestors_within([g.op for g in input_grads], set(ops)) if input_grads else set()
        task, replica = key
        self.ops[key] = [op for op in ops if op in needed]
        self.ops[(Task(task.stage, WEIGHT, task.micro_batch), replica)] = [op for op in ops if op not in needed]
        if self.ops[key]:
            self.input_gradient_ops[key] = list(self.ops[key])

    def names(self, ops_of: Dict[TaskKey, List[tf.Operation]] = None) -> Dict[TaskKey, Tuple[str, ...]]:
        """Names of each task's operations (or of `ops_of`'s)."""
        return {key: tuple(op.name for op in ops) for key, ops in (self.ops if ops_of is None else ops_of).items()}


def _entry_ops(ops: Sequence[tf.Operation]) -> List[tf.Operation]:
    """The ops of a task with no data input from the task, in the step's own frame (an op inside a TF1 loop
    cannot wait for one outside it; the loop's Enter ops can)."""
    own = set(ops)
    return [op for op in ops if not any(t.op in own for t in op.inputs) and v1_control_flow.may_wait_outside(op)]


def chain(task_ops: TaskOps, device_tasks: Sequence[Task], replica: int, device: str,
          elsewhere: AbstractSet[tf.Operation] = frozenset()) -> None:
    """Adds control edges so that `device` runs `device_tasks` (of `replica`: its stage's, or where stages share
    devices its group's) one after another. Operations `elsewhere` (a per-host graph's queues and enqueues on other
    tasks' devices) are left out: an enqueue runs once its tensor is made, as an in-graph transfer does, and the
    next task does not wait for it (which would cost a round trip to the other task per task)."""
    previous_done = None
    for task in device_tasks:
        ops = [op for op in task_ops.ops.get((task, replica), []) if op not in elsewhere]
        if not ops:
            continue
        if previous_done is not None:
            for op in _entry_ops(ops):
                op._add_control_inputs([previous_done])  # pylint: disable=protected-access
        with tf.device(device), tf.control_dependencies(None):
            previous_done = tf.group(*[op for op in ops if v1_control_flow.frame_of(op) is None],
                                     name=f"done_{task.kind}{task.micro_batch}_stage{task.stage}_r{replica}")
