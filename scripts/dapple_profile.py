"""dapple_profile: measure a model layer by layer and write its layer cost profile.

Example:
  dapple_profile --model=mlp --batch_size=32 --device=/device:CPU:0 --output=mlp-pbs-32.pbtxt
  dapple_profile --model=mlp --batch_sizes=128,1024 --output=mlp-pbs-{batch_size}.pbtxt   # side by side
  dapple_profile --model=vgg19 --config=tiny --model_flags=width_div=8 --output=vgg-pbs-32.txt
  dapple_profile --model_fn=my_pkg.nets:model_fn --input_fn=my_pkg.nets:input_fn --output=mine.txt
  dapple_profile --model_fn=my_pkg.nets:model_fn --features=float32:32,32,3 --labels=int32::10 \
      --scope_depth=2 --output=mine.txt          # layers = the model's name scopes (no markers)

The output format follows the extension: .pb/.pbtxt/.json (protobuf) or .txt (PipeDream text, with the
model name and batch size in `#` header lines). Times are medians over interleaved rounds (profiler/rounds.py):
each round measures every layer of every batch size once, so several sizes profiled together (--batch_sizes)
are measured side by side, and each profile records how far its whole step moved over the rounds (its spread).
Progress (a line per round, then one per layer) goes to stderr, and a last `warning:` line there when a spread is
above 20% (a busy machine; profiler/rounds.py noise_warning).
"""

import sys
import time

from absl import flags

from scripts.cli import quiet_tensorflow, reject_arguments, run_main

quiet_tensorflow()
from dapple_tf.model import user_model  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Reference model name (see models/): mlp, vgg19, resnet50, bert, gnmt.")
flags.DEFINE_string("model_fn", None, "Your own model instead: package.module:function (model_fn(features, labels)).")
flags.DEFINE_string("input_fn", None, "With --model_fn: package.module:function, input_fn(step, batch_size) -> "
                    "(features, labels), numpy arrays or tensors (dapple_tf/model/inputs.py; input_fn(batch_size) also works).")
flags.DEFINE_string("features", None, "With --model_fn, instead of --input_fn: DTYPE:SHAPE of one sample, e.g. float32:32,32,3.")
flags.DEFINE_string("labels", None, "With --model_fn, instead of --input_fn: DTYPE:SHAPE[:MAX], e.g. int32::10.")
user_model.define_scope_flags()
flags.DEFINE_string("model_name", None, "Model name in the profile (default: the model's).")
flags.DEFINE_enum("config", "tiny", ["tiny", "paper"], "Model size: tiny (tests) or paper (the paper's sizes).")
flags.DEFINE_string("model_flags", "", "Config overrides, key=value,... (lists as a:b:c), e.g. hidden=128:128.")
flags.DEFINE_integer("batch_size", 32, "Profile batch size.")
flags.DEFINE_list("batch_sizes", None, "Several profile batch sizes, measured side by side in the same rounds; "
                  "--output then names each file with {batch_size}.")
flags.DEFINE_string("device", "/device:CPU:0", "Device to profile on (CPU:k splits the CPU into k+1 devices).")
flags.DEFINE_string("output", None, "Profile path: .pb/.pbtxt/.json (protobuf) or .txt (PipeDream format).")
flags.DEFINE_integer("warmup", 1, "Untimed runs before each measurement in a round.")
flags.DEFINE_integer("runs", 2, "Timed runs per measurement in a round (their median, less a no-op's).")
flags.DEFINE_integer("rounds", 5, "Rounds, each measuring every layer of every batch size once in turn (times are "
                     "the medians over the rounds).")
flags.DEFINE_enum("clock", "wall", ["wall", "cpu"], "wall: elapsed time; cpu: process CPU time (shared machines).")
flags.DEFINE_integer("threads", 0, "TF intra/inter-op threads (0: TF's default).")
flags.DEFINE_bool("profile_memory", False,
                  "Also measure one training step's peak memory with TF's allocator statistics (step_peak_bytes; "
                  "the BFC allocator is used on CPU). Per-layer kept-for-backward bytes are always recorded.")


