"""`dapple_tf.Trainer`: an estimator-style training loop around build_pipeline.

    trainer = dapple_tf.Trainer(model_fn, input_fn, optimizer, plan, model_dir="run1")
    result = trainer.train(steps=1000)      # resumes from model_dir's latest checkpoint

`input_fn(step, batch_size)` returns (features, labels), numpy arrays or tensors, for the global batch
of the step about to run (dapple_tf/model/inputs.py: the contract dapple_profile, dapple_train and
`inputs.estimator_input_fn` share; `batch_size` is `Trainer(batch_size=...)`, else the plan's global
batch; the older `input_fn(step)`, with `step` the int64 global step tensor, still works): a function
of the step alone makes a resumed run see exactly the batches an uninterrupted one would. The loop
runs in a `SingularMonitoredSession` (restore, init, local init and broadcast of the variable
copies, hooks), on this process's devices or on a TF cluster (`cluster=TFCluster`: the session
runs on worker task 0 and every operation is bounded by `failure_timeout_s`).
MonitoredTrainingSession is not used because it silently re-creates the session after
UnavailableError, which turns a dead worker into a retry loop instead of an error.
On a cluster a watchdog thread probes every task while training (watchdog.py): a lost task, the
session target included (whose death no timeout of the session would end), ends the process
with the same error, naming the task, within seconds (a dead process) or `failure_timeout_s` (one
that does not answer).

Each step's loss, samples/s and step time, and every `summary_every` steps the peak allocator use
per device (from a traced step) and the model's own summaries (rebuilt on the pipeline: summaries.py), go to
TensorBoard summaries in model_dir; a progress line is
printed every `log_every` steps; with `eval_input_fn`, the loss on held-out data is computed through
the single-device graph (model_fn again, re-using the variables) every `eval_every` steps.
"""

import contextlib
import dataclasses
import time
from typing import Callable, Dict, Optional, Sequence

import tensorflow as tf

from dapple_tf.rewrite.options import PipelineOptions
from dapple_tf.model import inputs
from dapple_tf.frontends import host_training
from dapple_tf.cluster.servers import ClusterError, TFCluster, failed_tasks, session_config
from dapple_tf.errors import DappleError
from dapple_tf.model import minimize as minimize_lib
from dapple_tf.model.layers import LayerRecorder
from dapple_tf.rewrite.template import outputs as outputs_lib
from dapple_tf.rewrite.pipeline import as_plan, build_pipeline
from dapple_tf.trace.step_stats import peak_bytes_per_device
from dapple_tf.trace.hook import TraceHook
from dapple_tf.cluster.watchdog import TaskWatchdog

# What a lost or stopped task raises in the client's session.
CLUSTER_FAILURES = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)


@dataclasses.dataclass
class TrainerOptions:
    """How often the Trainer saves, logs, summarizes and evaluates, and how long it waits."""

    save_checkpoints_steps: int = 100  # 0: by seconds only
    save_checkpoints_secs: float = 0.0  # 0: by steps only
    keep_checkpoints: int = 5
    log_every: int = 10  # progress line every this many steps (0: never)
    summary_every: int = 10  # scalar summaries every this many steps (0: never)
    eval_every: int = 0  # held-out loss every this many steps (0: never; needs eval_input_fn)
    failure_timeout_s: float = 30.0  # a step (or a lost task) ends within this on a cluster
    worker_wait_s: float = 60.0  # how long a cluster's workers are waited for at start
    seed: Optional[int] = None  # graph-level random seed
    trace_path: Optional[str] = None  # write one traced step's timeline here (trace_hook.py), and a PNG beside it
    trace_step: int = 5  # which step of this run to trace (counted from its first: warm-up over)


@dataclasses.dataclass
class TrainResult:
    step: int  # the global step reached
    loss: float  # the loss of the last step run (nan if none ran)
    first_step: int  # the global step the run started from (> 0 when resumed)
    eval_loss: Optional[float] = None


