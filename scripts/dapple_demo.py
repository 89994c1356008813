"""dapple_demo: the end-to-end demo on this machine's CPU: profile -> plan -> pipelined training.

1. splits the CPU into --num_devices virtual devices (ConfigProto device_count);
2. profiles the reference MLP (models/mlp.py, sized for scikit-learn's bundled 8x8 digits) layer by
   layer on /device:CPU:0;
3. plans it with the DAPPLE planner for the `local` cluster (or, with --num_stages=S, a forced S-stage
   plan: layers cut where the profiled compute is balanced, devices split evenly between stages);
4. builds the pipelined data-parallel training graph from the plan (dapple_tf.build_pipeline) and
   trains it on the digits training split, printing loss and throughput every --log_every steps;
5. prints the test accuracy of the trained weights;
6. on a machine with at least 2 cores (--speedup), measures a 2-stage pipeline on 2 worker processes,
   each pinned to its own core, against one such worker (scripts/bench/speedup.py, MLP 8 x 1024, batch
   1024, M=4), beside the simulator's prediction of both.

Example:
  dapple_demo                       # the planner's own plan
  dapple_demo --num_stages=2        # a forced two-stage pipeline
"""

import time

import numpy as np
from absl import flags

from scripts.cli import run_main, split_cpu

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_devices", 4, "Virtual CPU devices to split this machine into.")
flags.DEFINE_integer("num_stages", 0, "Force this many pipeline stages (0: the planner decides).")
flags.DEFINE_integer("steps", 300, "Training steps.")
flags.DEFINE_integer("global_batch_size", 64, "Samples per training step.")
flags.DEFINE_integer("num_micro_batches", 4, "Micro-batches per step for a forced --num_stages plan.")
flags.DEFINE_float("learning_rate", 0.01, "Adam learning rate.")
flags.DEFINE_integer("log_every", 50, "Print loss and throughput every this many steps.")
flags.DEFINE_enum("schedule", "dapple", ["dapple", "gpipe"], "Pipeline schedule.")
flags.DEFINE_integer("seed", 0, "Random seed (data split, batches, initial weights).")
flags.DEFINE_boolean("speedup", True, "End with the measured speedup of a 2-worker pipeline over one worker "
                     "(needs 2 cores).")


