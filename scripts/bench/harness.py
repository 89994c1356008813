"""What the benchmarks share: virtual CPU devices and their session config, the BFC allocator, timing,
synthetic batches, optimizers and plans on virtual CPUs, child programs (dapple_launch, horovodrun) whose
output is streamed, the published profiles, writing rows as JSON, and progress lines with an estimate of what is left
(`Progress`).

Nothing here imports TensorFlow at import time: a benchmark may set TF's environment first.
"""

import json
import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

from scripts.cli import shared_profiles, split_cpu

__all__ = ["Progress", "alternating_median_ms", "cpu_config", "cpu_plan", "duration_text", "launch_command",
           "mlp_spec", "module_command", "optimizer", "profile_path", "progress_text", "split_cpu", "stream_command",
           "synthetic_batch", "timed", "use_bfc_allocator", "virtual_cpus", "write_rows"]


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


def duration_text(seconds: float) -> str:
    """'8s', '1m40s', '1h05m' (whole seconds; whole minutes from an hour on)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_text(done: int, total: int, what: str, elapsed_s: float, then: str = "") -> str:
    """'[3/8 plans built, 40s so far, ~1m07s left]': the units left times the elapsed time per unit done (no estimate
    before the first unit; the time taken once all are done); `then`, e.g. 'then timing ~2m', is added inside the
    brackets while units are left."""
    if done <= 0:
        text = f"0/{total} {what}"
    elif done >= total:
        text = f"{done}/{total} {what} in {duration_text(elapsed_s)}"
    else:
        text = (f"{done}/{total} {what}, {duration_text(elapsed_s)} so far, "
                f"~{duration_text(elapsed_s / done * (total - done))} left")
    return f"[{text}{', ' + then if then and done < total else ''}]"


class Progress:
    """Progress of `total` units of repeated work (cases, rounds, plans): after each, `advance(note)` prints the note
    and progress_text (the estimate of what is left is the elapsed time per unit done times the units left), timed
    from the Progress's creation; with `every_s`, only when that many seconds passed since the last line (and after
    the last unit), for many short units."""

    def __init__(self, total: int, what: str, log: Callable[[str], None] = None, clock: Callable[[], float] = None,
                 every_s: float = 0.0):
        self.total, self.what, self.done = total, what, 0
        self._log = log or (lambda text: print(text, flush=True))
        self._clock = clock or time.perf_counter
        self._start = self._clock()
        self._every_s, self._logged = every_s, self._start

    def elapsed_s(self) -> float:
        return self._clock() - self._start

    def left_s(self) -> Optional[float]:
        """The estimate of what is left (None before the first unit)."""
        return self.elapsed_s() / self.done * (self.total - self.done) if self.done else None

    def text(self, then: str = "") -> str:
        return progress_text(self.done, self.total, self.what, self.elapsed_s(), then)

    def advance(self, note: str = "", count: int = 1, then: str = "") -> str:
        """Counts `count` units done and logs '<note> [progress]' (indented by the note's own spaces), or
        '  [progress]'; returns it ("" when `every_s` held it back)."""
        self.done += count
        now = self._clock()
        if self.done < self.total and now - self._logged < self._every_s:
            return ""
        self._logged = now
        line = f"{note} {self.text(then)}" if note else f"  {self.text(then)}"
        self._log(line)
        return line


def alternating_median_ms(runs, rounds: int, steps: int):
    """profiler.timing.alternating_median_ms with a progress line after each round: ({name: median over the rounds},
    {name: fastest round}) of median_run_ms(session, fetches, warmup=1, runs=steps) for runs = {name: (session,
    fetches)}, each round running every one in turn."""
    import statistics  # pylint: disable=import-outside-toplevel

    from profiler.timing import median_run_ms  # pylint: disable=import-outside-toplevel

    samples, progress = {name: [] for name in runs}, Progress(max(1, rounds), "rounds")
    for _ in range(max(1, rounds)):
        for name, (session, fetches) in runs.items():
            samples[name].append(median_run_ms(session, fetches, warmup=1, runs=steps))
        progress.advance()
    return ({name: statistics.median(v) for name, v in samples.items()}, {name: min(v) for name, v in samples.items()})


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
