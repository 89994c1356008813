"""Training over a local multi-process TF cluster: equivalence with one device, the issue's example
command, and failures: each role killed at random steps under dapple_launch and with tasks started by
hand from TF_CONFIG ends the job within seconds naming what died, leaves no process or port behind, and
the restarts end with the weights of an uninterrupted run."""

import os
import random
import signal
import socket
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from dapple_tf.cluster.servers import TFCluster, free_ports
from planner.formats.cluster import local_task_cluster
from planner.formats import plan_pb2, write_message
from tests.launch_harness import Launch, pid_of, running_pids
from tests.programs import run_program

pytestmark = pytest.mark.slow
RESUME_STEPS = 40


def test_three_process_cluster_2_1_3_matches_single_device_both_schedules():
    result = run_program("dapple_launch", "--cluster=local:3x2", "--noper_host", "--", sys.executable, "tests/cluster_chief.py",
                         "dapple", "gpipe", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for schedule in ("dapple", "gpipe"):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"[chief] {schedule} "))
        assert float(line.split("max_rel_diff=")[1].split()[0]) < 1e-5, line
    # every task's lines are prefixed, and nothing is left running
    assert "[worker 2] worker task 2 serving at 127.0.0.1:" in result.stdout
    assert running_pids(result.stdout) == []


@pytest.mark.primary_only  # on TF 2.21 a launched cluster trains in the test above
def test_issue_example_plans_for_the_launched_cluster(tmp_path):
    model_dir = tmp_path / "m"
    result = run_program("dapple_launch", "--cluster=local:3x2", "--noper_host", "--", "dapple_train", "--model=mlp",
                         "--global_batch_size=24", "--steps=6", f"--model_dir={model_dir}", "--summary_every=3",
                         timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "on local:3x2 (3x2 devices)" in result.stdout  # planned for the launched cluster
    assert "[chief] done: step 6" in result.stdout
    assert tf.train.latest_checkpoint(str(model_dir)).endswith("model.ckpt-6")
    tags = set()
    for name in os.listdir(model_dir):
        if name.startswith("events.out.tfevents"):
            for event in tf.compat.v1.train.summary_iterator(str(model_dir / name)):
                tags |= {v.tag for v in event.summary.value}
    assert {"loss", "samples_per_sec", "step_time_ms"} <= tags
    assert "peak_memory_mib/job:worker_replica:0_task:2_device:CPU:1" in tags, sorted(tags)


def _plan_file(path):
    """A fixed 2:1:3 plan of the tiny MLP over local:3x2 (the same plan for every run compared)."""
    plan = plan_pb2.Plan(model_name="mlp", planner="manual", global_batch_size=24, num_micro_batches=2,
                         micro_batch_size=12, schedule=plan_pb2.DAPPLE)
    plan.cluster.CopyFrom(local_task_cluster(3, 2, memory_bytes=1e9))
    for first, last, names, ids in [(0, 0, ["dense_0"], [0, 1]), (1, 1, ["dense_1"], [2]), (2, 2, ["head"], [3, 4, 5])]:
        plan.stages.add(first_layer=first, last_layer=last, layer_names=names, device_ids=ids)
    write_message(plan, str(path))
    return str(path)


def _train_args(plan, model_dir, steps, log_every=5):
    return ["--", "dapple_train", "--model=mlp", f"--plan={plan}", f"--steps={steps}", f"--model_dir={model_dir}",
            "--save_checkpoints_steps=5", f"--log_every={log_every}", "--summary_every=0", "--failure_timeout=20"]


def _weights(model_dir):
    reader = tf.train.load_checkpoint(str(model_dir))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map() if "global_step" not in name}


def _kill_and_finish(launch, role, rng, start_step, steps):
    """Kills `role` ("worker 1", "worker 0" or "chief") at a random step of a launched run; returns the
    seconds from the kill to the launcher's exit, its output, and the killed task's address."""
    if role == "chief":
        line = launch.wait_for(lambda text: text.startswith("dapple_launch: chief (pid "), 120)
        address = launch.wait_for(lambda text: "the chief's workers watch it at " in text, 120).split(" at ")[-1]
    else:
        line = launch.wait_for(lambda text: text.startswith(f"dapple_launch: worker task {role[-1]} at"), 120)
        address = line.split(" at ")[1].split()[0]
    target = rng.randint(start_step + 3, start_step + 12)
    assert target < steps - 5, "more kills than steps to kill them in"
    launch.wait_for(lambda text: text.startswith("[chief] step ") and int(text.split()[2].split("/")[0]) >= target,
                    300)
    os.kill(pid_of(line), signal.SIGKILL)
    killed_at = time.monotonic()
    code, output = launch.finish(timeout=120)
    assert code != 0, output
    return time.monotonic() - killed_at, output, address


