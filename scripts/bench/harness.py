"""What the benchmarks share: virtual CPU devices and their session config, the BFC allocator, timing,
synthetic batches, optimizers and plans on virtual CPUs, child programs (dapple_launch, horovodrun) whose
output is streamed, the published profiles and writing rows as JSON.

Nothing here imports TensorFlow at import time: a benchmark may set TF's environment first.
"""

import json
import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

from scripts.cli import shared_profiles, split_cpu

__all__ = ["cpu_config", "cpu_plan", "launch_command", "mlp_spec", "module_command", "optimizer", "profile_path",
           "split_cpu", "stream_command", "synthetic_batch", "timed", "use_bfc_allocator", "virtual_cpus",
           "write_rows"]


def use_bfc_allocator() -> None:
    """TF's BFC allocator on CPU (its memory statistics then report peaks) and quiet TF logs; call it before
    TensorFlow is imported."""
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def cpu_config(num_devices: int, **options):
    """A session ConfigProto with `num_devices` CPU devices (and any other ConfigProto fields)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf.compat.v1.ConfigProto(device_count={"CPU": num_devices}, **options)


def virtual_cpus(num_devices: int, **options):
    """Splits the CPU into `num_devices` virtual devices and returns cpu_config for them."""
    split_cpu(num_devices)
    return cpu_config(num_devices, **options)


def cpu_plan(stages: Sequence[Tuple[int, int, Sequence[int]]], num_micro_batches: int):
    """A dapple_tf.Plan of [(first layer, last layer, CPU device indices)]."""
    import dapple_tf  # pylint: disable=import-outside-toplevel

    return dapple_tf.Plan.from_stages([(a, b, [f"/device:CPU:{i}" for i in ids]) for a, b, ids in stages],
                                      num_micro_batches)


LEARNING_RATES = {"adam": 1e-3, "sgd": 0.01}  # the benchmarks' optimizers


def optimizer(name: str = "sgd"):
    """The benchmarks' optimizers (TF1): adam or sgd, at LEARNING_RATES."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if name == "adam":
        return tf.compat.v1.train.AdamOptimizer(LEARNING_RATES["adam"])
    return tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATES["sgd"])


def layer_names(spec, batch_size: int) -> List[str]:
    """The reference model's layer names in order (dapple_tf.layer markers), from building it once aside."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.model.layers import LayerRecorder  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default() as graph:
        features, labels = spec.placeholders(batch_size)
        recorder = LayerRecorder(graph)
        with recorder.activate():
            spec.model_fn(features, labels)
    return list(recorder.names)


def define_straight_pipeline_flags() -> None:
    """The model and pipeline flags of the benchmarks that time a straight pipeline of a reference model on virtual
    CPU devices (build, step_ab): BERT-24 at hidden 64, batch 64, 4 stages by default."""
    from absl import flags  # pylint: disable=import-outside-toplevel

    flags.DEFINE_string("model", "bert", "Reference model.")
    flags.DEFINE_string("config", "tiny", "Reference model config.")
    flags.DEFINE_string("model_flags", "num_layers=24,hidden=64,heads=2,ffn=128", "Model overrides key=value,...")
    flags.DEFINE_integer("global_batch_size", 64, "Samples per step.")
    flags.DEFINE_integer("num_stages", 4, "Stages of the straight pipeline (one virtual CPU device each).")


def straight_plan(names: Sequence[str], num_stages: int, num_micro_batches: int):
    """A dapple_tf.Plan of `num_stages` stages of consecutive layers (`names`), as even as the count allows, stage s
    on /device:CPU:s."""
    import dapple_tf  # pylint: disable=import-outside-toplevel

    per = -(-len(names) // num_stages)
    return dapple_tf.Plan.from_stages([(names[i], names[min(i + per, len(names)) - 1], [f"/device:CPU:{s}"])
                                       for s, i in enumerate(range(0, len(names), per))], num_micro_batches)


def mlp_spec(hidden: int):
    """The reference MLP (tiny config) with 4 hidden layers of `hidden`."""
    import models  # pylint: disable=import-outside-toplevel

    return models.get_model("mlp", "tiny", hidden=[hidden] * 4)


def synthetic_batch(spec, batch_size: int):
    """(features, labels) tensors of the model's synthetic batch for step 0."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return spec.step_input_fn(batch_size)(tf.constant(0, tf.int64))


def timed(fn: Callable):
    """(fn(), seconds it took)."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def module_command(module: str, *args: str) -> List[str]:
    """`python -m module args...` with this Python."""
    return [sys.executable, "-m", module, *args]


def launch_command(cluster: str, chief: Sequence[str], *launcher_flags: str) -> List[str]:
    """dapple_launch on a local cluster (`local:TxD`) running `chief` as its chief command (`--per_host` among
    `launcher_flags`, which come later: in every worker task instead)."""
    return module_command("scripts.dapple_launch", f"--cluster={cluster}", "--noper_host", *launcher_flags, "--",
                          *chief)


def stream_command(command: Sequence[str], show: Callable[[str], Optional[str]]) -> Tuple[int, List[str]]:
    """Runs `command` (TF logs quiet, stderr into stdout), printing show(line) for each output line where it
    is not None; stops the command if this process is interrupted. Returns (exit code, every line)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    process = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            text = show(line)
            if text is not None:
                print(text, end="", flush=True)
    finally:
        if process.poll() is None:
            process.terminate()
        code = process.wait()
    return code, lines


def profile_path(name: str, folder: Optional[str] = None) -> str:
    """The published profile `name` (e.g. bert-48-pbs-2) in `folder`, else in the shared profiles."""
    return os.path.join(shared_profiles(folder), f"{name}.txt")


def write_rows(path, rows, log=print) -> None:
    """A benchmark's rows (a list of dicts) as JSON at `path` (nothing when `path` is empty)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    log(f"wrote {path}")
