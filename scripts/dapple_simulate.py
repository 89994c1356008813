"""dapple_simulate: simulate a plan's pipeline schedule and draw it (Chrome trace, PNG Gantt chart).

Example:
  dapple_simulate --profile=../shared/profiles/bert-48-pbs-2.txt --cluster=paper_b
      --global_batch_size=64 --planner=dapple --schedule=dapple --png=bert.png
"""

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("profile", None, "Layer cost profile or PipeDream text profile.")
flags.DEFINE_string("cluster", "paper_a", "paper_a | paper_b | paper_c | local | a cluster file.")
flags.DEFINE_integer("global_batch_size", None, "Global batch size.")
flags.DEFINE_string("plan", None, "A plan file to simulate (instead of --planner).")
flags.DEFINE_string("planner", "dapple", "Planner to run when no --plan is given.")
flags.DEFINE_enum("schedule", "dapple", ["dapple", "gpipe"], "Schedule to simulate.")
flags.DEFINE_enum("policy", "A", ["A", "B"], "DAPPLE warm-up policy.")
flags.DEFINE_string("trace", None, "Write a Chrome-trace JSON here.")
flags.DEFINE_string("png", None, "Write a PNG Gantt chart here.")


def main(argv):
    del argv
    raise NotImplementedError("dapple_simulate: the simulator is not implemented yet (issue 5)")


def run():
    run_main(main)


if __name__ == "__main__":
    run()
