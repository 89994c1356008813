"""dapple_launch: write cluster job specs (TF_CONFIG, Kubernetes, Slurm) for a dapple_train run.

Example:
  dapple_launch --plan=plan.json --format=tf_config --workers=host1:2222,host2:2222
"""

import sys

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("plan", None, "Plan file written by dapple_plan.")
flags.DEFINE_enum("format", "tf_config", ["tf_config", "kubernetes", "slurm"], "What to write.")
flags.DEFINE_list("workers", [], "host:port of every worker, in task order.")
flags.DEFINE_string("output", None, "Where to write the spec (stdout if unset).")


def main(argv):
    del argv
    print("dapple_launch: writing cluster job specs is not implemented yet; see README.md", file=sys.stderr)
    return 2


def run():
    run_main(main)


if __name__ == "__main__":
    run()