def _resumed_step(output):
    return int(output.split("resumed from the checkpoint at step ")[1].split()[0]) if "resumed from" in output else 0


@pytest.mark.long
def test_kill_restart_loop_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    """Each role is killed at a random step (SIGKILL: a lost machine); every time the job ends non-zero
    within 30 s naming what died, nothing is left behind, and the same command resumes. The last run's
    weights equal an uninterrupted run's bit for bit (a 2:1:3 plan: replicated stages)."""
    plan = _plan_file(tmp_path / "plan.json")
    killed_dir, straight_dir = tmp_path / "killed", tmp_path / "straight"
    rng, start = random.Random(22), 0
    for role in ("worker 1", "chief", "worker 0"):
        launch = Launch("--cluster=local:3x2", "--noper_host", *_train_args(plan, killed_dir, RESUME_STEPS, log_every=1))
        elapsed, output, address = _kill_and_finish(launch, role, rng, start, RESUME_STEPS)
        assert elapsed < 30, output
        assert _resumed_step(output) == start, output
        if role == "chief":
            assert f"dapple_launch: the chief ({address}) was killed by SIGKILL" in output
            went = f"the chief ({address}) went away: its process ended without finishing: exiting"
            assert output.count(went) == 3, output  # every worker saw it at once and ended by itself
        else:
            task = int(role[-1])
            assert f"worker task {task} ({address}) was killed by SIGKILL" in output
            error = next(line for line in output.splitlines() if line.startswith("[chief] error: "))
            assert f"worker task {task} ({address}) is unreachable" in error and "To resume" in error, error
        assert "to resume from the last checkpoint, run the same command again" in output
        assert running_pids(output) == []
        start = int(tf.train.latest_checkpoint(str(killed_dir)).rsplit("-", 1)[1]) if tf.train.latest_checkpoint(
            str(killed_dir)) else 0

    resumed = run_program("dapple_launch", "--cluster=local:3x2", "--noper_host", *_train_args(plan, killed_dir, RESUME_STEPS),
                          timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert 5 <= _resumed_step(resumed.stdout) == start < RESUME_STEPS
    straight = run_program("dapple_launch", "--cluster=local:3x2", "--noper_host", *_train_args(plan, straight_dir, RESUME_STEPS),
                           timeout=400)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    expected, actual = _weights(straight_dir), _weights(killed_dir)
    assert sorted(expected) == sorted(actual) and expected
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


def _start_by_hand(plan, model_dir):
    """Two workers and a chief started from their TF_CONFIGs, as on hosts with no launcher (TF's servers
    listen on every interface here: loopback ports of this machine)."""
    *ports, chief_port = free_ports(3)
    cluster = TFCluster(tuple(f"127.0.0.1:{p}" for p in ports), chief=f"127.0.0.1:{chief_port}")
    workers = [Launch("--tf_config", "--virtual_devices=3", tf_config=cluster.tf_config("worker", i)) for i in (0, 1)]
    for i, worker in enumerate(workers):
        worker.wait_for(lambda text: text.startswith(f"worker task {i} serving at"), 120)
    chief = Launch("--tf_config", *_train_args(_two_task_plan(plan), model_dir, 100000, log_every=1),
                    tf_config=cluster.tf_config("chief"))
    return cluster, workers, chief


def _two_task_plan(path):
    """Two stages over 2 tasks of 3 devices: the first replicated on task 0, the second on task 1."""
    plan = plan_pb2.Plan(model_name="mlp", planner="manual", global_batch_size=24, num_micro_batches=2,
                         micro_batch_size=12, schedule=plan_pb2.DAPPLE)
    plan.cluster.CopyFrom(local_task_cluster(2, 3, memory_bytes=1e9))
    for first, last, names, ids in [(0, 0, ["dense_0"], [0, 1]), (1, 2, ["dense_1", "head"], [3])]:
        plan.stages.add(first_layer=first, last_layer=last, layer_names=names, device_ids=ids)
    write_message(plan, str(path))
    return str(path)


def _assert_nothing_left(cluster, launches):
    for launch in launches:
        assert launch.popen.poll() is not None
        assert running_pids("\n".join(launch.lines)) == []
    for address in cluster.workers + (cluster.chief,):
        host, port = address.split(":")
        with socket.socket() as probe:
            assert probe.connect_ex((host, int(port))) != 0, f"{address} still listens"


@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
@pytest.mark.parametrize("victim", ["worker 0", "worker 1", "chief"])
def test_tasks_started_by_hand_end_together_whichever_dies(tmp_path, victim):
    """No launcher: a killed worker (the session target or another) ends the chief (its watchdog), which ends
    the other worker (the chief's lease); a killed chief ends every worker. Within 30 s, naming what died."""
    cluster, workers, chief = _start_by_hand(tmp_path / "plan.json", tmp_path / "m")
    command = chief.wait_for(lambda text: text.startswith("dapple_launch: chief command (pid "), 60)
    chief.wait_for(lambda text: text.startswith("step 3/"), 300)
    if victim == "chief":
        os.kill(chief.popen.pid, signal.SIGKILL)  # the chief's host is lost: its command dies with it
        killed_at = time.monotonic()
        for i, worker in enumerate(workers):
            code, output = worker.finish(timeout=30)
            assert code == 1, output
            assert (f"worker task {i} ({cluster.workers[i]}): the chief ({cluster.chief}) went away: its process "
                    "ended without finishing: exiting") in output
        assert time.monotonic() - killed_at < 30
        chief.finish(timeout=5)
    else:
        dead = int(victim[-1])
        os.kill(workers[dead].popen.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code, output = chief.finish(timeout=60)
        assert code != 0 and time.monotonic() - killed_at < 30, output
        error = next(line for line in output.splitlines() if line.startswith("error: "))
        assert f"worker task {dead} ({cluster.workers[dead]}) is unreachable" in error, error
        other = 1 - dead
        code, output = workers[other].finish(timeout=30)
        assert code == 1 and time.monotonic() - killed_at < 30, output
        assert (f"worker task {other} ({cluster.workers[other]}): the chief ({cluster.chief}) ended with exit code 1: "
                "exiting") in output
        workers[dead].finish(timeout=5)
    assert running_pids(command) == []
    _assert_nothing_left(cluster, workers + [chief])


@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_stopped_master_is_a_bounded_error_naming_the_task(tmp_path):
    plan = _plan_file(tmp_path / "plan.json")
    launch = Launch("--cluster=local:3x2", "--noper_host", "--grace=60",
                     *(_train_args(plan, tmp_path / "m", 100000)[:-1] + ["--failure_timeout=5"]))
    worker = launch.wait_for(lambda line: line.startswith("dapple_launch: worker task 0 at"), 120)
    address, pid = worker.split(" at ")[1].split()[0], int(worker.split("(pid ")[1].split(",")[0])
    launch.wait_for(lambda line: line.startswith("[chief] step 5/"), 300)
    os.kill(pid, signal.SIGSTOP)  # a hung machine: TCP still accepts, nothing answers
    stopped_at = time.monotonic()
    try:
        error = launch.wait_for(lambda line: line.startswith("[chief] error: "), 120)
        elapsed = time.monotonic() - stopped_at
    finally:
        os.kill(pid, signal.SIGCONT)
    code, output = launch.finish(timeout=60)
    assert code != 0
    assert elapsed < 5 + 30, output  # the failure timeout plus probing, not forever
    assert f"worker task 0 ({address}) is not answering within" in error, error
    assert running_pids(output) == []


@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_ctrl_c_stops_every_process(tmp_path):
    plan = _plan_file(tmp_path / "plan.json")
    launch = Launch("--cluster=local:3x2", "--noper_host", *_train_args(plan, tmp_path / "m", 100000))
    launch.wait_for(lambda line: line.startswith("[chief] step 5/"), 300)
    launch.popen.send_signal(signal.SIGINT)
    code, output = launch.finish(timeout=60)
    assert code == 128 + signal.SIGINT, output
    assert "dapple_launch: SIGINT: stopping every task" in output
    assert running_pids(output) == []
