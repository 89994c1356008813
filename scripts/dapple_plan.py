"""dapple_plan: choose a DAPPLE parallelization plan for a profiled model on a cluster.

Example:
  dapple_plan --profile=../shared/profiles/vgg-19-pbs-32.txt --global_batch_size=2048
      --cluster=paper_c --output=plan.json
"""

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("profile", None, "Layer cost profile (.pb/.pbtxt/.json) or PipeDream text profile (.txt).")
flags.DEFINE_integer("global_batch_size", None, "Global batch size of one training iteration.")
flags.DEFINE_string("cluster", "paper_a", "paper_a | paper_b | paper_c | local | a cluster file (.pbtxt/.json).")
flags.DEFINE_integer("num_servers", None, "Servers in a paper_* cluster (default: 16 devices in all).")
flags.DEFINE_string("planner", "dapple", "dapple | dp | dp_overlap | straight | gpipe | pipedream | all")
flags.DEFINE_string("output", None, "Where to write the plan (.pb/.pbtxt/.json).")


def main(argv):
    del argv
    raise NotImplementedError("dapple_plan: the planner is not implemented yet (issue 4)")


def run():
    run_main(main)


if __name__ == "__main__":
    run()