def _sizes() -> list:
    if not FLAGS.batch_sizes:
        return [FLAGS.batch_size]
    if FLAGS["batch_size"].present:
        raise ValueError("give --batch_size or --batch_sizes, not both")
    try:
        sizes = sorted({int(b) for b in FLAGS.batch_sizes})
    except ValueError:
        raise ValueError(f"--batch_sizes must be integers, got {','.join(FLAGS.batch_sizes)}") from None
    if "{batch_size}" not in FLAGS.output:
        raise ValueError("with --batch_sizes, --output must contain {batch_size} (one file per size), e.g. "
                         "mlp-pbs-{batch_size}.pbtxt")
    return sizes


def _output(size: int) -> str:
    return FLAGS.output.replace("{batch_size}", str(size))


def main(argv):
    reject_arguments(argv)
    if bool(FLAGS.model) == bool(FLAGS.model_fn):
        raise ValueError("give --model (mlp, vgg19, resnet50, bert, gnmt) or --model_fn=package.module:function")
    if not FLAGS.output:
        raise ValueError("--output is required (.pb, .pbtxt, .json or .txt)")
    sizes = _sizes()
    if min(sizes) < 1 or FLAGS.runs < 1 or FLAGS.rounds < 1 or FLAGS.warmup < 0:
        raise ValueError("--batch_size, --runs and --rounds must be >= 1 and --warmup >= 0")
    if FLAGS.profile_memory:
        import os  # pylint: disable=import-outside-toplevel

        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # read when TensorFlow starts, below
    import models
    import profiler
    from profiler.io import check_writable
    from profiler.rounds import noise_warning

    layers = user_model.scope_layers(FLAGS.scope_depth, FLAGS.scope_patterns)
    if FLAGS.model_fn:
        model_fn = user_model.load_function(FLAGS.model_fn, "model_fn")
        input_fn = user_model.load_function(FLAGS.input_fn, "input_fn") if FLAGS.input_fn else None
        values = {size: user_model.input_values(size, input_fn, FLAGS.features, FLAGS.labels) for size in sizes}
        model_name = FLAGS.model_name or FLAGS.model_fn.rpartition(":")[2]
    else:
        spec = models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))
        model_name = FLAGS.model_name or f"{FLAGS.model}-{FLAGS.config}"
    for size in sizes:
        check_writable(_output(size), size)  # fail before spending minutes profiling

    start = time.perf_counter()
    batches = ", ".join(str(b) for b in sizes)
    print(f"profiling {model_name} at batch {batches} on {FLAGS.device}: {FLAGS.rounds} rounds of {FLAGS.warmup} "
          f"warm-up + median of {FLAGS.runs} runs per layer", file=sys.stderr, flush=True)

    def progress(i, n, layer):
        print(f"[{i}/{n}] {layer.name}: forward {layer.forward_ms:.3f} ms, backward {layer.backward_ms:.3f} ms, "
              f"activations {layer.activation_bytes:.0f} B, parameters {layer.parameter_bytes:.0f} B",
              file=sys.stderr, flush=True)

    def round_progress(r, rounds, steps):
        step_text = ", ".join(f"batch {b} {ms:.2f} ms" for b, ms in steps.items())
        print(f"round {r}/{rounds}: whole step {step_text}", file=sys.stderr, flush=True)

    options = dict(warmup=FLAGS.warmup, runs=FLAGS.runs, rounds=FLAGS.rounds, clock=FLAGS.clock,
                   threads=FLAGS.threads, progress=progress, round_progress=round_progress, model_name=model_name,
                   layers=layers, step_memory=FLAGS.profile_memory)
    if FLAGS.model_fn:
        inputs = {size: ((lambda v=values[size]: user_model.placeholders_like(v)), values[size]) for size in sizes}
        profiles = profiler.profile_models(model_fn, inputs, FLAGS.device, **options)
    else:
        profiles = profiler.profile_specs(spec, sizes, FLAGS.device, **options)
    elapsed = time.perf_counter() - start
    for size, profile in profiles.items():
        profiler.write_profile(profile, _output(size))
        total = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)
        print(f"wrote {_output(size)}: {len(profile.layers)} layers, forward+backward {total:.2f} ms per batch of "
              f"{size}; whole step {profile.step_ms:.2f} ms, spread {profile.relative_spread:.1%} over "
              f"{profile.timing_rounds} rounds ({elapsed:.1f} s)")
    warning = noise_warning(profiles, FLAGS.runs)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()
