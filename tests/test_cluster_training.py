"""Training over a local multi-process TF cluster started by dapple_launch: equivalence with one device,
a worker killed mid-training (bounded failure, then an exact resume), the issue's example command."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from planner.cluster import local_task_cluster
from planner.schemas import plan_pb2, write_message
from tests.programs import ROOT, run_program

pytestmark = pytest.mark.slow
RESUME_STEPS = 40


def test_three_process_cluster_2_1_3_matches_single_device_both_schedules():
    result = run_program("dapple_launch", "--cluster=local:3x2", "--", sys.executable, "tests/cluster_chief.py",
                         "dapple", "gpipe", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for schedule in ("dapple", "gpipe"):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"[chief] {schedule} "))
        assert float(line.split("max_rel_diff=")[1].split()[0]) < 1e-5, line
    # every task's lines are prefixed, and nothing is left running
    assert "[worker 2] worker task 2 serving at 127.0.0.1:" in result.stdout
    assert _running_pids(result.stdout) == []


def test_issue_example_plans_for_the_launched_cluster(tmp_path):
    model_dir = tmp_path / "m"
    result = run_program("dapple_launch", "--cluster=local:3x2", "--", "dapple_train", "--model=mlp",
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


def _train_args(plan, model_dir, steps):
    return ["--", "dapple_train", "--model=mlp", f"--plan={plan}", f"--steps={steps}", f"--model_dir={model_dir}",
            "--save_checkpoints_steps=5", "--log_every=5", "--summary_every=0", "--failure_timeout=20"]


class _Launch:
    """dapple_launch in the background, its output lines in a queue."""

    def __init__(self, *args):
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
        self.popen = subprocess.Popen([sys.executable, "-m", "scripts.dapple_launch", *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self._queue = [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.popen.stdout:
            self._queue.put(line.rstrip("\n"))

    def wait_for(self, predicate, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            self.lines.append(line)
            if predicate(line):
                return line
        raise AssertionError("not seen in time; output:\n" + "\n".join(self.lines[-40:]))

    def finish(self, timeout):
        code = self.popen.wait(timeout)
        time.sleep(0.5)
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return code, "\n".join(self.lines)


def _running_pids(output):
    pids = [int(part.split(")")[0].split(",")[0]) for part in output.split("(pid ")[1:]]
    running = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            running.append(pid)
        except ProcessLookupError:
            pass
    return running


def _weights(model_dir):
    reader = tf.train.load_checkpoint(str(model_dir))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map() if "global_step" not in name}


def test_killed_worker_stops_training_fast_and_resume_continues_exactly(tmp_path):
    plan = _plan_file(tmp_path / "plan.json")
    killed_dir, straight_dir = tmp_path / "killed", tmp_path / "straight"

    launch = _Launch("--cluster=local:3x2", "--grace=30", *_train_args(plan, killed_dir, 100000))
    worker = launch.wait_for(lambda line: line.startswith("dapple_launch: worker task 1 at"), 120)
    address, pid = worker.split(" at ")[1].split()[0], int(worker.split("(pid ")[1].split(",")[0])
    launch.wait_for(lambda line: line.startswith("[chief] step 10/"), 300)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    code, output = launch.finish(timeout=120)
    stopped_after = time.monotonic() - killed_at
    assert code != 0, output
    assert stopped_after < 60, output  # bounded (the chief sees UnavailableError at once)
    assert f"worker task 1 ({address}) was killed by SIGKILL" in output
    error = next(line for line in output.splitlines() if line.startswith("[chief] error: training stopped at step"))
    assert f"worker task 1 ({address}) is unreachable" in error and "To resume" in error, error
    assert "to resume from the last checkpoint, run the same command again" in output
    assert _running_pids(output) == []

    resumed = run_program("dapple_launch", "--cluster=local:3x2", *_train_args(plan, killed_dir, RESUME_STEPS),
                          timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    first = int(resumed.stdout.split("resumed from the checkpoint at step ")[1].split()[0])
    assert 5 <= first < RESUME_STEPS  # a checkpoint every 5 steps; killed after step 10
    straight = run_program("dapple_launch", "--cluster=local:3x2", *_train_args(plan, straight_dir, RESUME_STEPS),
                           timeout=400)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    expected, actual = _weights(straight_dir), _weights(killed_dir)
    assert sorted(expected) == sorted(actual) and expected
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


def test_stopped_master_is_a_bounded_error_naming_the_task(tmp_path):
    plan = _plan_file(tmp_path / "plan.json")
    launch = _Launch("--cluster=local:3x2", "--grace=60",
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
    assert _running_pids(output) == []


def test_killed_session_target_ends_the_chief_by_itself(tmp_path):
    """Worker task 0 is the session's master and the collective group leader: nothing the dead master would
    enforce ends the chief's step. The chief's watchdog does, naming the task, long before the launcher's
    grace (90 s here) would stop it."""
    plan = _plan_file(tmp_path / "plan.json")
    launch = _Launch("--cluster=local:3x2", "--grace=90", *_train_args(plan, tmp_path / "m", 100000))
    worker = launch.wait_for(lambda line: line.startswith("dapple_launch: worker task 0 at"), 120)
    address, pid = worker.split(" at ")[1].split()[0], int(worker.split("(pid ")[1].split(",")[0])
    launch.wait_for(lambda line: line.startswith("[chief] step 5/"), 300)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    error = launch.wait_for(lambda line: line.startswith("[chief] error: "), 120)
    elapsed = time.monotonic() - killed_at
    code, output = launch.finish(timeout=60)
    assert code != 0
    assert elapsed < 30, output
    assert f"worker task 0 ({address}) is unreachable" in error and "To resume" in error, error
    assert _running_pids(output) == []


def test_ctrl_c_stops_every_process(tmp_path):
    plan = _plan_file(tmp_path / "plan.json")
    launch = _Launch("--cluster=local:3x2", *_train_args(plan, tmp_path / "m", 100000))
    launch.wait_for(lambda line: line.startswith("[chief] step 5/"), 300)
    launch.popen.send_signal(signal.SIGINT)
    code, output = launch.finish(timeout=60)
    assert code == 128 + signal.SIGINT, output
    assert "dapple_launch: SIGINT: stopping every task" in output
    assert _running_pids(output) == []
