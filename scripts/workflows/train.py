"""One training run of dapple_train, from its settings: where it runs (this process's virtual CPUs, a
TF_CONFIG cluster whose chief this is, or one Horovod process), the model and its inputs (a reference
model or a user's model_fn/input_fn), the plan (a plan file, or profiled and planned here), then the
Trainer loop.
"""

import dataclasses
import os
from typing import Callable, List, Optional


@dataclasses.dataclass
class TrainSettings:
    """dapple_train's flags (the same names and defaults; its --help says what each means)."""

    model: Optional[str] = None
    config: str = "tiny"
    model_flags: str = ""
    model_fn: Optional[str] = None
    input_fn: Optional[str] = None
    eval_input_fn: Optional[str] = None
    scope_depth: Optional[int] = None
    scope_patterns: Optional[List[str]] = None
    plan: Optional[str] = None
    profile: Optional[str] = None
    cluster: Optional[str] = None
    num_devices: int = 4
    global_batch_size: Optional[int] = None
    backend: str = "tf"
    schedule: Optional[str] = None
    batch_norm: str = "per_slice"
    steps: int = 100
    model_dir: Optional[str] = None
    save_checkpoints_steps: int = 100
    save_checkpoints_secs: float = 0
    keep_checkpoints: int = 5
    log_every: int = 10
    summary_every: int = 10
    eval_every: int = 0
    optimizer: str = "sgd"
    learning_rate: float = 0.01
    seed: int = 0
    failure_timeout: float = 30
    trace: Optional[str] = None
    trace_step: int = 5
    worker_wait_timeout: float = 60
    plan_wait_timeout: float = 900
    clip_global_norm: Optional[float] = None


@dataclasses.dataclass
class _Where:
    """Where the run trains: a TF cluster (and its devices), this process's session config, or Horovod."""

    cluster: object = None
    server: object = None  # per-host training: this task's own server
    devices: Optional[tuple] = None
    config: object = None
    horovod: object = None

    def describe(self, num_devices: int) -> str:
        where = f"{len(self.cluster.workers)} worker tasks" if self.cluster else f"{num_devices} virtual CPU devices"
        where += f" (this is task {self.cluster.task_index}, building its own part)" if self.server else ""
        return f"{self.horovod.size} Horovod processes x {where}" if self.horovod else where


def model_and_inputs(s: TrainSettings, batch_size: int):
    """(model_fn, input_fn(step), eval_input_fn(step) or None, name) from the settings."""
    from dapple_tf.model import user_model

    if s.model:
        import models

        spec = models.get_model(s.model, s.config, **models.parse_model_flags(s.model_flags))
        return (spec.model_fn, spec.step_input_fn(batch_size, s.seed),
                spec.step_input_fn(batch_size, s.seed + 1), s.model)
    from dapple_tf.model import inputs

    model_fn = user_model.load_function(s.model_fn, "model_fn")  # Estimator-style ones too (dapple_tf.minimize)
    user_input = user_model.load_function(s.input_fn, "input_fn")
    user_eval = user_model.load_function(s.eval_input_fn, "eval_input_fn") if s.eval_input_fn else None
    return (model_fn, lambda step: inputs.batch_tensors(user_input, step, batch_size),
            (lambda step: inputs.batch_tensors(user_eval, step, batch_size)) if user_eval else None, s.model_fn)


def profile_here(model_fn: Callable, input_fn: Callable, batch_size: int, name: str, layers=None):
    """Profiles model_fn on this process's first CPU at batch_size, on input_fn's batch for step 0."""
    import tensorflow as tf

    import profiler

    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        values = sess.run(input_fn(tf.constant(0, tf.int64)))
    values = tf.nest.map_structure(lambda v: v[:batch_size], values)

    def make_inputs():
        return tf.nest.map_structure(lambda v: tf.compat.v1.placeholder(v.dtype, (batch_size,) + v.shape[1:]), values)
    print(f"profiling {name} layer by layer at batch {batch_size} on /device:CPU:0 ...", flush=True)
    return profiler.profile_model(model_fn, make_inputs, values, batch_size, "/device:CPU:0", model_name=name,
                                  layers=layers)


