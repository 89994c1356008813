"""dapple_profile: measure a reference model layer by layer and write its layer cost profile.

Example:
  dapple_profile --model=mlp --batch_size=32 --device=/device:CPU:0 --output=mlp.pbtxt
"""

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Reference model name (see models/).")
flags.DEFINE_integer("batch_size", 32, "Profile batch size.")
flags.DEFINE_string("device", "/device:CPU:0", "Device to profile on.")
flags.DEFINE_string("output", None, "Profile path: .pb/.pbtxt/.json (protobuf) or .txt (PipeDream format).")


def main(argv):
    del argv
    raise NotImplementedError("dapple_profile: the profiler is not implemented yet (issue 6)")


def run():
    run_main(main)


if __name__ == "__main__":
    run()
