"""dapple_train: train a reference model with a DAPPLE plan (pipelined, data-parallel).

Example:
  dapple_train --model=mlp --plan=plan.json --steps=100
"""

import sys

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Reference model name (see models/).")
flags.DEFINE_string("plan", None, "Plan file written by dapple_plan.")
flags.DEFINE_enum("schedule", "dapple", ["dapple", "gpipe"], "Pipeline schedule.")
flags.DEFINE_integer("steps", 100, "Training steps.")
flags.DEFINE_string("model_dir", None, "Checkpoint directory.")


def main(argv):
    del argv
    print("dapple_train: not implemented yet; dapple_demo trains a model end to end (README.md)", file=sys.stderr)
    return 2


def run():
    run_main(main)


if __name__ == "__main__":
    run()
