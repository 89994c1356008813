"""tf.estimator per host (TF 2.15 only): every task of a cluster runs the same Estimator script and builds only its
own part of the pipeline, as the Trainer does (host_training.py).

    task = dapple_tf.frontends.estimator.cluster_task(plan)   # per host: starts this task's server
    estimator = tf.estimator.Estimator(dapple_tf.frontends.estimator.model_fn(...),
                                       config=task.run_config(model_dir="run1", save_checkpoints_steps=100))
    estimator.train(input_fn, max_steps=1000)

Without TF_CONFIG naming this process a worker task, `task.run_config` is `tf.estimator.RunConfig` and nothing
changes. Per host (`dapple_launch --per_host -- python script.py`):
- the task's server runs in this process (devices and threads from dapple_launch), started by `cluster_task`;
- the RunConfig's session is on that server (TF_CONFIG's "session_master"): the Estimator's own view of a
  cluster needs a chief, and per host every task is its own;
- TRAIN builds this task's part; the Estimator's checkpoints, restore, logging and summaries give way to the
  per-host ones: checkpoints in parts merged by task 0 every `save_checkpoints_steps` (or seconds, turned into a
  number of steps the tasks agree on), each task restoring its own variables, the loss's task logging and
  writing summaries (the others' EstimatorSpec loss is a constant 0 nothing logs), a watchdog in every task and
  a barrier at the end;
- every task must read the same batches: an input_fn that depends on the global step
  (dapple_tf.model.inputs.estimator_input_fn) or a dataset without unseeded shuffling.
"""

import contextlib
import json
import os
from typing import Optional

import tensorflow as tf
import tensorflow_estimator as tf_estimator

from dapple_tf.cluster import roles, servers
from dapple_tf.cluster.watchdog import TaskWatchdog
from dapple_tf.errors import PerHostError
from dapple_tf.frontends import host_training
from dapple_tf.frontends.trainer import TrainerOptions
from dapple_tf.rewrite.pipeline import as_plan, build_pipeline

RunConfig = tf_estimator.estimator.RunConfig
EstimatorSpec = tf_estimator.estimator.EstimatorSpec


def per_host_cluster() -> Optional[servers.TFCluster]:
    """The cluster when TF_CONFIG names this process a worker task (training per host), else None."""
    if not os.environ.get("TF_CONFIG"):
        return None
    cluster = servers.TFCluster.from_tf_config()
    return cluster if host_training.is_per_host(cluster) else None


class ClusterTask:
    """This process's task (`cluster_task`): `run_config` makes the Estimator's RunConfig for it."""

    def __init__(self, plan, cluster: Optional[servers.TFCluster], server):
        self.plan, self.cluster, self.server = as_plan(plan), cluster, server

    def run_config(self, **kwargs) -> RunConfig:
        """tf.estimator.RunConfig(**kwargs); per host, on this task's server, checkpoints every 100 steps unless
        told otherwise (by seconds: as a number of steps, host_signals.SecondsAsStepsHook), and no logging or
        summaries but on the loss's task."""
        if self.cluster is None:
            return RunConfig(**kwargs)
        if not kwargs.get("save_checkpoints_secs"):
            kwargs["save_checkpoints_secs"] = None  # RunConfig's default is by seconds: by steps here
            kwargs.setdefault("save_checkpoints_steps", TrainerOptions.save_checkpoints_steps)
        kwargs.setdefault("session_config", servers.session_config(TrainerOptions.failure_timeout_s))
        if tf.DeviceSpec.from_string(self.plan.stages[-1].devices[0]).task != self.cluster.task_index:
            kwargs.update(log_step_count_steps=None, save_summary_steps=0)  # the loss's task logs and summarizes
        with _tf_config({"session_master": self.server.target}):
            return RunConfig(**kwargs)


def cluster_task(plan) -> ClusterTask:
    """This process's ClusterTask; per host (TF_CONFIG names it a worker task) this starts the task's server, which
    runs while the ClusterTask is referenced (a TF server has no stop: it ends with its object or the process)."""
    cluster = per_host_cluster()
    server = None
    if cluster is not None:
        devices, threads = roles.server_settings()
        server = servers.start_server(cluster, devices, threads)
    return ClusterTask(plan, cluster, server)


