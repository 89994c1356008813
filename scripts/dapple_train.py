"""dapple_train: train a model with DAPPLE (pipelined, data-parallel) in one process or on a cluster.

Without TF_CONFIG it runs in this process on --num_devices virtual CPU devices; under dapple_launch
(TF_CONFIG names the worker tasks and this task is the chief) it builds the pipelined graph here and
runs it on the workers. With no --plan it profiles the model (or reads --profile) and plans it with
the DAPPLE planner for the devices it runs on (or for --cluster).

Examples:
  dapple_train --model=mlp --global_batch_size=24 --steps=100 --model_dir=m
  dapple_train --model=bert --model_flags=num_layers=4 --plan=plan.json --steps=1000 --model_dir=m
  dapple_train --model_fn=my.module:model_fn --input_fn=my.module:input_fn --global_batch_size=64 --steps=10
  dapple_launch --cluster=local:3x2 -- dapple_train --model=mlp --global_batch_size=24 --steps=6 --model_dir=m
  horovodrun -np 2 --gloo dapple_train --backend=horovod --plan=hvd_plan.json --num_devices=3 --model=mlp --steps=6

With --backend=horovod (under horovodrun) every process trains the --plan (from `dapple_plan
--backend=horovod --num_processes=P`: one server's plan at the per-process batch) on its own
--num_devices virtual CPUs, on its slice of the global batch; gradients are averaged across processes
by Horovod, rank 0 writes checkpoints and logs.

A user's --model_fn(features, labels) returns the loss, its layers marked with dapple_tf.layer or,
for a model without markers (Keras layers, tf-slim nets), cut by its name scopes: --scope_depth=N or
--scope_patterns=... (dapple_tf.layers_by_scope, as dapple_profile's). --input_fn(step, batch_size)
returns (features, labels) of the global batch for `step`, numpy arrays or tensors (the contract of
dapple_tf/model/inputs.py, shared with dapple_profile and dapple_tf.Trainer): a function of the step alone
makes a resumed run continue exactly. The module must be importable: run from its folder or put the
folder on PYTHONPATH. Flags can come from a file: --flagfile=train.flags.

  dapple_train --model_fn=my_net:model_fn --input_fn=my_net:input_fn --scope_depth=1 \
      --global_batch_size=32 --steps=100        # a Keras model, no markers
"""

import os

from absl import flags

from planner.formats.schedule import SCHEDULE_KINDS
from dapple_tf.model import user_model
from scripts.cli import run_main, split_cpu

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Reference model (mlp, vgg19, resnet50, bert, gnmt).")
flags.DEFINE_string("config", "tiny", "Reference model config: tiny or paper.")
flags.DEFINE_string("model_flags", "", "Reference model overrides, key=value,key=value.")
flags.DEFINE_string("model_fn", None, "A user's model: package.module:function(features, labels) -> loss.")
flags.DEFINE_string("input_fn", None, "A user's input: package.module:function(step, batch_size) -> "
                    "(features, labels), numpy arrays or tensors (dapple_tf/model/inputs.py).")
user_model.define_scope_flags()
flags.DEFINE_string("eval_input_fn", None, "Held-out input for --model_fn, same signature as --input_fn.")
flags.DEFINE_string("plan", None, "Plan file from dapple_plan (default: profile and plan here).")
flags.DEFINE_string("profile", None, "Profile file to plan from (default: profile the model here).")
flags.DEFINE_string("cluster", None, "Cluster to plan for (dapple_plan's --cluster; default: the devices this "
                    "runs on: --num_devices virtual CPUs, or the launched cluster's tasks).")
flags.DEFINE_integer("num_devices", 4, "Virtual CPU devices when running in one process (no TF_CONFIG).")
flags.DEFINE_integer("global_batch_size", None, "Samples per step, all processes together (default: the plan file's).")
flags.DEFINE_enum("backend", "tf", ["tf", "horovod"], "tf: this process or a TF cluster (TF_CONFIG); horovod: one "
                  "process of horovodrun, with a --plan from dapple_plan --backend=horovod.")