def planner_cluster(s: TrainSettings, devices):
    """The planner's cluster description for the devices training runs on (or --cluster)."""
    from planner.formats import cluster as clusters

    if s.cluster:
        return clusters.load_cluster(s.cluster, num_devices=s.num_devices)
    if devices is None:
        return clusters.local_cluster(s.num_devices)
    tasks = sorted({d.split("/device:")[0] for d in devices})
    per_task = [sum(d.startswith(t + "/device:GPU:") for d in devices) for t in tasks]
    if min(per_task):
        return clusters.make_cluster(f"tf-{len(tasks)}x{min(per_task)}", len(tasks), min(per_task),
                                     clusters.V100_MEMORY_BYTES, clusters.NVLINK_BANDWIDTH, clusters.ETHERNET_25G)
    cpus = min(sum(d.startswith(t + "/device:CPU:") for d in devices) for t in tasks)
    return clusters.local_task_cluster(len(tasks), cpus)


def _plan_and_simulation(s: TrainSettings, model_fn, input_fn, name, devices, batch_size, layers, cluster=None):
    """(dapple_tf.Plan as planned, the simulated run for --trace or None), from --plan or planned here (per host:
    by task 0, for every task)."""
    import dapple_tf
    import profiler
    from planner.formats import plan_pb2, read_message
    from planner.simulation.sim_adapter import simulate_plan

    if s.plan:
        plan = dapple_tf.Plan.from_file(s.plan)
        simulated = None
        if s.trace and s.profile:
            simulated = simulate_plan(read_message(s.plan, plan_pb2.Plan), profiler.read_profile(s.profile))
        return plan, simulated
    target = planner_cluster(s, devices)

    def plan_here():
        return _planned(s, model_fn, input_fn, name, target, batch_size, layers)

    per_host = cluster is not None and cluster.task_type == "worker"
    proto, profile = _shared_plan(s, cluster, plan_here) if per_host else plan_here()
    simulated = simulate_plan(proto, profile) if s.trace else None
    return dapple_tf.Plan.from_proto(proto, source=f"the plan for {target.name}"), simulated


