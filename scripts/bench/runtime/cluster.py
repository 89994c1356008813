"""Cluster overhead: the same model and plan in one process (virtual devices) vs over a local gRPC cluster.

Run directly, it launches itself as the chief of a local cluster (`dapple_launch --cluster=local:3x2`);
the chief measures each plan twice, on its own 6 virtual CPU devices and on the workers' 6 devices
(device i = task i // 2, CPU i % 2), and prints samples/s side by side with the overhead per step.
All processes share this machine's cores, so the difference is what serialization, gRPC and the
distributed executor cost, not network bandwidth.

    python -m scripts.bench.runtime.cluster                      # the table
    python -m scripts.bench.runtime.cluster --hidden=512 --steps=30
"""

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("hidden", 256, "Width of the MLP's 4 hidden layers.")
flags.DEFINE_integer("global_batch_size", 96, "Samples per step.")
flags.DEFINE_integer("num_micro_batches", 4, "M for the pipelined plans.")
flags.DEFINE_integer("steps", 20, "Timed steps per measurement (after 3 warm-up steps); the median is kept.")
flags.DEFINE_boolean("as_chief", False, "Internal: run as the chief under dapple_launch.")

TASKS, DEVICES_PER_TASK = 3, 2
# name -> [(first layer, last layer, device indices)]; MLP layers: dense_0..dense_3, head
PLANS = {
    "2:1:3, M=4": [(0, 1, [0, 1]), (2, 3, [2]), (4, 4, [3, 4, 5])],
    "straight 3 stages, M=4": [(0, 1, [0]), (2, 3, [2]), (4, 4, [4])],
    "data parallel on 6": [(0, 4, [0, 1, 2, 3, 4, 5])],
}


def measure(stages, device_name, target, config):
    import tensorflow as tf

    import dapple_tf
    from profiler.timing import median_run_ms

    spec = harness.mlp_spec(FLAGS.hidden)
    m = 1 if len(stages) == 1 else FLAGS.num_micro_batches
    plan = dapple_tf.Plan.from_stages([(a, b, [device_name(i) for i in ids]) for a, b, ids in stages], m)
    with tf.Graph().as_default():
        features, labels = harness.synthetic_batch(spec, FLAGS.global_batch_size)
        handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, harness.optimizer(), plan)
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run(handle.initializer)
            return median_run_ms(sess, handle.train_op, warmup=3, runs=FLAGS.steps) / 1e3


def chief():
    local_config = harness.virtual_cpus(TASKS * DEVICES_PER_TASK)
    from dapple_tf.cluster.servers import TFCluster, session_config, wait_for_workers

    cluster = TFCluster.from_tf_config()
    wait_for_workers(cluster, 120)
    batch = FLAGS.global_batch_size
    print(f"MLP 4 x {FLAGS.hidden}, global batch {batch}; one process (6 virtual CPU devices) vs "
          f"local:{TASKS}x{DEVICES_PER_TASK} gRPC cluster; median of {FLAGS.steps} steps")
    print(f"{'plan':24s} {'1 process samples/s':>20s} {'cluster samples/s':>18s} {'cluster/1 process':>18s} "
          f"{'overhead ms/step':>17s}")
    progress = harness.Progress(len(PLANS), "plans")
    for name, stages in PLANS.items():
        local = measure(stages, lambda i: f"/device:CPU:{i}", "", local_config)
        remote = measure(stages, lambda i: cluster.device(i // DEVICES_PER_TASK, "CPU", i % DEVICES_PER_TASK),
                         cluster.target, session_config(120))
        print(f"{name:24s} {batch / local:20.0f} {batch / remote:18.0f} {local / remote:18.2f} "
              f"{(remote - local) * 1e3:17.1f}", flush=True)
        progress.advance()
    return 0


def main(argv):
    reject_arguments(argv)
    if FLAGS.as_chief:
        return chief()
    chief_command = harness.module_command(
        "scripts.bench.runtime.cluster", f"--hidden={FLAGS.hidden}", f"--global_batch_size={FLAGS.global_batch_size}",
        f"--num_micro_batches={FLAGS.num_micro_batches}", f"--steps={FLAGS.steps}", "--as_chief")
    code, _ = harness.stream_command(harness.launch_command(f"local:{TASKS}x{DEVICES_PER_TASK}", chief_command),
                                     lambda line: line[len("[chief] "):] if line.startswith("[chief] ") else None)
    return code


def run():
    run_main(main)


if __name__ == "__main__":
    run()