flags.DEFINE_enum("schedule", None, list(SCHEDULE_KINDS), "Pipeline schedule (default: the plan's, else dapple).")
flags.DEFINE_enum("batch_norm", "per_slice", ["per_slice", "sync"],
                  "Batch norm statistics in replicated stages: per replica's slice, or synchronized over the "
                  "stage's replicas (the whole micro-batch).")
flags.DEFINE_integer("steps", 100, "Train until the global step reaches this (a resumed run continues to it).")
flags.DEFINE_string("model_dir", None, "Checkpoints and TensorBoard summaries; resumes from its latest checkpoint.")
flags.DEFINE_integer("save_checkpoints_steps", 100, "Save a checkpoint every this many steps (0: off).")
flags.DEFINE_float("save_checkpoints_secs", 0, "Save a checkpoint every this many seconds (0: off).")
flags.DEFINE_integer("keep_checkpoints", 5, "Checkpoints kept.")
flags.DEFINE_integer("log_every", 10, "Progress line every this many steps.")
flags.DEFINE_integer("summary_every", 10, "Summaries (loss, samples/s, step time, peak memory) every this many steps.")
flags.DEFINE_integer("eval_every", 0, "Held-out loss through the single-device graph every this many steps (0: off).")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "momentum", "adam"], "Optimizer.")
flags.DEFINE_float("learning_rate", 0.01, "Learning rate.")
flags.DEFINE_integer("seed", 0, "Random seed (initial weights, synthetic data).")
flags.DEFINE_float("failure_timeout", 30, "On a cluster: a step or a task that does not answer ends training within "
                   "this (s); a task whose process is gone, within seconds.")
flags.DEFINE_string("trace", None, "Write the measured timeline of one step (--trace_step) to this Chrome trace "
                    "file, and a PNG beside it (above the simulated timeline when the plan comes with a profile).")
flags.DEFINE_integer("trace_step", 5, "With --trace: which step of this run to trace.")
flags.DEFINE_float("worker_wait_timeout", 60, "On a cluster: how long to wait for the workers to come up (s).")


def model_and_inputs(batch_size):
    """(model_fn, input_fn(step), eval_input_fn(step) or None, name) from the flags."""
    if FLAGS.model:
        import models

        spec = models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))
        return (spec.model_fn, spec.step_input_fn(batch_size, FLAGS.seed),
                spec.step_input_fn(batch_size, FLAGS.seed + 1), FLAGS.model)
    from dapple_tf.model import inputs

    model_fn = user_model.load_function(FLAGS.model_fn, "model_fn")
    user_input = user_model.load_function(FLAGS.input_fn, "input_fn")
    user_eval = user_model.load_function(FLAGS.eval_input_fn, "eval_input_fn") if FLAGS.eval_input_fn else None
    return (model_fn, lambda step: inputs.batch_tensors(user_input, step, batch_size),
            (lambda step: inputs.batch_tensors(user_eval, step, batch_size)) if user_eval else None, FLAGS.model_fn)


def profile_here(model_fn, input_fn, batch_size, name, layers=None):
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


def planner_cluster(devices):
    """The planner's cluster description for the devices training runs on (or --cluster)."""
    from planner.formats import cluster as clusters

    if FLAGS.cluster:
        return clusters.load_cluster(FLAGS.cluster, num_devices=FLAGS.num_devices)
    if devices is None:
        return clusters.local_cluster(FLAGS.num_devices)
    tasks = sorted({d.split("/device:")[0] for d in devices})
    per_task = [sum(d.startswith(t + "/device:GPU:") for d in devices) for t in tasks]
    if min(per_task):
        return clusters.make_cluster(f"tf-{len(tasks)}x{min(per_task)}", len(tasks), min(per_task),
                                     clusters.V100_MEMORY_BYTES, clusters.NVLINK_BANDWIDTH, clusters.ETHERNET_25G)
    cpus = min(sum(d.startswith(t + "/device:CPU:") for d in devices) for t in tasks)
    return clusters.local_task_cluster(len(tasks), cpus)


