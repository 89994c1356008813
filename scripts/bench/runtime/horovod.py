"""Horovod backend vs a local gRPC cluster vs one process: samples/s on the same model and devices.

The same MLP (4 x --hidden, then a head) and global batch, 2 stages x 2 replicas on 4 virtual CPU
devices in all, M=4, median step time after 3 warm-up steps:
- one process with 4 virtual devices (stage 0 on CPU:0,1; stage 1 on CPU:2,3);
- horovodrun -np 2 --gloo: each process 2 virtual devices (stage 0 on CPU:0, stage 1 on CPU:1) on half
  the batch, gradients averaged by Horovod (dapple_tf.frontends.horovod);
- dapple_launch --cluster=local:2x2: one client, stage 0 on (task 0, task 1) CPU:0, stage 1 on CPU:1.
All processes share this machine's cores: the differences are runtime overheads, not bandwidth.

    python -m scripts.bench.runtime.horovod                 # the table
    python -m scripts.bench.runtime.horovod --hidden=512 --steps=30
"""

import os
import sys

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("hidden", 256, "Width of the MLP's 4 hidden layers.")
flags.DEFINE_integer("global_batch_size", 96, "Samples per step, all processes together.")
flags.DEFINE_integer("steps", 20, "Timed steps (after 3 warm-up steps); the median is kept.")
flags.DEFINE_enum("role", None, ["single", "horovod", "grpc"], "Internal: run one measurement.")

M = 4
STAGES = [(0, 1), (2, 4)]  # MLP layers dense_0..dense_3, head


def measure(role):
    """Median step seconds of this role (rank 0 / the chief reports)."""
    import tensorflow as tf

    import dapple_tf
    from profiler.timing import median_run_ms

    spec = harness.mlp_spec(FLAGS.hidden)
    optimizer = harness.optimizer()
    after_init = []
    with tf.Graph().as_default():
        features, labels = harness.synthetic_batch(spec, FLAGS.global_batch_size)
        target = ""
        if role == "single":
            config = harness.virtual_cpus(4)
            plan = harness.cpu_plan([(a, b, [2 * i, 2 * i + 1]) for i, (a, b) in enumerate(STAGES)], M)
            handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, optimizer, plan)
        elif role == "grpc":
            from dapple_tf.cluster.servers import TFCluster, session_config, wait_for_workers

            cluster = TFCluster.from_tf_config()
            wait_for_workers(cluster, 120)
            config, target = session_config(120), cluster.target
            plan = dapple_tf.Plan.from_stages([(a, b, [cluster.device(t, "CPU", i) for t in range(2)])
                                               for i, (a, b) in enumerate(STAGES)], M)
            handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, optimizer, plan)
        else:
            config = harness.virtual_cpus(2)
            import horovod.tensorflow as hvd

            from dapple_tf.frontends.horovod import HorovodPipeline
            from planner.formats import cluster as clusters
            from planner.planning.horovod_plan import per_process_plan
            from planner.formats import plan_pb2

            hvd.init()
            proto = plan_pb2.Plan(cluster=clusters.local_cluster(2), num_micro_batches=M)
            for i, (a, b) in enumerate(STAGES):
                proto.stages.add(first_layer=a, last_layer=b, device_ids=[i])
            pipeline = HorovodPipeline(per_process_plan(proto, hvd.size()))
            local_features, local_labels = pipeline.local_slice((features, labels))
            handle = pipeline.build(spec.model_fn, local_features, local_labels, optimizer)
            after_init = [hvd.broadcast_global_variables(0), handle.broadcast_op]  # rank 0's weights, then copies
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run(handle.initializer)
            for op in after_init:
                sess.run(op)
            return median_run_ms(sess, handle.train_op, warmup=3, runs=FLAGS.steps) / 1e3


def _run(command):
    _, lines = harness.stream_command(command, lambda line: None)
    for line in lines:
        if "STEP_S " in line:
            return float(line.split("STEP_S ")[1])
    raise RuntimeError(f"{' '.join(command[:6])} ... failed:\n{''.join(lines)[-3000:]}")


def main(argv):
    reject_arguments(argv)
    if FLAGS.role:
        step_s = measure(FLAGS.role)
        if FLAGS.role != "horovod" or os.environ.get("HOROVOD_RANK", "0") == "0":
            print(f"STEP_S {step_s}", flush=True)
        return 0
    me = harness.module_command("scripts.bench.runtime.horovod", f"--hidden={FLAGS.hidden}",
                                f"--global_batch_size={FLAGS.global_batch_size}", f"--steps={FLAGS.steps}")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    runs = {
        "one process, 4 devices": me + ["--role=single"],
        "horovodrun -np 2 x 2 devices": [horovodrun, "-np", "2", "--gloo", "-H", "localhost:2"] + me + ["--role=horovod"],
        "gRPC local:2x2": harness.launch_command("local:2x2", me + ["--role=grpc"]),
    }
    batch = FLAGS.global_batch_size
    print(f"MLP 4 x {FLAGS.hidden}, global batch {batch}, 2 stages x 2 replicas, M={M}; median of {FLAGS.steps} steps")
    print(f"{'runtime':30s} {'samples/s':>10s} {'vs one process':>15s}")
    base, progress = None, harness.Progress(len(runs), "runtimes")
    for name, command in runs.items():
        step_s = _run(command)
        base = base or step_s
        print(f"{name:30s} {batch / step_s:10.0f} {base / step_s:15.2f}", flush=True)
        progress.advance()
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()
