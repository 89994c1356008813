"""dapple_demo: the end-to-end demo (profile -> plan -> pipelined training) on this machine's CPU.

As far as the pipeline exists at each commit; see README.md.
"""

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_devices", 4, "Virtual CPU devices to split this machine into.")
flags.DEFINE_integer("num_stages", 0, "Force this many pipeline stages (0: the planner decides).")
flags.DEFINE_integer("steps", 300, "Training steps.")


def main(argv):
    del argv
    from planner.schedule import build_schedule

    print("dapple_demo: the profiler, planner and runtime are not wired up yet; the schedule they will run:")
    print(build_schedule(FLAGS.num_stages or 2, 4, "dapple"))
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()
