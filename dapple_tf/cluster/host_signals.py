"""Small messages between the sessions of per-host graphs (PipelineOptions.own_task): what each task tells the
others outside the training step.

- `exchange_texts`: every task gives every other one text, once, in a graph of its own (before the training graph
  is finalized: what the texts say can still shape it); `gather_texts`: every task gives one task its text;
  `broadcast_text`: one task gives every other its text (task 0's plan, when dapple_train plans per host).
- `StepTokens`: some tasks tell others that they finished something for a step (wrote their part of a
  checkpoint; finished the step, before a held-out evaluation reads every task's variables).
- `EveryStepsHook`, `SecondsAsStepsHook`: an action every so many global steps, the same steps on every task.
- `FinishBarrier`: no task leaves before every task has finished its last step: a task's server ends with its
  process, and the others may still need it until then.

Each is a FIFOQueue with a shared name on the receiving task's first CPU, as host_part.py's boundary queues are.
"""

import json
import time
from typing import Dict, Sequence

import tensorflow as tf

from dapple_tf.cluster.servers import ClusterError, TFCluster, session_config


def queue_device(task: int) -> str:
    return f"/job:worker/replica:0/task:{task}/device:CPU:0"


def _queue(name: str, at_task: int, dtype, capacity: int, sender=None) -> tf.queue.FIFOQueue:
    """Queue `name` on task `at_task` (one per sender too, when given)."""
    key = f"dapple/{name}/{at_task}" + ("" if sender is None else f"/from/{sender}")
    with tf.device(queue_device(at_task)), tf.name_scope("dapple/host_signals"):
        return tf.queue.FIFOQueue(capacity, [dtype], shapes=[[]], shared_name=key, name=name)


def exchange_texts(cluster: TFCluster, tasks: Sequence[int], text: str, timeout_s: float,
                   name: str = "exchange") -> Dict[int, str]:
    """Sends `text` to every other task of `tasks` and returns every task's text (this one's included), by task;
    `name`: one per purpose (queues of that name carry these texts only). Raises ClusterError naming the tasks
    that sent nothing within `timeout_s`."""
    others = [t for t in tasks if t != cluster.task_index]
    return _texts(cluster, tasks, text, timeout_s, name, send_to=others, receive_from=others)


def gather_texts(cluster: TFCluster, tasks: Sequence[int], text: str, to_task: int, timeout_s: float,
                 name: str) -> Dict[int, str]:
    """Every task of `tasks` sends `text` to `to_task`, which returns every task's text by task (the others get
    {}); as exchange_texts otherwise."""
    if cluster.task_index != to_task:
        _texts(cluster, tasks, text, timeout_s, name, send_to=[to_task], receive_from=[])
        return {}
    return _texts(cluster, tasks, text, timeout_s, name, send_to=[],
                  receive_from=[t for t in tasks if t != to_task])


def broadcast_text(cluster: TFCluster, tasks: Sequence[int], text: str, from_task: int, timeout_s: float,
                   name: str) -> str:
    """Task `from_task` gives every other task of `tasks` its `text` (what the others pass is ignored); every task
    returns that text. As exchange_texts otherwise."""
    if cluster.task_index == from_task:
        _texts(cluster, tasks, text, timeout_s, name, send_to=[t for t in tasks if t != from_task], receive_from=[])
        return text
    return _texts(cluster, tasks, "", timeout_s, name, send_to=[], receive_from=[from_task])[from_task]


def _texts(cluster: TFCluster, tasks: Sequence[int], text: str, timeout_s: float, name: str,
           send_to: Sequence[int], receive_from: Sequence[int]) -> Dict[int, str]:
    own = cluster.task_index
    texts = {own: text}
    if not send_to and not receive_from:
        return texts
    config = session_config(timeout_s)
    # only the tasks this one sends to: a session waits for every task its filters name, one gone included
    config.device_filters.extend(f"/job:worker/replica:0/task:{t}" for t in sorted({own, *send_to}))
    with tf.Graph().as_default():
        sends = [_queue(name, t, tf.string, len(tasks)).enqueue(json.dumps([own, text])) for t in send_to]
        received = _queue(name, own, tf.string, len(tasks)).dequeue()
        with tf.compat.v1.Session(f"grpc://{cluster.workers[own]}", config=config) as sess:
            sess.run(sends)
            try:
                for _ in receive_from:
                    sender, sent = json.loads(sess.run(received).decode())
                    texts[sender] = sent
            except tf.errors.DeadlineExceededError:
                missing = [cluster.describe_task(t) for t in receive_from if t not in texts]
                raise ClusterError(f"after {timeout_s:g} s, {', '.join(missing)} sent nothing: is every task of "
                                   "the cluster running this program?") from None
    return texts