def load_digits(seed):
    """scikit-learn's bundled digits (offline): (x_train, y_train, x_test, y_test), 80/20 split."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def forced_plan(profile, num_stages, devices, num_micro_batches):
    """An S-stage dapple_tf.Plan: cuts balancing profiled forward+backward time, devices split evenly."""
    import dapple_tf
    from planner.planning.baselines import balanced_partition

    n = len(profile.layers)
    if not 1 <= num_stages <= min(n, len(devices)):
        raise ValueError(f"--num_stages must be between 1 and {min(n, len(devices))} "
                         f"(layers: {n}, devices: {len(devices)}), got {num_stages}")
    costs = [layer.forward_ms + layer.backward_ms + 1e-6 for layer in profile.layers]
    cuts = sorted(balanced_partition(costs, list(range(1, n)), num_stages))
    for c in range(1, n):  # balanced_partition may use fewer blocks: add cuts until there are S
        if len(cuts) + 1 >= num_stages:
            break
        if c not in cuts:
            cuts = sorted(cuts + [c])
    bounds = [0] + cuts + [n]
    per = len(devices) // num_stages
    stages = [(bounds[i], bounds[i + 1] - 1, devices[i * per:(i + 1) * per]) for i in range(num_stages)]
    return dapple_tf.Plan.from_stages(stages, num_micro_batches=num_micro_batches), stages


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.num_devices < 1 or FLAGS.steps < 1 or FLAGS.global_batch_size < 1 or FLAGS.num_stages < 0:
        raise ValueError("--num_devices, --steps and --global_batch_size must be >= 1, --num_stages >= 0")
    if FLAGS.num_stages > FLAGS.num_devices:
        raise ValueError(f"--num_stages={FLAGS.num_stages} needs at least that many devices "
                         f"(--num_devices={FLAGS.num_devices})")
    start = time.time()
    import tensorflow as tf

    # virtual CPU devices for the whole process (before TF initialises its devices)
    split_cpu(FLAGS.num_devices)

    import dapple_tf
    import models
    import profiler
    from planner.planning import api as planner_api
    from planner.formats.cluster import local_cluster
    from planner.planning.report import summarize

    x_train, y_train, x_test, y_test = load_digits(FLAGS.seed)
    print(f"data: scikit-learn digits, {len(x_train)} training and {len(x_test)} test images of 8x8 = 64 pixels")
    spec = models.get_model("mlp", "tiny")
    devices = [f"/device:CPU:{i}" for i in range(FLAGS.num_devices)]

    # 1. profile
    profile_batch = max(1, FLAGS.global_batch_size // max(1, FLAGS.num_micro_batches))
    profile = profiler.profile_spec(spec, profile_batch, "/device:CPU:0", warmup=2, runs=5, model_name="mlp-digits")
    print(f"\n== profile (batch {profile_batch}, /device:CPU:0) ==")
    for layer in profile.layers:
        print(f"  {layer.name:8s} forward {layer.forward_ms:.3f} ms  backward {layer.backward_ms:.3f} ms  "
              f"activations {layer.activation_bytes:.0f} B  parameters {layer.parameter_bytes:.0f} B")

    # 2. plan
    print("\n== plan ==")
    if FLAGS.num_stages:
        plan, stages = forced_plan(profile, FLAGS.num_stages, devices, FLAGS.num_micro_batches)
        print(f"forced {FLAGS.num_stages}-stage plan (--num_stages), M = {FLAGS.num_micro_batches} micro-batches:")
        for i, (first, last, devs) in enumerate(stages):
            print(f"  stage {i}: layers {first}-{last} ({profile.layers[first].name}..{profile.layers[last].name}),"
                  f" devices {', '.join(devs)}")
    else:
        plan_proto = planner_api.plan(profile, local_cluster(FLAGS.num_devices), FLAGS.global_batch_size,
                                      planner="dapple")
        print(summarize(plan_proto))
        plan = dapple_tf.Plan.from_proto(plan_proto)

    # 3. build the pipelined training graph
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(FLAGS.seed)
        features = tf.compat.v1.placeholder(tf.float32, [FLAGS.global_batch_size, 64], name="features")
        labels = tf.compat.v1.placeholder(tf.int32, [FLAGS.global_batch_size], name="labels")
        optimizer = tf.compat.v1.train.AdamOptimizer(FLAGS.learning_rate)
        handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, optimizer, plan,
                                          dapple_tf.PipelineOptions(schedule=FLAGS.schedule))
        test_x = tf.constant(x_test)
        with tf.compat.v1.variable_scope("", reuse=True), dapple_tf.LayerRecorder(graph).activate():
            predictions = tf.argmax(spec.predict_fn(test_x), axis=1, output_type=tf.int32)
    print(f"\n== schedule (micro-batch size {handle.micro_batch_size}) ==")
    print(handle.schedule)

    # 4. train
    print(f"\n== training: {FLAGS.steps} steps of {FLAGS.global_batch_size} samples on {FLAGS.num_devices} "
          "virtual CPU devices ==")
    config = tf.compat.v1.ConfigProto(device_count={"CPU": FLAGS.num_devices}, allow_soft_placement=False)
    rng = np.random.default_rng(FLAGS.seed)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(handle.initializer)
        losses, interval_start = [], time.time()
        for step in range(1, FLAGS.steps + 1):
            idx = rng.choice(len(x_train), FLAGS.global_batch_size, replace=False)
            _, loss = sess.run([handle.train_op, handle.loss], {features: x_train[idx], labels: y_train[idx]})
            losses.append(loss)
            if step % FLAGS.log_every == 0 or step == FLAGS.steps:
                elapsed = time.time() - interval_start
                print(f"step {step:4d}  loss {np.mean(losses):.4f}  "
                      f"{len(losses) * FLAGS.global_batch_size / elapsed:8.0f} samples/s", flush=True)
                losses, interval_start = [], time.time()
        accuracy = float(np.mean(sess.run(predictions) == y_test))
    print(f"\ntest accuracy: {accuracy:.4f} ({len(y_test)} images); total time {time.time() - start:.1f} s")
    if FLAGS.speedup:
        speedup_section()
    return 0


def speedup_section() -> None:
    """Step 6 of the module docstring, or why it is skipped."""
    import os
    import subprocess
    import sys

    from dapple_tf.cluster.servers import usable_cores

    cores = len(usable_cores())
    if cores < 2:
        print(f"\n(speedup over one worker skipped: this machine has {cores} core; it needs 2 pinned workers)")
        return
    print("\n== speedup: 2 pinned worker processes (1 core each) vs one, measured and simulated ==", flush=True)
    command = [sys.executable, "-m", "scripts.bench.speedup", "--num_workers=2", "--micro_batches=4",
               "--plans=single,straight2-M4", "--gpipe=false", "--steps=5"]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if not line.startswith(("profile at", "dapple_launch:"))]
    print("\n".join(lines), flush=True)
    if done.returncode:
        print(f"(the speedup benchmark failed: {done.stderr.strip().splitlines()[-1:]})")


def run():
    run_main(main)


if __name__ == "__main__":
    run()