def make_plan(model_fn, input_fn, name, devices, batch_size, layers=None):
    """The plan (dapple_tf.Plan) from --plan, or from a profile and the DAPPLE planner, on the devices
    training runs on (`devices`, or this process's when None)."""
    import tensorflow as tf

    import dapple_tf
    from dapple_tf.cluster.servers import map_devices
    from dapple_tf.rewrite.replicas import canonical_device
    import profiler
    from planner.planning import api as planner_api
    from planner.planning.report import summarize
    from planner.formats import plan_pb2, read_message
    from planner.simulation.sim_adapter import simulate_plan

    simulated = None
    if FLAGS.plan:
        plan = dapple_tf.Plan.from_file(FLAGS.plan)
        if FLAGS.trace and FLAGS.profile:
            simulated = simulate_plan(read_message(FLAGS.plan, plan_pb2.Plan), profiler.read_profile(FLAGS.profile))
    else:
        cluster = planner_cluster(devices)
        if FLAGS.profile:
            profile = profiler.read_profile(FLAGS.profile)
        else:
            profile = profile_here(model_fn, input_fn, max(1, batch_size // len(cluster.device_names)), name, layers)
        proto = planner_api.plan(profile, cluster, batch_size, planner="dapple")
        print(summarize(proto), flush=True)
        simulated = simulate_plan(proto, profile) if FLAGS.trace else None
        plan = dapple_tf.Plan.from_proto(proto, source=f"the plan for {cluster.name}")
    if devices is None:  # this process's own devices
        devices = [canonical_device(d.name) for d in tf.config.list_logical_devices()]
    plan = plan.with_devices(canonical_device)  # build_pipeline's spelling, as map_devices compares names
    mapping = dict(zip(plan.devices, map_devices(plan.devices, devices)))
    return plan.with_devices(mapping.__getitem__), simulated


def optimizer():
    import tensorflow as tf

    v1 = tf.compat.v1.train
    return {"sgd": lambda: v1.GradientDescentOptimizer(FLAGS.learning_rate),
            "momentum": lambda: v1.MomentumOptimizer(FLAGS.learning_rate, 0.9),
            "adam": lambda: v1.AdamOptimizer(FLAGS.learning_rate)}[FLAGS.optimizer]()


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.steps < 1 or FLAGS.num_devices < 1:
        raise ValueError("--steps and --num_devices must be >= 1")
    if bool(FLAGS.model) == bool(FLAGS.model_fn):
        raise ValueError("give exactly one of --model (a reference model) or --model_fn (your own)")
    if FLAGS.model_fn and not FLAGS.input_fn:
        raise ValueError("--model_fn needs --input_fn (package.module:function(step, batch_size))")
    if not (FLAGS.global_batch_size or FLAGS.plan):
        raise ValueError("--global_batch_size is required (or a --plan file that says it)")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # CPU devices then report peak memory
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    cluster, devices, config, horovod = None, None, None, None
    if FLAGS.backend == "horovod":
        horovod = horovod_pipeline()
    if os.environ.get("TF_CONFIG") and not horovod:
        from dapple_tf.cluster.servers import TFCluster, cluster_devices, wait_for_workers

        cluster = TFCluster.from_tf_config()
        if cluster.task_type != "chief":
            raise ValueError(f"dapple_train runs as the chief; TF_CONFIG says this task is {cluster.task_type!r} "
                             "(workers run `dapple_launch --tf_config`)")
        print(f"waiting for {len(cluster.workers)} worker tasks: {', '.join(cluster.workers)}", flush=True)
        wait_for_workers(cluster, FLAGS.worker_wait_timeout)
        devices = cluster_devices(cluster, FLAGS.worker_wait_timeout)
        print(f"cluster devices: {', '.join(devices)}", flush=True)
    else:
        split_cpu(FLAGS.num_devices)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": FLAGS.num_devices})

    import dapple_tf
    from dapple_tf.frontends.trainer import Trainer, TrainerOptions

    batch_size = FLAGS.global_batch_size
    if not batch_size and FLAGS.plan:
        batch_size = dapple_tf.Plan.from_file(FLAGS.plan).global_batch_size * (horovod.size if horovod else 1)
    if not batch_size:
        raise ValueError("--global_batch_size is required (the plan file does not say it)")
    model_fn, input_fn, eval_input_fn, name = model_and_inputs(batch_size)
    layers = user_model.scope_layers(FLAGS.scope_depth, FLAGS.scope_patterns)
    simulated = None
    if horovod:
        plan, global_input_fn = horovod.plan, input_fn
        input_fn = lambda step: horovod.local_slice(global_input_fn(step))  # noqa: E731
    else:
        plan, simulated = make_plan(model_fn, input_fn, name, devices, batch_size, layers)
    options = TrainerOptions(
        save_checkpoints_steps=FLAGS.save_checkpoints_steps, save_checkpoints_secs=FLAGS.save_checkpoints_secs,
        keep_checkpoints=FLAGS.keep_checkpoints, log_every=FLAGS.log_every, summary_every=FLAGS.summary_every,
        eval_every=FLAGS.eval_every if eval_input_fn else 0, failure_timeout_s=FLAGS.failure_timeout,
        worker_wait_s=FLAGS.worker_wait_timeout, seed=FLAGS.seed, trace_step=FLAGS.trace_step,
        trace_path=FLAGS.trace if not horovod or horovod.rank == 0 else None)  # one rank traces
    lead = not horovod or horovod.rank == 0  # under Horovod, rank 0 checkpoints and logs
    trainer = Trainer(model_fn, input_fn, optimizer, plan, FLAGS.model_dir if lead else None, schedule=FLAGS.schedule,
                      eval_input_fn=eval_input_fn, cluster=cluster, options=options, config=config,
                      horovod=horovod, log=None if lead else (lambda text: None), batch_norm=FLAGS.batch_norm,
                      simulated=simulated, layers=layers)
    where = f"{len(cluster.workers)} worker tasks" if cluster else f"{FLAGS.num_devices} virtual CPU devices"
    if horovod:
        where = f"{horovod.size} Horovod processes x {where}"
    print(f"training {name}: {len(plan.stages)} stages "
          f"({':'.join(str(len(s.devices)) for s in plan.stages)} devices), M={plan.num_micro_batches}, "
          f"global batch {batch_size}, on {where}", flush=True)
    result = trainer.train(FLAGS.steps)
    if not lead:
        return 0
    print(f"done: step {result.step}, loss {result.loss:.6f}"
          + (f", resumed from step {result.first_step}" if result.first_step else "")
          + (f"; checkpoints in {FLAGS.model_dir}" if FLAGS.model_dir else ""), flush=True)
    return 0


def horovod_pipeline():
    """hvd.init() and the --plan checked against horovodrun's process count (a HorovodPipeline)."""
    if not FLAGS.plan:
        raise ValueError("--backend=horovod needs a --plan from dapple_plan --backend=horovod --num_processes=P "
                         "(every process must build the same graph)")
    if os.environ.get("TF_CONFIG"):
        raise ValueError("--backend=horovod runs under horovodrun, not on a TF_CONFIG cluster")
    import horovod.tensorflow as hvd

    from dapple_tf.frontends.horovod import HorovodPipeline

    hvd.init()
    return HorovodPipeline(FLAGS.plan)


def run():
    run_main(main)


if __name__ == "__main__":
    run()