class StepTokens:
    """Each of `senders` tells each of `receivers` that it is done with something for a step (`send`); a receiver
    takes one from each sender (`take`). Checkpoint parts: tasks 1.. to task 0; held-out evaluation: every task to
    the evaluating one, then it to every other."""

    def __init__(self, name: str, own: int, senders: Sequence[int], receivers: Sequence[int]):
        self.name, self.own = name, own
        self._step = tf.compat.v1.placeholder(tf.int64, [], name=f"dapple/host_signals/{name}_step")
        self._send = [_queue(name, t, tf.int64, 4, sender=own).enqueue(self._step)
                      for t in receivers if own in senders and t != own]
        self._take = {t: _queue(name, own, tf.int64, 4, sender=t).dequeue()
                      for t in senders if own in receivers and t != own}

    def send(self, session, step: int) -> None:
        if self._send:
            session.run(self._send, {self._step: step})

    def take(self, session, step: int, what: str, timeout_s: float = None) -> None:
        """Waits for every sender's token (within `timeout_s`, else the session's timeout); raises ClusterError
        naming a task that sent another step or none."""
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_s * 1000)) if timeout_s else None
        for task, token in self._take.items():
            try:
                got = int(session.run(token, options=options))
            except tf.errors.DeadlineExceededError:
                raise ClusterError(f"worker task {task} did not finish {what} of step {step} in time") from None
            if got != step:
                raise ClusterError(f"worker task {task} finished {what} of step {got}, task {self.own} of "
                                   f"step {step}: the tasks are not training the same steps")


class FinishBarrier:
    """Every task enqueues its index on every other task, then takes one from each of them."""

    def __init__(self, own: int, tasks: Sequence[int]):
        self.own, self.others = own, [t for t in tasks if t != own]
        with tf.control_dependencies(None):
            own_queue = _queue("finished", own, tf.int32, len(tasks))
            self._sends = [_queue("finished", t, tf.int32, len(tasks)).enqueue(own) for t in self.others]
            self._take = own_queue.dequeue()

    def wait(self, session, timeout_s: float) -> None:
        """Raises ClusterError naming the tasks that did not finish within `timeout_s`."""
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_s * 1000))
        session.run(self._sends, options=options)
        finished = set()
        try:
            for _ in self.others:
                finished.add(int(session.run(self._take, options=options)))
        except tf.errors.DeadlineExceededError:
            missing = [f"worker task {t}" for t in self.others if t not in finished]
            raise ClusterError(f"{', '.join(missing)} did not finish training within {timeout_s:g} s of worker "
                               f"task {self.own}") from None


class EveryStepsHook(tf.compat.v1.train.SessionRunHook):
    """Calls `action(session, step)` every `every_steps` global steps, the same steps on every task. The steps are
    counted from the global step read once at start: a value fetched beside a step may be read before or after its
    increment."""

    def __init__(self, global_step, every_steps: int, action):
        self._global_step, self._every, self._action = global_step, every_steps, action
        self._step = 0

    def after_create_session(self, session, coord):
        del coord
        self._step = int(session.run(self._global_step))

    def after_run(self, run_context, run_values):
        self._step += 1
        if self._every and self._step % self._every == 0:
            self._action(run_context.session, self._step)


class SecondsAsStepsHook(EveryStepsHook):
    """Calls `action(session, step)` about every `seconds`, as a number of global steps that is the same on every
    task: after `measured` steps of this run (its first left out), the first task of `tasks` turns `seconds` into
    steps by their mean time and tells the others (`exchange_texts`)."""

    def __init__(self, global_step, seconds: float, action, cluster: TFCluster, tasks: Sequence[int],
                 timeout_s: float, measured: int = 10):
        super().__init__(global_step, 0, action)
        self._seconds, self._cluster, self._tasks = seconds, cluster, list(tasks)
        self._timeout_s, self._measured = timeout_s, measured
        self._ran, self._started = 0, 0.0
        self.every_steps = None  # decided after `measured` steps

    def after_run(self, run_context, run_values):
        self._ran += 1
        if self._ran == 1:
            self._started = time.perf_counter()
        elif self._ran == 1 + self._measured:
            per_step = (time.perf_counter() - self._started) / self._measured
            mine = str(max(1, round(self._seconds / per_step)))
            texts = exchange_texts(self._cluster, self._tasks, mine, self._timeout_s, name="checkpoint_steps")
            self.every_steps = self._every = int(texts[self._tasks[0]])
        super().after_run(run_context, run_values)
