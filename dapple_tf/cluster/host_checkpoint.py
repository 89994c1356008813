"""Checkpoints of per-host graphs (PipelineOptions.own_task): one checkpoint of the single-device variable set,
written in parts, merged by task 0, and restored by every task into the variables it holds.

No task's graph holds every variable: each has the model's (the template), but the optimizer's state only for the
variables its own step updates, and some variables exist once per task (global_step, Adam's beta powers: every task
advances its own alike). So at start each task tells the others which variables its session holds (on its own
devices, or unplaced: on its own task), which of them its step writes, and their dtypes and shapes (`Holdings`,
`described`); each variable is then saved by the one task that writes it, by the first of several that all write
it (copies kept alike), or else by the first that holds it (`owners`). At a checkpoint step every task saves what it owns as a part, tasks 1.. tell task 0 that
theirs is written (host_signals.StepTokens), and task 0 merges the parts into `model.ckpt-<step>`
(MergeV2Checkpoints moves the data files, it does not copy them) and records it as the latest. A restore reads
every variable a task holds by name. model_dir must be shared by the tasks, as for TensorFlow's own multi-worker
checkpoints.

With each checkpoint task 0 also writes `model.ckpt-<step>.meta`, and `graph.pbtxt` once, as one graph's Saver and
CheckpointSaverHook do. Their graph is the checkpoint's (`checkpoint_graph`): every variable of the checkpoint,
named, shaped and typed as the tasks described them at start, and a Saver over all of them, so
`tf.compat.v1.train.import_meta_graph(path + ".meta")` gives a Saver that restores the checkpoint, anywhere (it
names no devices). Why not a fuller graph: no task's graph holds every variable, so none can export a Saver over
them; tracing model_fn once more, in a graph of its own, would ask of the user's code what per-host training does
not ask today (Keras layers or an optimizer made outside model_fn belong to the graph they were first used in,
`pipelined` keeps the spec of model_fn's last call, a model_fn may read tensors made outside it), and a trace that
fails would need this graph as a fallback. Describing the variables costs a dtype and a shape each in the exchange
the tasks make at start. TensorBoard's graph tab reads the summaries' events, not graph.pbtxt: there the loss's task's
own graph, which its summary writer records when made (FileWriterCache), shows what that task runs.
"""

import json
import os
from typing import Dict, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from dapple_tf.cluster import host_signals
from dapple_tf.cluster.servers import ClusterError
from dapple_tf.errors import DappleError
from dapple_tf.rewrite.graphs import graph_walk

# ops that write the variable whose handle (or reference) they take: assignments, optimizers' updates, scatters
_WRITES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter", "ResourceStridedSliceAssign",
           "Apply", "SparseApply", "Scatter")
PARTS_DIR = "dapple_parts"
GRAPH_FILE = "graph.pbtxt"  # the checkpoint graph as text, the name TensorFlow's CheckpointSaverHook gives it


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


def described(held: Sequence[tf.Variable], written: Set[str]) -> Dict[str, dict]:
    """What a task tells the others of each variable it holds (its `Holdings`): whether its step writes it (who
    saves it: `owners`), and its dtype, shape, trainability and whether it is the global step (the checkpoint
    graph's variable: `checkpoint_graph`)."""
    graph = held[0].graph if held else tf.compat.v1.get_default_graph()
    steps = {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_STEP)}
    return {v.op.name: {"writes": v.op.name in written, "dtype": v.dtype.base_dtype.name,
                        "shape": v.shape.as_list() if v.shape.rank is not None else None,
                        "trainable": bool(v.trainable), "global_step": v.op.name in steps} for v in held}


def checkpoint_variables(holdings: Dict[int, Dict[str, dict]]) -> Dict[str, dict]:
    """Every variable of the checkpoint (each saved by one task, `owners`) by name, as the first task holding it
    describes it (`described`). Raises ClusterError naming a variable that two tasks hold with another dtype or
    shape."""
    out: Dict[str, dict] = {}
    first: Dict[str, int] = {}
    for task in sorted(holdings):
        for name, description in holdings[task].items():
            kind = {key: description[key] for key in ("dtype", "shape")}
            if name not in out:
                out[name], first[name] = description, task
            elif kind != {key: out[name][key] for key in ("dtype", "shape")}:
                raise ClusterError(f"worker tasks {first[name]} and {task} hold variable {name} as "
                                   f"{out[name]['dtype']} {out[name]['shape']} and {kind['dtype']} {kind['shape']}: "
                                   "is every task running the same model and plan?")
    return out


def checkpoint_graph(variables: Dict[str, dict]) -> tf.compat.v1.MetaGraphDef:
    """The meta graph of a graph of the checkpoint's `variables` (`checkpoint_variables`): each variable under its
    checkpoint name (in name order, so that a variable's scope comes before its slots' and neither renames the
    other) with zeros for an initial value, in the trainable and global-step collections as on one device, and a
    Saver over all of them, whose saver_def the meta graph holds; no devices. See the module docstring for why
    this graph."""
    with tf.Graph().as_default() as graph:
        made = {name: _variable(name, variables[name]) for name in sorted(variables)}
        saver = tf.compat.v1.train.Saver(made, max_to_keep=None)
        return tf.compat.v1.train.export_meta_graph(graph=graph, saver_def=saver.as_saver_def())


def _variable(name: str, description: dict) -> tf.Variable:
    """A variable `described` by `description`: the shape given (a dimension or rank unknown stays so), zeros."""
    shape = tf.TensorShape(description["shape"])
    known = [d or 0 for d in description["shape"]] if description["shape"] is not None else []
    dtype = tf.as_dtype(description["dtype"])
    variable = tf.Variable(lambda: tf.zeros(known, dtype), name=name, shape=shape, dtype=dtype,
                           trainable=description["trainable"])
    if description["global_step"]:
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.GLOBAL_STEP, variable)
    return variable


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
        texts = host_signals.exchange_texts(cluster, tasks, json.dumps(described(held, written)), timeout_s)
        holdings = {task: json.loads(text) for task, text in texts.items()}
        owner = owners({task: {name: d["writes"] for name, d in mine.items()} for task, mine in holdings.items()})
        self.variables = checkpoint_variables(holdings)  # the checkpoint's, described
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
        self.meta_graph: Optional[tf.compat.v1.MetaGraphDef] = None  # task 0's: written with each checkpoint
        if self.own == self.lead:
            self.meta_graph = checkpoint_graph(self.variables)
            tf.io.write_graph(self.meta_graph.graph_def, model_dir, GRAPH_FILE)

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
        """Saves this task's part of step `step`; on task 0, merges every part once all are written and writes the
        checkpoint's meta graph beside it (as TensorFlow's Saver does: how tf.io.write_graph writes it)."""
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
        tf.io.write_graph(self.meta_graph, self.model_dir, os.path.basename(path) + ".meta", as_text=False)
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
