"""Checkpoints of per-host graphs (PipelineOptions.own_task): one checkpoint of the single-device variable set,
written in parts, merged by task 0, and restored by every task into the variables it holds.

No task's graph holds every variable: each has the model's (the template), but the optimizer's state only for the
variables its own step updates, and some variables exist once per task (global_step, Adam's beta powers: every task
advances its own alike). So at start each task tells the others which variables its session holds (on its own
devices, or unplaced: on its own task) and which of them its step writes (`Holdings`); each variable is then saved
by the one task that writes it, by the first of several that all write it (copies kept alike), or else by the first
that holds it (`owners`). At a checkpoint step every task saves what it owns as a part, tasks 1.. tell task 0 that
theirs is written (host_signals.StepTokens), and task 0 merges the parts into `model.ckpt-<step>`
(MergeV2Checkpoints moves the data files, it does not copy them) and records it as the latest. A restore reads
every variable a task holds by name. model_dir must be shared by the tasks, as for TensorFlow's own multi-worker
checkpoints.
"""

import json
import os
from typing import Dict, List, Sequence, Set, Tuple

import tensorflow as tf

from dapple_tf.cluster import host_signals
from dapple_tf.errors import DappleError
from dapple_tf.rewrite import graph_walk

# ops that write the variable whose handle (or reference) they take: assignments, optimizers' updates, scatters
_WRITES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter", "ResourceStridedSliceAssign",
           "Apply", "SparseApply", "Scatter")
PARTS_DIR = "dapple_parts"


def written_variables(train_op: tf.Operation, variables: Sequence[tf.Variable]) -> Set[str]:
    """The names of `variables` that a run of `train_op` writes (an assignment or update it runs takes the
    variable's handle)."""
    by_handle = {(v.handle if hasattr(v, "handle") else v.op.outputs[0]).op: v.op.name for v in variables}
    written = set()
    for op in graph_walk.ancestors(train_op):
        if not op.type.startswith(_WRITES):
            continue
        written.update(by_handle[t.op] for t in op.inputs if t.op in by_handle)
    return written


def owners(holdings: Dict[int, Dict[str, bool]]) -> Dict[str, int]:
    """Variable name -> the task that saves it, from each task's {name: its step writes it}; see the module
    docstring."""
    holders: Dict[str, List[int]] = {}
    for task in sorted(holdings):
        for name in holdings[task]:
            holders.setdefault(name, []).append(task)
    out = {}
    for name, tasks in holders.items():
        writers = [t for t in tasks if holdings[t][name]]
        out[name] = writers[0] if writers else tasks[0]
    return out


def held_variables(train_op: tf.Operation, is_local) -> Tuple[List[tf.Variable], Set[str]]:
    """(the global variables a task's session holds, the names of those its step writes): those on its devices or
    unplaced, and those of other tasks its step writes (the batch-norm moving averages the loss's task updates
    for stages of other tasks: saved between its own steps, they are saved as written)."""
    variables = train_op.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    written = written_variables(train_op, variables)
    return [v for v in variables if is_local(v.device) or v.op.name in written], written


class HostCheckpoints:
    """One task's side of per-host checkpoints: build it before the graph is finalized, after every task is up."""

    def __init__(self, cluster, tasks: Sequence[int], held: Sequence[tf.Variable], written: Set[str],
                 model_dir: str, keep: int, timeout_s: float):
        self.model_dir, self.keep, self.own, self.lead = model_dir, keep, cluster.task_index, tasks[0]
        mine = {v.op.name: v.op.name in written for v in held}
        texts = host_signals.exchange_texts(cluster, tasks, json.dumps(mine), timeout_s)
        owner = owners({task: json.loads(text) for task, text in texts.items()})
        with tf.control_dependencies(None), tf.name_scope("dapple/checkpoint"):
            owned = {v.op.name: v for v in held if owner[v.op.name] == self.own}
            self._part_saver = tf.compat.v1.train.Saver(owned, max_to_keep=None) if owned else None
            self.restore_saver = tf.compat.v1.train.Saver({v.op.name: v for v in held}, max_to_keep=None)
            self._tokens = host_signals.StepTokens("part_written", self.own, tasks[1:], tasks[:1])
            if self.own == self.lead:
                self._parts = tf.compat.v1.placeholder(tf.string, [None])
                self._destination = tf.compat.v1.placeholder(tf.string, [])
                with tf.device(host_signals.queue_device(self.own)):
                    self._merge = tf.raw_ops.MergeV2Checkpoints(
                        checkpoint_prefixes=self._parts, destination_prefix=self._destination, delete_old_dirs=True)
        self.writers = sorted(set(owner.values()))  # the tasks that write a part (some may own no variable)
        self.last_saved = None

    def latest(self):
        return tf.train.latest_checkpoint(self.model_dir)

    def restore(self, session, path: str) -> None:
        try:
            self.restore_saver.restore(session, path)
        except tf.errors.NotFoundError as e:
            raise DappleError(f"worker task {self.own} cannot restore {path}: {e.message.splitlines()[0]} (was it "
                              "written by the same model and plan?)") from None

    def _part(self, step: int, task: int) -> str:
        return os.path.join(self.model_dir, PARTS_DIR, f"model.ckpt-{step}", f"task-{task}")

    def save(self, session, step: int) -> None:
        """Saves this task's part of step `step`; on task 0, merges every part once all are written."""
        if step == self.last_saved:
            return
        self.last_saved = step
        if self._part_saver:
            tf.io.gfile.makedirs(os.path.dirname(self._part(step, self.own)))
            self._part_saver.save(session, self._part(step, self.own), write_meta_graph=False, write_state=False)
        if self.own != self.lead:
            self._tokens.send(session, step)
            return
        self._tokens.take(session, step, "its part of the checkpoint")
        path = os.path.join(self.model_dir, f"model.ckpt-{step}")
        session.run(self._merge, {self._parts: [self._part(step, t) for t in self.writers], self._destination: path})
        self._record(path)

    def tidy(self) -> None:
        """Removes the parts' directory once it is empty (every part merged); call it when training has ended."""
        parts = os.path.join(self.model_dir, PARTS_DIR)
        if self.own == self.lead and tf.io.gfile.isdir(parts) and not tf.io.gfile.listdir(parts):
            tf.io.gfile.rmtree(parts)

    def _record(self, path: str) -> None:
        """Makes `path` the latest checkpoint, keeping the newest `keep`."""
        state = tf.train.get_checkpoint_state(self.model_dir)
        kept = [p for p in (state.all_model_checkpoint_paths if state else []) if p != path] + [path]
        for old in kept[:-self.keep] if self.keep else []:
            for name in tf.io.gfile.glob(old + ".*"):
                tf.io.gfile.remove(name)
        kept = kept[-self.keep:] if self.keep else kept
        tf.compat.v1.train.update_checkpoint_state(self.model_dir, path, all_model_checkpoint_paths=kept)
