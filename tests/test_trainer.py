"""dapple_tf.Trainer and dapple_train in one process: exact resume, summaries, held-out loss, a user's model."""

import collections
import glob

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
import models
from dapple_tf.frontends.trainer import Trainer, TrainerOptions
from tests.pipeline_harness import SESSION_CONFIG, cpu
from tests.programs import run_program

BATCH = 12


def _trainer(model_dir, spec, **options):
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)])], num_micro_batches=2)
    return Trainer(spec.model_fn, spec.step_input_fn(BATCH), lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
                   plan, str(model_dir), eval_input_fn=spec.step_input_fn(BATCH, seed=1), config=SESSION_CONFIG,
                   options=TrainerOptions(**dict(dict(save_checkpoints_steps=3, log_every=0, seed=3), **options)),
                   log=lambda text: None)


def _weights(model_dir):
    reader = tf.train.load_checkpoint(str(model_dir))
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()}


def test_interrupted_and_resumed_training_equals_uninterrupted(tmp_path):
    spec = models.get_model("mlp", "tiny")
    first = _trainer(tmp_path / "a", spec).train(6)
    resumed = _trainer(tmp_path / "a", spec, keep_checkpoints=3).train(10)
    straight = _trainer(tmp_path / "b", spec).train(10)
    assert (first.first_step, first.step, resumed.first_step, resumed.step) == (0, 6, 6, 10)
    expected, actual = _weights(tmp_path / "b"), _weights(tmp_path / "a")
    assert expected["global_step"] == 10 and sorted(expected) == sorted(actual)
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)  # momentum slots included
    assert resumed.loss == straight.loss
    kept = sorted(int(p.split("-")[-1].split(".")[0]) for p in glob.glob(str(tmp_path / "a" / "model.ckpt-*.index")))
    assert kept == [6, 9, 10]  # the last 3 (keep_checkpoints), those of the first run included


def test_summaries_and_held_out_loss_through_the_single_device_graph(tmp_path):
    spec = models.get_model("mlp", "tiny")
    result = _trainer(tmp_path, spec, summary_every=2, eval_every=4).train(4)
    tags = set()
    for path in glob.glob(str(tmp_path / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags |= {v.tag for v in event.summary.value}
    assert {"loss", "samples_per_sec", "step_time_ms", "eval_loss"} <= tags
    with tf.Graph().as_default():  # the same held-out batch through the plain model, trained weights loaded
        features, labels = spec.step_input_fn(BATCH, seed=1)(tf.constant(4, tf.int64))
        loss = spec.model_fn(features, labels)
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver().restore(sess, tf.train.latest_checkpoint(str(tmp_path)))
            expected = sess.run(loss)
    assert result.eval_loss == pytest.approx(float(expected), rel=1e-6)


def test_eval_every_needs_held_out_data():
    with pytest.raises(dapple_tf.DappleError, match="eval_every needs an eval_input_fn"):
        Trainer(None, None, None, None, options=TrainerOptions(eval_every=5))


def test_dapple_train_a_users_model_from_a_flagfile(tmp_path):
    flagfile = tmp_path / "train.flags"
    flagfile.write_text("--model_fn=tests.user_model:model_fn\n--input_fn=tests.user_model:input_fn\n"
                        "--eval_input_fn=tests.user_model:input_fn\n--eval_every=3\n"
                        f"--global_batch_size=8\n--num_devices=2\n--steps=3\n--model_dir={tmp_path / 'm'}\n")
    result = run_program("dapple_train", f"--flagfile={flagfile}", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "profiling tests.user_model:model_fn layer by layer at batch 4" in result.stdout
    assert "on local (1x2 devices), global batch 8" in result.stdout
    assert "step 3: held-out loss" in result.stdout and "done: step 3" in result.stdout
    assert set(_weights(tmp_path / "m")) == {"encode_w", "decode_w", "global_step"}


@pytest.mark.parametrize("args,message", [
    (["--model=mlp", "--model_fn=a:b", "--global_batch_size=8"], "give exactly one of --model"),
    (["--model_fn=tests.user_model:model_fn", "--global_batch_size=8"], "--model_fn needs --input_fn"),
    (["--model_fn=tests.user_model", "--input_fn=x:y", "--global_batch_size=8"], "expected package.module:function"),
    (["--model_fn=tests.no_such:fn", "--input_fn=x:y", "--global_batch_size=8"], "No module named 'tests.no_such'"),
    (["--model=mlp"], "--global_batch_size is required (or a --plan file that says it)"),
])
def test_dapple_train_usage_errors(args, message):
    result = run_program("dapple_train", *args, timeout=300)
    assert result.returncode == 1
    assert message in result.stderr


def test_dapple_train_refuses_a_cluster_plan_in_one_process(tmp_path):
    from planner.formats.cluster import local_task_cluster
    from planner.formats import plan_pb2, write_message

    plan = plan_pb2.Plan(model_name="mlp", global_batch_size=8, num_micro_batches=1)
    plan.cluster.CopyFrom(local_task_cluster(1, 1, memory_bytes=1e9))
    plan.stages.add(first_layer=0, last_layer=2, device_ids=[0])
    write_message(plan, str(tmp_path / "plan.json"))
    result = run_program("dapple_train", "--model=mlp", f"--plan={tmp_path / 'plan.json'}", "--steps=1", timeout=300)
    assert result.returncode == 1
    assert ("the plan uses devices that are not available here: ['/job:worker/replica:0/task:0/device:CPU:0']; "
            "available: ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']") in result.stderr


def test_dapple_train_traces_one_step_beside_the_simulated_one(tmp_path):
    """--trace writes the measured timeline of one step (Chrome trace) and a PNG of it above the planner's
    simulated timeline: one forward and one backward box per (stage, micro-batch) of the plan it printed."""
    import json

    trace = tmp_path / "step.json"
    result = run_program("dapple_train", "--model=mlp", "--global_batch_size=32", "--num_devices=2", "--steps=4",
                         f"--trace={trace}", "--trace_step=3", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "traced step 3 of this run: measured" in result.stdout and "; simulated" in result.stdout
    assert (tmp_path / "step.png").stat().st_size > 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    line = next(line for line in result.stdout.splitlines() if line.startswith("training mlp:"))
    stages, m = int(line.split(": ")[1].split(" stages")[0]), int(line.split("M=")[1].split(",")[0])
    boxes = collections.Counter((e["pid"], e["name"][0]) for e in events if e["name"][0] in "FB")
    devices = {pid for pid, _ in boxes}
    assert len(devices) >= stages
    for pid in devices:  # every device: one forward and one backward box per micro-batch
        assert boxes[(pid, "F")] == boxes[(pid, "B")] == m, boxes
