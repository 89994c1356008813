"""The examples under examples/ with the user guide's port applied (its diffs in "Porting a training script", applied
with git apply as a user would), their checkpoints and event files, for test_bert_tf1_example.py and
test_image_script.py."""

import glob
import importlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import tensorflow as tf

from planner.formats import plan_pb2, write_message
from tests.programs import ROOT


def example_modules(example: str, *names: str):
    """The modules `names` of examples/<example>, imported for the caller alone: the examples share module names
    (bert_tf1 and xl_tf1 both have modeling and run_classifier, which put their own folder first on sys.path), so
    whatever another test of this process imported under those names is set aside and put back, with sys.path."""
    folder = os.path.join(ROOT, "examples", example)
    shared = ("modeling", "model_utils", "optimization", "run_classifier", "model", "nmt") + names
    saved_modules = {name: sys.modules.pop(name) for name in shared if name in sys.modules}
    saved_path = list(sys.path)
    sys.path.insert(0, folder)
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        for name in shared:
            sys.modules.pop(name, None)
        sys.modules.update(saved_modules)
        sys.path[:] = saved_path


def saved_initial_weights(path, loss_of) -> float:
    """Pre-trained weights for an example's test, saved at `path`: `loss_of()` builds the model's loss (on the first
    batch, with larger initial weights than the example gives, so that clipping acts) in a graph seeded 3; returns
    the global gradient norm there, as tf.clip_by_global_norm computes it."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        v1.set_random_seed(3)
        loss = loss_of()
        norm = tf.linalg.global_norm(v1.gradients(loss, v1.trainable_variables()))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            v1.train.Saver().save(sess, str(path))
            return float(sess.run(norm))


def port_diff(example: str) -> str:
    """The guide's diff of examples/<example>."""
    with open(os.path.join(ROOT, "docs", "user_guide.md")) as f:
        guide = f.read()
    section = guide[guide.index("## Porting a training script"):guide.index("## Horovod")]
    diffs = re.findall(r"```diff\n(.*?)```", section, re.S)
    return next(d for d in diffs if f"a/examples/{example}/" in d)


def changed_lines(diff: str):
    return [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def ported(example: str, root) -> str:
    """examples/<example> copied under `root` with the guide's diff applied; returns its folder."""
    shutil.copytree(os.path.join(ROOT, "examples", example), root / "examples" / example,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "port.diff").write_text(port_diff(example))
    subprocess.run(["git", "apply", "-p1", "port.diff"], cwd=root, check=True, capture_output=True)
    return str(root / "examples" / example)


def plan_file(path, stages, micro_batches, batch=16) -> str:
    """A plan of (first layer, last layer, device indices) stages on /device:CPU:i."""
    plan = plan_pb2.Plan(num_micro_batches=micro_batches, global_batch_size=batch)
    plan.cluster.device_names.extend([f"/device:CPU:{i}" for i in range(max(max(d) for _, _, d in stages) + 1)])
    for first, last, devices in stages:
        plan.stages.add(first_layer=first, last_layer=last, device_ids=devices)
    write_message(plan, str(path))
    return str(path)


def checkpoint(path):
    reader = tf.train.load_checkpoint(str(path))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def scalar_summaries(model_dir):
    """tag -> {step: value} of the scalar summaries in model_dir's event files."""
    out = {}
    for path in glob.glob(os.path.join(str(model_dir), "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    out.setdefault(value.tag, {})[event.step] = value.simple_value
                else:
                    out.setdefault(value.tag, {})[event.step] = value.WhichOneof("value")
    return out


def largest_difference(want, got):
    assert sorted(want) == sorted(got)  # the single-device variables, slots included: no copies
    return max(float(np.abs(np.asarray(want[k], np.float64) - np.asarray(got[k], np.float64)).max()) for k in want)


def run_script(script, model_dir, *args, timeout=600):
    """python <script> --model_dir=... args, from the repository root; the checkpoint it ends with."""
    result = subprocess.run([sys.executable, script, f"--model_dir={model_dir}", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint(model_dir)