def _planned(s: TrainSettings, model_fn, input_fn, name, target, batch_size, layers):
    """(plan proto, profile): the model profiled here (or --profile) and planned for the planner's cluster
    `target`."""
    import profiler
    from planner.planning import api as planner_api
    from planner.planning.report import summarize

    if s.profile:
        profile = profiler.read_profile(s.profile)
    else:
        profile = profile_here(model_fn, input_fn, max(1, batch_size // len(target.device_names)), name, layers)
    # --schedule: the planner weighs that schedule only (interleaved: the plan's variant with two stages per device)
    schedules = {"schedules": (s.schedule,)} if s.schedule else {}
    proto = planner_api.plan(profile, target, batch_size, planner="dapple", **schedules)
    print(summarize(proto), flush=True)
    return proto, profile


def _shared_plan(s: TrainSettings, cluster, plan_here):
    """Per host without --plan: worker task 0 profiles and plans (`plan_here`), every other task receives its plan
    and profile (host_signals.broadcast_text), so that every task builds its part of the same plan."""
    import base64
    import json

    from dapple_tf.cluster import host_signals
    from planner.formats import layer_cost_pb2, plan_pb2

    text = ""
    if cluster.task_index == 0:
        proto, profile = plan_here()
        text = json.dumps({k: base64.b64encode(m.SerializeToString()).decode() for k, m in
                           (("plan", proto), ("profile", profile))})
    else:
        print(f"waiting for worker task 0's plan (up to {s.plan_wait_timeout:g} s)", flush=True)
    text = host_signals.broadcast_text(cluster, range(len(cluster.workers)), text, 0, s.plan_wait_timeout, "plan")
    messages = json.loads(text)
    proto, profile = plan_pb2.Plan(), layer_cost_pb2.LayerCostProfile()
    proto.ParseFromString(base64.b64decode(messages["plan"]))
    profile.ParseFromString(base64.b64decode(messages["profile"]))
    return proto, profile


def make_plan(s: TrainSettings, model_fn, input_fn, name, devices, batch_size, layers=None, cluster=None):
    """The plan (dapple_tf.Plan) from --plan, or from a profile and the DAPPLE planner, on the devices
    training runs on (`devices`, or this process's when None), and the simulated run for --trace; per host
    (`cluster` names this process a worker task), task 0's plan."""
    import tensorflow as tf

    from dapple_tf.cluster.servers import map_devices
    from dapple_tf.rewrite.update.replicas import canonical_device

    plan, simulated = _plan_and_simulation(s, model_fn, input_fn, name, devices, batch_size, layers, cluster)
    if devices is None:  # this process's own devices
        devices = [canonical_device(d.name) for d in tf.config.list_logical_devices()]
    plan = plan.with_devices(canonical_device)  # build_pipeline's spelling, as map_devices compares names
    mapping = dict(zip(plan.devices, map_devices(plan.devices, devices)))
    return plan.with_devices(mapping.__getitem__), simulated


def make_optimizer(s: TrainSettings):
    """The --optimizer at --learning_rate (a TF1 optimizer)."""
    import tensorflow as tf

    v1 = tf.compat.v1.train
    return {"sgd": lambda: v1.GradientDescentOptimizer(s.learning_rate),
            "momentum": lambda: v1.MomentumOptimizer(s.learning_rate, 0.9),
            "adam": lambda: v1.AdamOptimizer(s.learning_rate)}[s.optimizer]()


def horovod_pipeline(s: TrainSettings):
    """hvd.init() and the --plan checked against horovodrun's process count (a HorovodPipeline)."""
    if not s.plan:
        raise ValueError("--backend=horovod needs a --plan from dapple_plan --backend=horovod --num_processes=P "
                         "(every process must build the same graph)")
    if os.environ.get("TF_CONFIG"):
        raise ValueError("--backend=horovod runs under horovodrun, not on a TF_CONFIG cluster")
    import horovod.tensorflow as hvd

    from dapple_tf.frontends.horovod import HorovodPipeline

    hvd.init()
    return HorovodPipeline(s.plan)


def connect(s: TrainSettings) -> _Where:
    """Where this run trains: Horovod, the TF_CONFIG cluster (after its workers are up), or --num_devices
    virtual CPUs of this process."""
    import tensorflow as tf

    where = _Where(horovod=horovod_pipeline(s) if s.backend == "horovod" else None)
    if os.environ.get("TF_CONFIG") and not where.horovod:
        from dapple_tf.cluster.servers import TFCluster, cluster_devices, wait_for_workers

        where.cluster = TFCluster.from_tf_config()
        if where.cluster.task_type == "worker":
            where.server = start_own_server(s, where.cluster)
        print(f"waiting for {len(where.cluster.workers)} worker tasks: {', '.join(where.cluster.workers)}", flush=True)
        wait_for_workers(where.cluster, s.worker_wait_timeout)
        where.devices = cluster_devices(where.cluster, s.worker_wait_timeout)
        print(f"cluster devices: {', '.join(where.devices)}", flush=True)
    else:
        from dapple_tf.cluster.servers import split_cpu

        split_cpu(s.num_devices)
        where.config = tf.compat.v1.ConfigProto(device_count={"CPU": s.num_devices})
    return where


def start_own_server(s: TrainSettings, cluster):
    """Per-host training (TF_CONFIG makes this process a worker task): this task's server, in this process, with the
    devices and threads dapple_launch passed (roles.WORKER_SERVER_ENV)."""
    from dapple_tf.cluster.roles import server_settings
    from dapple_tf.cluster.servers import start_server

    devices, threads = server_settings()
    server = start_server(cluster, devices, threads)
    print(f"worker task {cluster.task_index} serving at {cluster.workers[cluster.task_index]}; building its own part "
          "of the training graph (per host)", flush=True)
    return server


def global_batch_size(s: TrainSettings, horovod=None) -> int:
    """--global_batch_size, else the plan file's (times the Horovod processes)."""
    import dapple_tf

    batch_size = s.global_batch_size
    if not batch_size and s.plan:
        batch_size = dapple_tf.Plan.from_file(s.plan).global_batch_size * (horovod.size if horovod else 1)
    if not batch_size:
        raise ValueError("--global_batch_size is required (the plan file does not say it)")
    return batch_size


def trainer_options(s: TrainSettings, has_eval: bool, lead: bool):
    """TrainerOptions from the settings; `lead`: this process checkpoints, logs and traces."""
    from dapple_tf.frontends.trainer import TrainerOptions

    return TrainerOptions(
        save_checkpoints_steps=s.save_checkpoints_steps, save_checkpoints_secs=s.save_checkpoints_secs,
        keep_checkpoints=s.keep_checkpoints, log_every=s.log_every, summary_every=s.summary_every,
        eval_every=s.eval_every if has_eval else 0, failure_timeout_s=s.failure_timeout,
        worker_wait_s=s.worker_wait_timeout, seed=s.seed, trace_step=s.trace_step,
        trace_path=s.trace if lead else None)


def train(s: TrainSettings) -> int:
    """Runs the whole training run of the settings (dapple_train has checked them); returns the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # CPU devices then report peak memory
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    where = connect(s)
    from dapple_tf.frontends.trainer import Trainer
    from dapple_tf.model import user_model

    horovod = where.horovod
    batch_size = global_batch_size(s, horovod)
    model_fn, input_fn, eval_input_fn, name = model_and_inputs(s, batch_size)
    layers = user_model.scope_layers(s.scope_depth, s.scope_patterns)
    simulated = None
    if horovod:
        plan, global_input_fn = horovod.plan, input_fn
        input_fn = lambda step: horovod.local_slice(global_input_fn(step))  # noqa: E731
    else:
        plan, simulated = make_plan(s, model_fn, input_fn, name, where.devices, batch_size, layers, where.cluster)
    lead = not horovod or horovod.rank == 0  # under Horovod, rank 0 checkpoints, logs and traces
    from dapple_tf.model import minimize
    from dapple_tf.rewrite.options import PipelineOptions

    # an Estimator-style model_fn names its optimizer in dapple_tf.minimize: --optimizer does not apply
    optimizer = None if minimize.is_estimator_style(model_fn) else (lambda: make_optimizer(s))
    options = PipelineOptions(schedule=s.schedule, batch_norm=s.batch_norm, clip_global_norm=s.clip_global_norm)
    trainer = Trainer(model_fn, input_fn, optimizer, plan, s.model_dir if lead else None,
                      eval_input_fn=eval_input_fn, cluster=where.cluster,
                      options=trainer_options(s, eval_input_fn is not None, lead), config=where.config,
                      horovod=horovod, log=None if lead else (lambda text: None), simulated=simulated, layers=layers,
                      pipeline_options=options)
    print(f"training {name}: {len(plan.stages)} stages "
          f"({':'.join(str(len(st.devices)) for st in plan.stages)} devices), M={plan.num_micro_batches}, "
          f"global batch {batch_size}, on {where.describe(s.num_devices)}", flush=True)
    result = trainer.train(s.steps)
    if not lead:
        return 0
    print(f"done: step {result.step}" + (f", loss {result.loss:.6f}" if result.loss == result.loss else "")
          + (f", resumed from step {result.first_step}" if result.first_step else "")
          + (f"; checkpoints in {s.model_dir}" if s.model_dir else ""), flush=True)
    return 0