class Trainer:
    """Trains model_fn with build_pipeline for a plan; see the module docstring."""

    def __init__(self, model_fn: Callable, input_fn: Callable, optimizer, plan, model_dir: Optional[str] = None,
                 hooks: Sequence[tf.compat.v1.train.SessionRunHook] = (), *, schedule: Optional[str] = None,
                 eval_input_fn: Optional[Callable] = None, cluster: Optional[TFCluster] = None,
                 options: Optional[TrainerOptions] = None, config: Optional[tf.compat.v1.ConfigProto] = None,
                 log=None, horovod=None, batch_norm: str = "per_slice", simulated=None,
                 batch_size: Optional[int] = None, layers=None, pipeline_options: Optional[PipelineOptions] = None):
        """model_fn: build_pipeline's, or an Estimator-style model_fn(features, labels, mode, params) whose TRAIN
        spec's train_op comes from dapple_tf.minimize (then optimizer=None).
        simulated: the planner's SimulationResult of this plan, drawn under the traced step's timeline.
        batch_size: what a two-argument input_fn(step, batch_size) gets (default: the plan's global batch).
        layers: build_pipeline's (None: dapple_tf.layer markers; dapple_tf.layers_by_scope(...)).
        pipeline_options: build_pipeline's PipelineOptions (clipping, stage functions, ...), instead of schedule
        and batch_norm."""
        self.model_fn, self.input_fn, self.plan = model_fn, input_fn, plan
        self.optimizer = optimizer
        self.model_dir, self.hooks, self.schedule = model_dir, list(hooks), schedule
        self.eval_input_fn, self.cluster = eval_input_fn, cluster
        self.options = options or TrainerOptions()
        self.config = config
        self.horovod = horovod  # a dapple_tf.frontends.horovod.HorovodPipeline: input_fn gives this process's slice
        self.batch_norm = batch_norm  # build_pipeline's batch_norm
        if pipeline_options is not None and (schedule is not None or batch_norm != "per_slice"):
            raise DappleError("give schedule and batch_norm in pipeline_options=PipelineOptions(...), not beside it")
        self.pipeline_options = pipeline_options or PipelineOptions(schedule=schedule, batch_norm=batch_norm)
        self.simulated = simulated
        self.log = log or (lambda text: print(text, flush=True))
        self.batch_size = batch_size or getattr(plan, "global_batch_size", None) or None
        self.layers = layers
        if self.options.eval_every and eval_input_fn is None:
            raise DappleError("eval_every needs an eval_input_fn (held-out data)")

    def _session_config(self) -> tf.compat.v1.ConfigProto:
        if self.cluster is not None:
            config = session_config(self.options.failure_timeout_s)
            if self.config is not None:
                config.MergeFrom(self.config)
            return config
        return self.config

    def _optimizer(self):
        if self.optimizer is None or isinstance(self.optimizer, tf.compat.v1.train.Optimizer):
            return self.optimizer
        return self.optimizer() if callable(self.optimizer) else self.optimizer

    def train(self, steps: int) -> TrainResult:
        """Trains until the global step reaches `steps` (a resumed run continues to the same total)."""
        if steps < 1:
            raise DappleError(f"steps must be >= 1, got {steps}")
        per_host = None
        if host_training.is_per_host(self.cluster):
            host_training.check_supported(self.options, self.horovod)
            per_host = host_training.HostTraining(self.cluster, self.model_dir, self.options)
            per_host.check_plan(as_plan(self.plan).devices)
        graph = tf.Graph()
        with graph.as_default():
            if self.options.seed is not None:
                tf.compat.v1.set_random_seed(self.options.seed)
            global_step = tf.compat.v1.train.get_or_create_global_step()
            features, labels = self._batch(self.input_fn, global_step)
            model_fn = minimize_lib.training_model_fn(self.model_fn)
            if self.horovod is not None:
                handle = self.horovod.build(model_fn, features, labels, self._optimizer(),
                                            global_step=global_step, layers=self.layers, options=self.pipeline_options)
            else:
                options = per_host.pipeline_options(
                    self.pipeline_options, [stage.devices for stage in as_plan(self.plan).stages],
                    evaluates=bool(self.eval_input_fn)) if per_host else self.pipeline_options
                handle = build_pipeline(model_fn, features, labels, self._optimizer(), self.plan, options,
                                        global_step=global_step, layers=self.layers)
            lead = per_host is None or handle.loss is not None  # per host: the loss's task logs and summarizes
            log = self.log if lead else (lambda text: None)
            model_summaries = tf.compat.v1.summary.merge_all() if lead else None  # the model's own, rebuilt
            eval_loss = self._eval_loss(graph, global_step) if self.eval_input_fn and lead else None
            batch = _batch_size(features)
            progress = _ProgressHook(handle.loss, global_step, batch, steps, self.model_dir if lead else None,
                                     self.options, None if per_host else eval_loss, log, model_summaries)
            hooks = [tf.compat.v1.train.StopAtStepHook(last_step=steps), progress] + self.hooks
            if per_host:
                per_host.prepare(handle, (features, labels))
                scaffold, master, checkpoint_dir = per_host.scaffold(), per_host.master, None
                evaluate = (lambda session: progress.evaluated(session.run(eval_loss))) if eval_loss is not None \
                    else None
                hooks += per_host.hooks(global_step, evaluate, self.simulated, log)
            else:
                scaffold, checkpoint_dir = self._scaffold_and_hooks(handle, hooks), self.model_dir
                master = self.cluster.target if self.cluster else ""
            try:
                with self._watchdog(progress) as watchdog, tf.compat.v1.train.SingularMonitoredSession(
                    hooks=hooks, scaffold=scaffold, master=master,
                    config=(per_host or handle).session_config(self._session_config()), checkpoint_dir=checkpoint_dir,
                ) as sess:
                    checked = False
                    while not sess.should_stop():
                        sess.run(handle.train_op)
                        if not checked:
                            _check_step_advanced(sess.raw_session().run(global_step), progress.first_step)
                            checked = True
                    if per_host:
                        per_host.finish(sess.raw_session(), progress.step, watchdog)
            except CLUSTER_FAILURES as e:
                raise self._failure(e, progress) from None
            finally:
                progress.close()
        return TrainResult(progress.step, progress.last_loss, progress.first_step, progress.last_eval)

    def _scaffold_and_hooks(self, handle, hooks) -> tf.compat.v1.train.Scaffold:
        """The one graph's Scaffold (restore, init, local init); adds Horovod's broadcast, the trace and the
        checkpoint hooks to `hooks`."""
        saver = tf.compat.v1.train.Saver(max_to_keep=self.options.keep_checkpoints)
        if self.horovod is not None:
            hooks.insert(0, self.horovod.broadcast_hook(handle))  # before any hook reads a variable
        if self.options.trace_path:
            hooks.append(TraceHook(self.options.trace_path, handle, self.options.trace_step, self.simulated,
                                   self.log))
        if self.model_dir and (self.options.save_checkpoints_steps or self.options.save_checkpoints_secs):
            hooks.append(tf.compat.v1.train.CheckpointSaverHook(
                self.model_dir, save_steps=self.options.save_checkpoints_steps or None,
                save_secs=self.options.save_checkpoints_secs or None, saver=saver))
        return tf.compat.v1.train.Scaffold(saver=saver, local_init_op=handle.local_init_op)

    def _eval_loss(self, graph: tf.Graph, global_step) -> tf.Tensor:
        """The loss of model_fn on held-out data, single-device, with the trained variables."""
        before = set(tf.compat.v1.global_variables())
        with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True), \
                LayerRecorder(graph).activate(), tf.name_scope("dapple_eval"):
            features, labels = self._batch(self.eval_input_fn, global_step)
            if minimize_lib.is_estimator_style(self.model_fn):
                loss = minimize_lib.call_estimator_style(self.model_fn, features, labels, "eval").loss
            else:
                loss = self.model_fn(features, labels)
            loss = tf.convert_to_tensor(outputs_lib.split_model_result(loss)[0])
        created = [v.op.name for v in tf.compat.v1.global_variables() if v not in before]
        if created:
            raise DappleError(
                f"evaluating model_fn again created variables {created[:3]}: evaluation re-uses the trained "
                "variables, so model_fn must create them with tf.compat.v1.get_variable"
            )
        return loss

    def _batch(self, input_fn, global_step):
        """input_fn's batch for the step about to run (dapple_tf/model/inputs.py)."""
        first = len(tf.compat.v1.get_default_graph().get_operations())
        batch = inputs.batch_tensors(input_fn, global_step.read_value(), self.batch_size, legacy="step")
        if self.cluster is not None and any(op.type == "PyFunc"
                                            for op in tf.compat.v1.get_default_graph().get_operations()[first:]):
            raise DappleError(f"{inputs.describe(input_fn)} returns numpy arrays, which only the process running the "
                              "session can call; on a TF cluster return tensors (TF ops on `step`, tf.constant)")
        return batch

    def _watchdog(self, progress):
        """On a cluster, a TaskWatchdog that ends this process when a task is lost (watchdog.py)."""
        if self.cluster is None:
            return contextlib.nullcontext()
        return TaskWatchdog(self.cluster, lambda lost: self._lost_text(lost, progress),
                            patience_s=self.options.failure_timeout_s)

    def _lost_text(self, lost, progress, error=None) -> str:
        if lost:
            what = "; ".join(f"{self.cluster.describe_task(i)} is {why}" for i, why in lost.items())
        else:
            what = (f"a step did not finish within {self.options.failure_timeout_s:g} s and every task still "
                    f"answers ({type(error).__name__}: {error.message.splitlines()[0] if error.message else ''})")
        resume = ("restart the cluster and run the same command again: training resumes from the latest "
                  f"checkpoint in {self.model_dir}") if self.model_dir else "no model_dir: nothing to resume from"
        return f"training stopped at step {progress.step}: {what}. To resume, {resume}"

    def _failure(self, error, progress) -> ClusterError:
        if self.cluster is None:
            return ClusterError(f"training stopped at step {progress.step}: {type(error).__name__}: {error.message}")
        return ClusterError(self._lost_text(failed_tasks(self.cluster), progress, error))


