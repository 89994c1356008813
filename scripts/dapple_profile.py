"""dapple_profile: measure a reference model layer by layer and write its layer cost profile.

Example:
  dapple_profile --model=mlp --batch_size=32 --device=/device:CPU:0 --output=mlp-pbs-32.pbtxt
  dapple_profile --model=vgg19 --config=tiny --model_flags=width_div=8 --output=vgg-pbs-32.txt

The output format follows the extension: .pb/.pbtxt/.json (protobuf) or .txt (PipeDream text, whose
file name must carry the batch size as `-pbs-N`). Progress (one line per layer) goes to stderr.
"""

import sys
import time

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Reference model name (see models/): mlp, vgg19, resnet50, bert, gnmt.")
flags.DEFINE_enum("config", "tiny", ["tiny", "paper"], "Model size: tiny (tests) or paper (the paper's sizes).")
flags.DEFINE_string("model_flags", "", "Config overrides, key=value,... (lists as a:b:c), e.g. hidden=128:128.")
flags.DEFINE_integer("batch_size", 32, "Profile batch size.")
flags.DEFINE_string("device", "/device:CPU:0", "Device to profile on (CPU:k splits the CPU into k+1 devices).")
flags.DEFINE_string("output", None, "Profile path: .pb/.pbtxt/.json (protobuf) or .txt (PipeDream format).")
flags.DEFINE_integer("warmup", 2, "Untimed runs before timing each layer.")
flags.DEFINE_integer("runs", 5, "Timed runs per layer (the median is kept).")
flags.DEFINE_enum("clock", "wall", ["wall", "cpu"], "wall: elapsed time; cpu: process CPU time (shared machines).")
flags.DEFINE_integer("threads", 0, "TF intra/inter-op threads (0: TF's default).")
flags.DEFINE_bool("profile_memory", False,
                  "Also measure one training step's peak memory with TF's allocator statistics (step_peak_bytes; "
                  "the BFC allocator is used on CPU). Per-layer kept-for-backward bytes are always recorded.")


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.model:
        raise ValueError("--model is required (mlp, vgg19, resnet50, bert, gnmt)")
    if not FLAGS.output:
        raise ValueError("--output is required (.pb, .pbtxt, .json or .txt)")
    if FLAGS.batch_size < 1 or FLAGS.runs < 1 or FLAGS.warmup < 0:
        raise ValueError("--batch_size and --runs must be >= 1 and --warmup >= 0")
    if FLAGS.profile_memory:
        import os  # pylint: disable=import-outside-toplevel

        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # read when TensorFlow starts, below
    import models
    import profiler
    from profiler.io import check_writable

    spec = models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))
    check_writable(FLAGS.output, FLAGS.batch_size)  # fail before spending minutes profiling

    start = time.time()
    print(f"profiling {FLAGS.model} ({FLAGS.config}) at batch {FLAGS.batch_size} on {FLAGS.device}: "
          f"{FLAGS.warmup} warm-up + median of {FLAGS.runs} runs per layer", file=sys.stderr, flush=True)

    def progress(i, n, layer):
        print(f"[{i}/{n}] {layer.name}: forward {layer.forward_ms:.3f} ms, backward {layer.backward_ms:.3f} ms, "
              f"activations {layer.activation_bytes:.0f} B, parameters {layer.parameter_bytes:.0f} B",
              file=sys.stderr, flush=True)

    profile = profiler.profile_spec(spec, FLAGS.batch_size, FLAGS.device, warmup=FLAGS.warmup, runs=FLAGS.runs,
                                    clock=FLAGS.clock, threads=FLAGS.threads, progress=progress,
                                    step_memory=FLAGS.profile_memory,
                                    model_name=f"{FLAGS.model}-{FLAGS.config}")
    profiler.write_profile(profile, FLAGS.output)
    total = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)
    print(f"wrote {FLAGS.output}: {len(profile.layers)} layers, forward+backward {total:.2f} ms per batch of "
          f"{FLAGS.batch_size} ({time.time() - start:.1f} s)")
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()
