"""dapple_demo: the end-to-end demo on this machine's CPU: profile -> plan -> pipelined training.

1. splits the CPU into --num_devices virtual devices (ConfigProto device_count);
2. profiles the reference MLP (models/mlp.py, sized for scikit-learn's bundled 8x8 digits) layer by
   layer on /device:CPU:0;
3. plans it with the DAPPLE planner for the `local` cluster (or, with --num_stages=S, a forced S-stage
   plan: layers cut where the profiled compute is balanced, devices split evenly between stages);
4. builds the pipelined data-parallel training graph from the plan (dapple_tf.build_pipeline) and
   trains it on the digits training split, printing loss and throughput every --log_every steps;
5. prints the test accuracy of the trained weights;
6. on a machine with at least 2 cores (--speedup), measures on 2 worker processes, each pinned to its own
   core, the plan the planner chooses for them and 2-stage pipelines at M=2 and M=4, against one such worker
   (scripts/bench/speed/speedup.py, MLP 8 x 1024, batch 1024; one profiling, the plans timed side by side), beside the
   simulator's prediction of each; then the planner's ties as a short table and one sentence: which plan won, by
   how much and, where a pipeline lost, why (its bubble and the measured per-sample cost of its slices).

Example:
  dapple_demo                       # the planner's own plan
  dapple_demo --num_stages=2        # a forced two-stage pipeline
"""

import dataclasses
import time

from absl import flags

from scripts.cli import quiet_tensorflow, reject_arguments, run_main, split_cpu

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
flags.DEFINE_boolean("speedup", True, "End with the measured speedup over one worker of the planner's choice for "
                     "2 workers and of 2-stage pipelines, and which won and why (needs 2 cores).")



def main(argv):
    reject_arguments(argv)
    if FLAGS.num_devices < 1 or FLAGS.steps < 1 or FLAGS.global_batch_size < 1 or FLAGS.num_stages < 0:
        raise ValueError("--num_devices, --steps and --global_batch_size must be >= 1, --num_stages >= 0")
    if FLAGS.num_stages > FLAGS.num_devices:
        raise ValueError(f"--num_stages={FLAGS.num_stages} needs at least that many devices "
                         f"(--num_devices={FLAGS.num_devices})")
    start = time.perf_counter()
    quiet_tensorflow()
    split_cpu(FLAGS.num_devices)  # virtual CPU devices for the whole process (before TF initialises its devices)
    from scripts.workflows import demo

    names = [field.name for field in dataclasses.fields(demo.DemoSettings)]
    return demo.run_demo(demo.DemoSettings(**{name: FLAGS[name].value for name in names}), start)


def run():
    run_main(main)


if __name__ == "__main__":
    run()
