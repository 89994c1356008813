"""Per-host graphs: which devices this process builds, and tensors that cross to another task's session.

With `PipelineOptions(own_task=...)` every task of a cluster runs the same program and builds only the tasks of
the schedule that run on its own devices (TensorFlow's between-graph replication). A tensor one task makes and
another reads (a stage boundary's activations and their gradients, a gradient piece of the exchange, a replica's
loss) travels through a FIFOQueue with a shared name on the reading task's device: the sending graph enqueues
there, the reading graph dequeues there, and both graphs create the queue with the same name, so the two sessions
meet in the same queue resource of the reading worker (as SyncReplicasOptimizer's workers share token queues;
scripts.bench.hosts.cross_session measured it as fast as the in-graph transfer). Every queue carries one tensor per
step: a name per boundary, micro-batch and replica pair, so the order in which the two sides run their tasks cannot
mix items up. `InGraph` is the one-process case: every device is local and nothing is queued. The builders do not use
these classes: lowering.py's OneGraph and TaskGraph (which the builders get) are made of them.
"""

import functools
from typing import List, Optional

import tensorflow as tf

from dapple_tf.errors import PlanError

# Items a queue can hold: a sender is at most one step ahead of its reader (the reader's previous step took the
# last item before the sender could finish that step), so two never block a correct pipeline.
QUEUE_CAPACITY = 2


@functools.lru_cache(maxsize=None)  # a build asks it of every operation's device, of a few distinct names
def task_of(device: str) -> str:
    """The task part of a device name: "/job:worker/replica:0/task:1" for ".../task:1/device:CPU:0"."""
    spec = tf.DeviceSpec.from_string(device)
    return tf.DeviceSpec(job=spec.job, replica=spec.replica or 0, task=spec.task or 0).to_string()


def checked_task(task: str, plan_devices) -> str:
    """`task` (PipelineOptions.own_task) spelled as task_of spells it; refused unless it names a task of a cluster job
    that runs some of `plan_devices`."""
    if tf.DeviceSpec.from_string(task).job is None:
        raise PlanError(f"own_task must name a task of a cluster job (\"/job:worker/replica:0/task:1\"), got {task!r}")
    tasks = sorted({task_of(d) for d in plan_devices if tf.DeviceSpec.from_string(d).job is not None})
    if task_of(task) not in tasks:
        raise PlanError(f"own_task {task_of(task)} runs none of the plan's devices; the plan's tasks: {tasks}")
    return task_of(task)


class InGraph:
    """The whole cluster's graph in one process: every device is this graph's."""

    per_host = False

    def is_local(self, device: str) -> bool:
        del device
        return True

    def sends(self) -> List[tf.Operation]:
        return []

    def takes(self) -> List[tf.Operation]:
        return []

    def move(self, tensor: Optional[tf.Tensor], source: str, target: str, key: str, dtype: tf.DType,
             shape: tf.TensorShape) -> Optional[tf.Tensor]:
        """`tensor`, made on `source`, where `target` reads it: in one graph the tensor itself."""
        del source, target, key, dtype, shape
        return tensor


class HostPart:
    """The part of the cluster one task builds: its devices, and the queues to and from the other tasks."""

    per_host = True

    def __init__(self, task: str, plan_devices):
        self.task = checked_task(task, plan_devices)
        self._sends: List[tf.Operation] = []
        self._takes: List[tf.Operation] = []

    def is_local(self, device: str) -> bool:
        """True for this task's devices, and for those of no job ("", "/device:CPU:0"), which its session places
        on its own task."""
        return tf.DeviceSpec.from_string(device).job is None or task_of(device) == self.task

    def send(self, key: str, tensor: tf.Tensor, to_device: str) -> tf.Operation:
        """Enqueues `tensor` into queue `key` on another task's device; the op is kept for `sends`."""
        enqueue = send(key, tensor, to_device)
        self._sends.append(enqueue)
        return enqueue

    def receive(self, key: str, dtype: tf.DType, shape: Optional[tf.TensorShape], at_device: str) -> tf.Tensor:
        """Dequeues this step's tensor of queue `key` on this task's device `at_device`, of a known `shape`. Every
        step takes it (`takes`), read by an operation of the step or not: its sender sends in every step."""
        received = receive(key, dtype, shape, at_device)
        self._takes.append(received.op)
        return received

    def move(self, tensor: Optional[tf.Tensor], source: str, target: str, key: str, dtype: tf.DType,
             shape: tf.TensorShape) -> Optional[tf.Tensor]:
        """`tensor`, made on `source`, where `target` reads it: the tensor itself between this task's devices; sent
        through queue `key` when only `source` is this task's (None); received (of `dtype` and `shape`) when only
        `target` is; None when neither is."""
        if self.is_local(source) and self.is_local(target):
            return tensor
        if self.is_local(source):
            self.send(key, tensor, target)
            return None
        if self.is_local(target):
            return self.receive(key, dtype, shape, target)
        return None

    def sends(self) -> List[tf.Operation]:
        """Every enqueue this graph makes: a step must run them all (no later task of this graph waits for some)."""
        return list(self._sends)

    def takes(self) -> List[tf.Operation]:
        """Every receive: a step must run them all, though none of its operations may read some (what is combined
        once per step for a fetch or a summary, the gradient of a boundary tensor that leads to no variable, a
        script's gradient transform leaving a variable out): their senders send in every step, and a queue left
        unread blocks its sender two steps later."""
        return list(self._takes)



def send(key: str, tensor: tf.Tensor, to_device: str) -> tf.Operation:
    """The enqueue of `tensor` into queue `key` on `to_device` (HostPart.send, which also keeps it for the step)."""
    with tf.control_dependencies(None):
        queue = _queue(key, tensor.dtype, to_device)
    with tf.device(to_device):
        return queue.enqueue([tensor], name="send")


def receive(key: str, dtype: tf.DType, shape: Optional[tf.TensorShape], at_device: str) -> tf.Tensor:
    """The dequeue of queue `key` on `at_device`, of a known `shape` (HostPart.receive, which also keeps it)."""
    with tf.control_dependencies(None):
        queue = _queue(key, dtype, at_device)
    with tf.device(at_device):
        received = queue.dequeue(name="receive")
        if shape is not None and shape.rank is not None:
            # as an op, so that grappler knows the shape too: it optimizes (fuses, folds) by shapes, and a
            # dequeue's are unknown to it, which changed the last bits of some results against one graph
            received = tf.ensure_shape(received, shape)
    return received


def _queue(key: str, dtype: tf.DType, device: str) -> tf.queue.FIFOQueue:
    with tf.device(device), tf.name_scope("dapple/host_queue"):
        return tf.queue.FIFOQueue(QUEUE_CAPACITY, [dtype.base_dtype], shared_name=key, name="queue")
