"""The Trainer on per-host graphs: when TF_CONFIG makes this process a worker task, every task of the cluster runs
the same training program, starts its own server and builds only its own part of the pipeline
(PipelineOptions.own_task). What that changes in the Trainer's loop is here:

- the session is on this task's own server, and starts by restoring this task's variables from the latest
  checkpoint (or initializing them), then waits for the other tasks' variables it copies (host_session.start);
- checkpoints are written in parts and merged by task 0 (host_checkpoint.py), at every `save_checkpoints_steps`
  global steps (the same steps on every task; `save_checkpoints_secs` is turned into such a number of steps from
  the first steps' time) and at the end, task 0 writing each one's `.meta`, and `graph.pbtxt` once
  (host_checkpoint.checkpoint_graph);
- the task that sums the loss logs progress and writes the summaries; the others are quiet;
- held-out evaluation: every `eval_every` steps the tasks wait for each other, then the loss's task evaluates;
- a traced step: every task traces it, the loss's task writes the merged timeline (host_trace.py);
- at the end no task leaves before every task has finished (host_signals.FinishBarrier): a task's server ends with
  its process. A task that is lost before then ends every other within the failure timeout, naming it (the
  Trainer's watchdog, which runs in every task).
"""

import dataclasses
from typing import List, Optional

import tensorflow as tf

from dapple_tf.cluster import host_checkpoint, host_inputs, host_session, host_signals
from dapple_tf.cluster.servers import ClusterError, TFCluster
from dapple_tf.errors import PerHostError
from dapple_tf.frontends import host_trace
from dapple_tf.rewrite.hosts.host_part import task_of


def is_per_host(cluster: Optional[TFCluster]) -> bool:
    """A worker task trains per host; the chief (today's in-graph client) builds the whole cluster's graph."""
    return cluster is not None and cluster.task_type == "worker"


def check_supported(options, horovod) -> None:
    """Refuses what per-host training does not do yet, by name."""
    refused = []
    if horovod is not None:
        refused.append("Horovod")
    if refused:
        raise PerHostError(f"training per host (TF_CONFIG names this process a worker task) does not support "
                          f"{'; '.join(refused)} yet: run dapple_train as the chief (one graph for the cluster)")