def _check_step_advanced(step: int, first_step: int) -> None:
    """A train op that does not advance global_step would train forever."""
    if step == first_step:
        raise DappleError(
            "the training step did not advance global_step: pass global_step to dapple_tf.minimize (its optimizer "
            "then advances it, as apply_gradients does), or advance it in model_fn after minimize's op, as TF1 "
            "BERT does for its AdamW")


def _batch_size(features) -> int:
    first = tf.nest.flatten(features)[0]
    if first.shape.rank and tf.compat.dimension_value(first.shape[0]) is not None:
        return int(first.shape[0])
    raise DappleError("input_fn must return features with a known batch dimension (the global batch)")


class _ProgressHook(tf.compat.v1.train.SessionRunHook):
    """Progress lines, scalar summaries, per-device peak memory and held-out loss."""

    def __init__(self, loss, global_step, batch_size, last_step, model_dir, options: TrainerOptions, eval_loss, log,
                 model_summaries=None):
        self._loss, self._global_step, self._batch = loss, global_step, batch_size
        self._model_summaries = model_summaries
        self._last_step, self._options, self._eval_loss, self._log = last_step, options, eval_loss, log
        self._model_dir = model_dir
        self._writer = None
        self.step = self.first_step = 0
        self.last_loss = float("nan")
        self.last_eval: Optional[float] = None
        self._trace_next = False

    def begin(self):
        if self._model_dir and self._options.summary_every:
            # the writer CheckpointSaverHook also uses: two writers opened in one second share a file name
            self._writer = tf.compat.v1.summary.FileWriterCache.get(self._model_dir)

    def after_create_session(self, session, coord):
        self.step = self.first_step = int(session.run(self._global_step))
        if self.first_step:
            self._log(f"resumed from the checkpoint at step {self.first_step}")
        self._window_start, self._window_steps = time.perf_counter(), 0

    def before_run(self, run_context):
        self._started = time.perf_counter()
        every = self._options.summary_every
        self._trace_next = bool(self._writer and every and (self.step + 1) % every == 0)
        options = None
        if self._trace_next:
            options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        fetches = {"step": self._global_step, **({"loss": self._loss} if self._loss is not None else {})}
        if self._writer and every and (self.step + 1) % every == 0 and self._model_summaries is not None:
            fetches["summary"] = self._model_summaries
        return tf.compat.v1.train.SessionRunArgs(fetches, options=options)

    def after_run(self, run_context, run_values):
        elapsed = time.perf_counter() - self._started
        self.last_loss = float(run_values.results.get("loss", float("nan")))
        self.step += 1  # the global step after this one's apply (the fetched value is read before it)
        self._window_steps += 1
        scalars: Dict[str, float] = {"loss": self.last_loss, "step_time_ms": elapsed * 1e3,
                                     "samples_per_sec": self._batch / max(elapsed, 1e-9)}
        if self._trace_next:
            for device, peak in peak_bytes_per_device(run_values.run_metadata.step_stats).items():
                scalars[f"peak_memory_mib/{device.strip('/').replace('/', '_')}"] = peak / 2**20
        evaluate = self._eval_loss is not None and self._options.eval_every and self.step % self._options.eval_every == 0
        if evaluate:
            scalars["eval_loss"] = self._held_out(run_context.session.run(self._eval_loss))
        if self._writer and (self._trace_next or evaluate or self.step % self._options.summary_every == 0):
            self._write(scalars)
        if "summary" in run_values.results:
            self._writer.add_summary(run_values.results["summary"], self.step)
        every = self._options.log_every
        if every and (self.step % every == 0 or self.step == self._last_step):
            window = time.perf_counter() - self._window_start
            self._log(f"step {self.step}/{self._last_step}  loss {self.last_loss:.4f}  "
                      f"{self._window_steps * self._batch / max(window, 1e-9):.1f} samples/s  "
                      f"{window / self._window_steps * 1e3:.1f} ms/step")
            self._window_start, self._window_steps = time.perf_counter(), 0

    def _held_out(self, loss) -> float:
        self.last_eval = float(loss)
        self._log(f"step {self.step}: held-out loss {self.last_eval:.4f}")
        return self.last_eval

    def evaluated(self, loss) -> None:
        """A held-out loss evaluated after this step by another hook (per-host training's): logged and written."""
        self._held_out(loss)
        if self._writer:
            self._write({"eval_loss": self.last_eval})

    def _write(self, scalars: Dict[str, float]):
        values = [tf.compat.v1.Summary.Value(tag=k, simple_value=v) for k, v in sorted(scalars.items())]
        self._writer.add_summary(tf.compat.v1.Summary(value=values), self.step)

    def close(self):
        if self._writer:
            self._writer.flush()
            self._writer = None
