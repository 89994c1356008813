"""Horovod backend: horovodrun processes each run a 2-stage pipeline and train like one device (TF 2.15)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from planner.formats import cluster as clusters
from planner.planning import horovod_plan
from planner.formats import plan_pb2, write_message
from tests import horovod_model, user_model
from tests.pipeline_harness import SESSION_CONFIG, cpu
from tests.programs import ROOT, run_program
from tests.shared_profiles import PROFILES, requires_profiles

pytestmark = pytest.mark.primary_only
pytest.importorskip("horovod.tensorflow")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
GLOBAL_BATCH, STEPS = 8, 3


def _plan_file(path, num_processes):
    """Stages encode -> 2 devices, decode -> 1 device, at each process's batch, for num_processes."""
    per_process = GLOBAL_BATCH // num_processes
    plan = plan_pb2.Plan(model_name="user_model", planner="manual", cluster=clusters.local_cluster(3),
                         global_batch_size=per_process, micro_batch_size=per_process // 2, num_micro_batches=2,
                         schedule=plan_pb2.DAPPLE)
    plan.stages.add(first_layer=0, last_layer=0, layer_names=["encode"], device_ids=[0, 1])
    plan.stages.add(first_layer=1, last_layer=1, layer_names=["decode"], device_ids=[2])
    write_message(horovod_plan.per_process_plan(plan, num_processes), str(path))
    return str(path)


def _train_args(plan, model_dir):
    return ["--backend=horovod", f"--plan={plan}", "--num_devices=3", "--model_fn=tests.horovod_model:model_fn",
            "--input_fn=tests.horovod_model:input_fn", f"--steps={STEPS}", f"--model_dir={model_dir}",
            "--optimizer=momentum", "--learning_rate=0.05", "--summary_every=0", "--log_every=1", "--seed=0"]


def _single_device_weights():
    """dapple_train's model trained on one device on the global batch: same seed, data and optimizer, rank 0's
    initial weights (tests.horovod_model's differ per rank: the processes match only after the broadcast)."""
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        step = tf.compat.v1.placeholder(tf.int64, [])
        loss = horovod_model.model_fn(*horovod_model.input_fn(step, GLOBAL_BATCH))
        train_op = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for i in range(STEPS):
                sess.run(train_op, {step: i})
            return {v.op.name: sess.run(v) for v in tf.compat.v1.trainable_variables()}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(HOROVODRUN) is None, reason="horovodrun not installed")
def test_horovodrun_two_processes_of_two_stages_train_like_one_device(tmp_path):
    plan = _plan_file(tmp_path / "plan.json", 2)
    command = [HOROVODRUN, "-np", "2", "--gloo", "-H", "localhost:2", sys.executable, "-m", "scripts.dapple_train",
               *_train_args(plan, tmp_path / "m")]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "global batch 8, on 2 Horovod processes x 3 virtual CPU devices" in result.stdout
    reader = tf.train.load_checkpoint(str(tmp_path / "m"))
    assert reader.get_tensor("global_step") == STEPS
    expected = _single_device_weights()
    assert set(expected) == {"encode_w", "decode_w"}
    for name, value in expected.items():
        np.testing.assert_allclose(reader.get_tensor(name), value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_plan_for_another_number_of_processes_is_a_clear_error(tmp_path):
    # One process (hvd.init() without horovodrun has size 1) given a plan for 2.
    result = run_program("dapple_train", *_train_args(_plan_file(tmp_path / "plan.json", 2), tmp_path / "m"))
    assert result.returncode == 1
    assert ("the plan is for 2 Horovod process(es) but horovodrun started 1: plan with dapple_plan --backend=horovod "
            "--num_processes=1") in result.stderr
    assert not os.path.exists(tmp_path / "m")


def test_distributed_optimizer_is_a_clear_error():
    import horovod.tensorflow as hvd

    plan = dapple_tf.Plan.from_stages([("encode", "encode", [cpu(0)]), ("decode", "decode", [cpu(1)])],
                                      num_micro_batches=2)
    with tf.Graph().as_default():
        optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        with pytest.raises(dapple_tf.DappleError, match="hvd.DistributedOptimizer cannot be given to build_pipeline"):
            dapple_tf.build_pipeline(user_model.model_fn, *user_model.input_fn(0, 4), optimizer, plan)


@requires_profiles
def test_dapple_plan_for_horovod_plans_one_server_at_the_per_process_batch(tmp_path):
    result = run_program("dapple_plan", f"--profile={PROFILES}vgg-19-pbs-32.txt",
                         "--global_batch_size=64", "--cluster=local", "--num_devices=4", "--backend=horovod",
                         "--num_processes=2", f"--output={tmp_path / 'plan.json'}")
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["global_batch_size"] == 32 and plan["cluster"]["num_servers"] == 2
    assert plan["cluster"]["device_names"][4] == "/job:horovod/replica:0/task:1/device:CPU:0"
    assert all(d < 4 for stage in plan["stages"] for d in stage["device_ids"])


def test_plans_that_span_servers_are_refused():
    plan = plan_pb2.Plan(cluster=clusters.local_task_cluster(2, 2))
    plan.stages.add(device_ids=[0, 1, 2])
    with pytest.raises(horovod_plan.HorovodPlanError, match="spans servers"):
        horovod_plan.num_processes(plan)
    with pytest.raises(horovod_plan.HorovodPlanError, match="planned for one server"):
        horovod_plan.per_process_plan(plan, 2)


def test_a_plan_for_devices_this_process_lacks_is_a_clear_error():
    import horovod.tensorflow as hvd

    from dapple_tf.frontends.horovod import HorovodPipeline

    hvd.init()  # without horovodrun: one process
    gpus = clusters.make_cluster("gpus", 1, 3, 16e9, 1e11, 1e10, device_names=[f"/device:GPU:{i}" for i in range(3)])
    plan = plan_pb2.Plan(model_name="user_model", planner="manual", cluster=gpus,
                         global_batch_size=8, micro_batch_size=4, num_micro_batches=2, schedule=plan_pb2.DAPPLE)
    plan.stages.add(first_layer=0, last_layer=0, layer_names=["encode"], device_ids=[0, 1])
    plan.stages.add(first_layer=1, last_layer=1, layer_names=["decode"], device_ids=[2])
    pipeline = HorovodPipeline(horovod_plan.per_process_plan(plan, 1))
    with tf.Graph().as_default(), pytest.raises(dapple_tf.PlanError,
                                                match=r"the plan uses devices \['/device:GPU:0', '/device:GPU:1', "
                                                      r"'/device:GPU:2'\] that this process does not have"):
        pipeline.build(user_model.model_fn, *user_model.input_fn(0, 8), tf.compat.v1.train.GradientDescentOptimizer(0.1))