class HostTraining:
    """One task's side of the Trainer's per-host loop; see the module docstring."""

    def __init__(self, cluster: TFCluster, model_dir: Optional[str], options):
        self.cluster, self.model_dir, self.options = cluster, model_dir, options
        self.own_task = f"/job:worker/replica:0/task:{cluster.task_index}"
        self.checkpoints: Optional[host_checkpoint.HostCheckpoints] = None
        self.handle = None

    @property
    def master(self) -> str:
        return f"grpc://{self.cluster.workers[self.cluster.task_index]}"

    def check_plan(self, plan_devices) -> None:
        """Every worker task of TF_CONFIG must run a part of the plan, and the plan no task TF_CONFIG lacks."""
        planned = sorted({tf.DeviceSpec.from_string(d).task or 0 for d in plan_devices})
        if planned != list(range(len(self.cluster.workers))):
            raise ClusterError(f"TF_CONFIG names {len(self.cluster.workers)} worker tasks, the plan runs on tasks "
                               f"{planned}: training per host needs one task for each of the plan's tasks (plan for "
                               "this cluster, or launch as many tasks as the plan has)")

    def pipeline_options(self, options, stage_devices=(), evaluates: bool = False):
        """`options` for this task's part of a plan whose stages run on `stage_devices` (a list per stage);
        `evaluates`: the loss's task (its last stage's first device's) calls model_fn again on held-out data, on
        every task's variables, so its graph keeps them all (PipelineOptions.whole_template)."""
        whole = options.whole_template or (evaluates and task_of(stage_devices[-1][0]) == task_of(self.own_task))
        return dataclasses.replace(options, own_task=self.own_task, whole_template=whole)

    def prepare(self, handle, inputs) -> None:
        """After build_pipeline, before the graph is finalized: waits for the other tasks, agrees with them which
        task saves which variable, and builds the end's barrier; `inputs`: the batch every task must read alike
        (host_inputs.py)."""
        self.handle = handle
        # every task of the plan, not only those this task exchanges tensors with (handle.tasks): all of them agree
        # on the checkpoint's owners, compare their inputs and wait for each other at the end
        tasks = self._tasks = sorted({tf.DeviceSpec.from_string(d).task for stage in handle.stages
                                      for d in stage.devices})
        host_session.wait_for_peers(self.cluster, handle.tasks[1:], self.options.worker_wait_s)
        if self.model_dir:
            held, written = host_checkpoint.held_variables(handle.train_op,
                                                           lambda d: not _job(d) or task_of(d) == self.own_task)
            self.checkpoints = host_checkpoint.HostCheckpoints(
                self.cluster, tasks, held, written, self.model_dir, self.options.keep_checkpoints,
                self.options.worker_wait_s)
        with tf.control_dependencies(None):
            self._same_inputs = host_inputs.SameInputsHook(self.cluster, tasks, inputs, self.options.worker_wait_s)
            self._barrier = host_signals.FinishBarrier(self.cluster.task_index, tasks)
            self._loss_task = tf.DeviceSpec.from_string(handle.stages[-1].devices[0]).task
            if self.options.eval_every:
                own, evaluator = self.cluster.task_index, self._loss_task
                others = [t for t in tasks if t != evaluator]
                self._arrived = host_signals.StepTokens("eval_ready", own, others, [evaluator])
                self._released = host_signals.StepTokens("eval_done", own, [evaluator], others)

    def session_config(self, config: tf.compat.v1.ConfigProto) -> tf.compat.v1.ConfigProto:
        """handle.session_config(config) with every task of the plan in its device filters, this one first: the
        step's peers (handle.tasks) and the tasks of the signals `prepare` built (the end's barrier reaches every
        task, also one that this task exchanges no tensor with)."""
        out = tf.compat.v1.ConfigProto()
        out.CopyFrom(config)
        if not out.device_filters:
            own = self.cluster.task_index
            out.device_filters.extend(f"/job:worker/replica:0/task:{t}" for t in [own] + [t for t in self._tasks
                                                                                          if t != own])
        return self.handle.session_config(out)

    def scaffold(self) -> tf.compat.v1.train.Scaffold:
        """Starts the session as host_session.start does, restoring this task's variables when there is a
        checkpoint; the readiness checks are host_session.start's."""
        ready = tf.constant([], tf.string)

        def start(scaffold, session):
            del scaffold
            path = self.checkpoints.latest() if self.checkpoints else None
            initialize = (lambda: self.checkpoints.restore(session, path)) if path else None
            host_session.start(session, self.handle, self.options.worker_wait_s, self.cluster, initialize=initialize)

        return tf.compat.v1.train.Scaffold(init_op=tf.no_op(), init_fn=start, ready_op=ready,
                                           ready_for_local_init_op=ready, local_init_op=tf.no_op(), saver=_RestoredInInitFn())

    def hooks(self, global_step, evaluate=None, simulated=None, log=print) -> List[tf.compat.v1.train.SessionRunHook]:
        """The first batch's check, the checkpoints' hook, held-out evaluation's, then the traced step's (in this
        order on every task, since each waits for the others); evaluate(session): the evaluating task's
        evaluation; simulated, log: TraceHook's."""
        hooks = [self._same_inputs]
        if self.checkpoints and self.options.save_checkpoints_secs:
            hooks.append(host_signals.SecondsAsStepsHook(global_step, self.options.save_checkpoints_secs,
                                                         self.checkpoints.save, self.cluster, self._tasks,
                                                         self.options.worker_wait_s))
        elif self.checkpoints and self.options.save_checkpoints_steps:
            hooks.append(host_signals.EveryStepsHook(global_step, self.options.save_checkpoints_steps,
                                                     self.checkpoints.save))
        if self.options.eval_every:
            hooks.append(host_signals.EveryStepsHook(global_step, self.options.eval_every,
                                                     lambda session, step: self._held_out(session, step, evaluate)))
        if self.options.trace_path:
            hooks.append(host_trace.HostTraceHook(self.options.trace_path, self.handle, self.options.trace_step,
                                                  simulated, log, self.cluster, self._tasks, self._loss_task,
                                                  self.options.worker_wait_s))
        return hooks

    def _held_out(self, session, step: int, evaluate) -> None:
        """Each task tells the evaluating one (the loss's) that its step is done and waits; that task evaluates
        model_fn on held-out data, every task's variables at that step, then lets the others go on."""
        self._arrived.send(session, step)
        self._arrived.take(session, step, "its step, before the held-out evaluation")
        if evaluate is not None:
            evaluate(session)
        self._released.send(session, step)
        self._released.take(session, step, "the held-out evaluation")

    def finish(self, session, step: int, watchdog) -> None:
        """The last checkpoint, then the wait for every task to finish."""
        if self.checkpoints:
            self.checkpoints.save(session, step)
        if watchdog is not None:
            watchdog.stop()  # the tasks that finish first may leave once the barrier lets them
        self._barrier.wait(session, self.options.failure_timeout_s)
        if self.checkpoints:
            self.checkpoints.tidy()


def _job(device: str) -> Optional[str]:
    return tf.DeviceSpec.from_string(device).job


class _RestoredInInitFn:
    """The Scaffold's saver: falsy, so that a session creator given a checkpoint_dir (the Estimator's) restores
    nothing itself and runs the Scaffold's init_fn, which restores this task's own variables (HostCheckpoints)."""

    def __bool__(self):
        return False

    def build(self) -> None:
        """Scaffold.finalize builds the saver: nothing to build."""
