"""examples/bert_tf1: a TF1 BERT fine-tuning script, ported by the user guide's diff ("Porting a training
script"), trains pipelined inside its encoder (2:1) as the unported script does on one device: through its own
Estimator and through dapple_train --scope_patterns."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from planner.formats import plan_pb2, write_message
from tests.programs import ROOT, run_program

pytestmark = [pytest.mark.primary_only, pytest.mark.slow]  # tf.estimator; ~80 s: two Estimator and two CLI runs

EXAMPLE = os.path.join(ROOT, "examples", "bert_tf1")
LAYERS = "bert/embeddings,bert/encoder/layer_*,bert/pooler,loss"  # 7 layers: embeddings, 4 encoder layers, ...


def port_diff() -> str:
    with open(os.path.join(ROOT, "docs", "user_guide.md")) as f:
        guide = f.read()
    section = guide[guide.index("## Porting a training script"):]
    return re.search(r"```diff\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """The example with the guide's diff applied (git apply, as a user would patch it)."""
    root = tmp_path_factory.mktemp("ported")
    shutil.copytree(EXAMPLE, root / "examples" / "bert_tf1", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "port.diff").write_text(port_diff())
    subprocess.run(["git", "apply", "-p1", "port.diff"], cwd=root, check=True, capture_output=True)
    return root / "examples" / "bert_tf1"


def plan_file(path, stages, micro_batches):
    plan = plan_pb2.Plan(num_micro_batches=micro_batches, global_batch_size=16)
    plan.cluster.device_names.extend([f"/device:CPU:{i}" for i in range(max(max(d) for _, _, d in stages) + 1)])
    for first, last, devices in stages:
        plan.stages.add(first_layer=first, last_layer=last, device_ids=devices)
    write_message(plan, str(path))
    return str(path)


def test_the_port_is_three_lines_none_in_model_fn():
    changed = [line for line in port_diff().splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len(changed) <= 3, changed


def checkpoint(path):
    reader = tf.train.load_checkpoint(str(path))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def assert_same_training(want, got):
    assert sorted(want) == sorted(got)  # the single-device variables, AdamW's slots included: no copies
    assert int(want["global_step"]) == int(got["global_step"]) == 4
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=2e-6, err_msg=name)


def initial_checkpoint(path) -> float:
    """Pre-trained weights, larger than the example's initializer gives (so that clipping at 1.0 acts); returns
    the first batch's global gradient norm there, as tf.clip_by_global_norm computes it."""
    sys.path.insert(0, EXAMPLE)
    try:
        import modeling
        import run_classifier
    finally:
        sys.path.remove(EXAMPLE)
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        v1.set_random_seed(3)
        x, y = run_classifier.examples(0, 16)
        loss, _ = run_classifier.create_model({k: tf.constant(v) for k, v in x.items()}, tf.constant(y),
                                              dict(modeling.CONFIG, initializer_range=0.2))
        norm = tf.linalg.global_norm(v1.gradients(loss, v1.trainable_variables()))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            v1.train.Saver().save(sess, str(path))
            return float(sess.run(norm))


def run_script(folder, model_dir, *args):
    result = subprocess.run(
        [sys.executable, os.path.join(folder, "run_classifier.py"), f"--model_dir={model_dir}", "--train_steps=4",
         "--learning_rate=0.01", "--warmup_steps=1", "--num_cpu_devices=3", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint(model_dir)


def test_ported_script_trains_pipelined_inside_the_encoder_as_on_one_device(ported, tmp_path):
    norm = initial_checkpoint(tmp_path / "init" / "model.ckpt")
    assert norm > 1.0  # clipping at 1.0 acts
    init = f"--init_checkpoint={tmp_path / 'init' / 'model.ckpt'}"
    want = run_script(EXAMPLE, tmp_path / "single", init)
    plan = plan_file(tmp_path / "plan.json", [(0, 2, [0, 1]), (3, 6, [2])], 2)  # cut after encoder layer_1, 2:1
    got = run_script(str(ported), tmp_path / "pipelined", init, f"--plan={plan}")
    assert_same_training(want, got)


def test_ported_model_fn_trains_through_dapple_train(ported, tmp_path):
    def train(name, plan, devices):
        result = run_program("dapple_train", "--model_fn=run_classifier:model_fn",
                             "--input_fn=run_classifier:input_fn", f"--scope_patterns={LAYERS}", f"--plan={plan}",
                             "--steps=4", "--log_every=2", f"--num_devices={devices}", "--save_checkpoints_steps=4",
                             f"--model_dir={tmp_path / name}", cwd=str(ported), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "done: step 4" in result.stdout
        return checkpoint(tmp_path / name)

    want = train("one", plan_file(tmp_path / "one.json", [(0, 6, [0])], 1), 1)
    got = train("two", plan_file(tmp_path / "two.json", [(0, 2, [0, 1]), (3, 6, [2])], 2), 3)
    assert_same_training(want, got)