@contextlib.contextmanager
def _tf_config(value: dict):
    """TF_CONFIG set to `value` inside the `with` (RunConfig reads it when made), as it was after."""
    before = os.environ.get("TF_CONFIG")
    os.environ["TF_CONFIG"] = json.dumps(value)
    try:
        yield
    finally:
        if before is None:
            del os.environ["TF_CONFIG"]
        else:
            os.environ["TF_CONFIG"] = before


def train_spec(cluster: servers.TFCluster, user_model_fn, optimizer, plan, options, layers, features, labels,
               config: RunConfig) -> EstimatorSpec:
    """TRAIN per host: this task's part of the pipeline and the per-host session start, checkpoints and end."""
    trainer_options = TrainerOptions(save_checkpoints_steps=config.save_checkpoints_steps or 0,
                                     save_checkpoints_secs=config.save_checkpoints_secs or 0,
                                     keep_checkpoints=config.keep_checkpoint_max or 0)
    host = host_training.HostTraining(cluster, config.model_dir, trainer_options)
    host.check_plan(as_plan(plan).devices)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    handle = build_pipeline(user_model_fn, features, labels, optimizer, plan, host.pipeline_options(options),
                            global_step=global_step, layers=layers)
    host.prepare(handle, (features, labels))
    if config.session_config is not None:
        # the Estimator's session is made from this same message after model_fn: it gets this task's device
        # filters and grappler's settings (HostTraining.session_config)
        config.session_config.CopyFrom(host.session_config(config.session_config))
    loss = handle.loss if handle.loss is not None else tf.constant(0.0, name="dapple_loss_on_another_task")
    return EstimatorSpec(tf_estimator.estimator.ModeKeys.TRAIN, loss=loss, train_op=handle.train_op,
                         scaffold=host.scaffold(), training_chief_hooks=[_HostHooks(host, global_step)])


class _HostHooks(tf.compat.v1.train.CheckpointSaverHook):
    """The per-host checkpoints, the watchdog and the end's barrier. A CheckpointSaverHook, so that the Estimator
    adds none of its own; none of its methods is the base class's."""

    def __init__(self, host: host_training.HostTraining, global_step):  # pylint: disable=super-init-not-called
        self._host, self._global_step = host, global_step
        self._hooks = host.hooks(global_step)  # the first batch's check, the checkpoints
        self._listeners = []  # the Estimator's saving listeners would be added here: refused in begin
        self._watchdog: Optional[TaskWatchdog] = None
        self._step = 0

    def begin(self):
        if self._listeners:
            raise PerHostError("training per host does not call the Estimator's saving_listeners")
        for hook in self._hooks:
            hook.begin()

    def after_create_session(self, session, coord):
        self._step = int(session.run(self._global_step))
        for hook in self._hooks:
            hook.after_create_session(session, coord)
        cluster = self._host.cluster
        self._watchdog = TaskWatchdog(cluster, self._lost, patience_s=self._host.options.failure_timeout_s)
        self._watchdog.__enter__()

    def _lost(self, lost) -> str:
        tasks = "; ".join(f"{self._host.cluster.describe_task(i)} is {why}" for i, why in lost.items())
        return (f"training stopped at step {self._step}: {tasks}. To resume, restart the cluster and run the same "
                "command again: training resumes from the latest checkpoint")

    def before_run(self, run_context):
        asked = {i: hook.before_run(run_context) for i, hook in enumerate(self._hooks)}
        asked = {i: args for i, args in asked.items() if args is not None}
        return tf.compat.v1.train.SessionRunArgs({i: args.fetches for i, args in asked.items()}) if asked else None

    def after_run(self, run_context, run_values):
        self._step += 1
        results = run_values.results or {}
        for i, hook in enumerate(self._hooks):
            hook.after_run(run_context, tf.compat.v1.train.SessionRunValues(results.get(i), run_values.options,
                                                                            run_values.run_metadata))

    def end(self, session):
        self._host.finish(session, self._step, self._watchdog)
        self._watchdog.__exit__(None, None, None)
