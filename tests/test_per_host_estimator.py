"""tf.estimator per host (issue 46): `dapple_launch --per_host` runs an Estimator script
(tests/per_host_estimator_script.py) in every worker task, each building only its own part; its checkpoints are
dapple_train's one graph's, bit for bit, before and after a resume; what it refuses, by name."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.programs import run_program
from tests.test_per_host_training import _checkpoint, _plan_file, _summaries

pytestmark = pytest.mark.primary_only
dapple_estimator = pytest.importorskip("dapple_tf.frontends.estimator")
LAYERS = ("encode", "norm", "decode")


def _estimator(plan, model_dir, steps, *flags):
    result = run_program("dapple_launch", "--cluster=local:2x1", "--per_host", "--", sys.executable, "-m",
                         "tests.per_host_estimator_script", f"--plan={plan}", f"--model_dir={model_dir}",
                         f"--steps={steps}", *flags, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _one_graph(plan, model_dir, steps):
    result = run_program("dapple_launch", "--cluster=local:2x1", "--noper_host", "--", "dapple_train",
                         "--model_fn=tests.user_model:batch_norm_model_fn", "--input_fn=tests.user_model:input_fn",
                         f"--plan={plan}", "--optimizer=adam", f"--steps={steps}", "--save_checkpoints_steps=3",
                         f"--model_dir={model_dir}", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_an_estimator_script_trains_per_host_like_the_one_graph(tmp_path):
    """Batch norm in stage 0 (task 0), the loss in stage 1 (task 1), Adam: 6 steps, then resumed to 9."""
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])], names=LAYERS)
    per_host, one_graph = tmp_path / "per_host", tmp_path / "one_graph"
    out = _estimator(plan, per_host, 6)
    assert "[worker 0] trained to step 6" in out and "[worker 1] trained to step 6" in out
    # task 0's checkpoint graph (tests/test_per_host_training.py imports and restores it)
    assert {"graph.pbtxt", "model.ckpt-3.meta", "model.ckpt-6.meta"} <= set(os.listdir(per_host))
    _one_graph(plan, one_graph, 6)
    for step in (3, 6):
        a, b = _checkpoint(per_host / f"model.ckpt-{step}"), _checkpoint(one_graph / f"model.ckpt-{step}")
        assert sorted(a) == sorted(b) and "moving_mean" in a and "encode_w/Adam" in a
        assert all(np.array_equal(a[name], b[name]) for name in a), step
    summaries = _summaries(per_host)  # the loss's task writes them: the Estimator's loss, the model's own
    assert len(summaries["loss"]) == 2 and len(summaries["norm/normalized_mean"]) == 2

    _estimator(plan, per_host, 9)
    _one_graph(plan, one_graph, 9)
    a, b = _checkpoint(per_host / "model.ckpt-9"), _checkpoint(one_graph / "model.ckpt-9")
    assert int(a["global_step"]) == 9 and all(np.array_equal(a[name], b[name]) for name in a)


@pytest.mark.long  # in CI: the per-host probe's script-* cases (tests/test_per_host.py)
def test_a_tf1_scripts_own_training_step_trains_per_host(tmp_path):
    """The script's model_fn with dapple_tf.minimize and tf.group(minimize_op, update_ops), through pipelined."""
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])], names=LAYERS)
    _estimator(plan, tmp_path / "per_host", 6, "--script")
    _one_graph(plan, tmp_path / "one_graph", 6)
    a, b = _checkpoint(tmp_path / "per_host" / "model.ckpt-6"), _checkpoint(tmp_path / "one_graph" / "model.ckpt-6")
    assert sorted(a) == sorted(b) and not np.array_equal(a["moving_mean"], np.zeros(16))
    assert all(np.array_equal(a[name], b[name]) for name in a)


def test_per_host_run_config_checkpoints_by_steps_unless_told_otherwise(tmp_path):
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])], names=LAYERS)
    cluster = dapple_estimator.host_estimator.servers.TFCluster.from_tf_config(
        '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}')
    server = type("Server", (), {"target": "grpc://127.0.0.1:1"})()
    task = dapple_estimator.host_estimator.ClusterTask(plan, cluster, server)
    config = task.run_config(model_dir=str(tmp_path))
    assert (config.save_checkpoints_steps, config.save_checkpoints_secs) == (100, None)
    assert config.master == "grpc://127.0.0.1:1" and config.is_chief and not config.cluster_spec.jobs
    assert (config.log_step_count_steps, config.save_summary_steps) == (None, 0)  # task 1 holds the loss
    config = task.run_config(model_dir=str(tmp_path), save_checkpoints_secs=60)
    assert (config.save_checkpoints_steps, config.save_checkpoints_secs) == (None, 60)


def test_without_tf_config_the_run_config_is_the_estimators(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])], names=LAYERS)
    task = dapple_estimator.cluster_task(plan)
    config = task.run_config(model_dir=str(tmp_path), save_checkpoints_secs=60)
    assert task.server is None and config.save_checkpoints_secs == 60 and config.master == ""
    assert isinstance(config, tf.estimator.RunConfig)
