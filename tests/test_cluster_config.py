"""Cluster descriptions without training: TF_CONFIG, addresses, ports, device names, probes, job specs."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import tensorflow as tf
import yaml

from dapple_tf.cluster.servers import (ClusterError, TFCluster, check_port_free, map_devices, probe_task, server_config,
                               start_server, wait_for_workers)
from dapple_tf.rewrite.update.replicas import canonical_device
from planner.formats.cluster import ClusterError as PlannerClusterError
from planner.formats.cluster import load_cluster
from dapple_tf.cluster import job_specs
from tests.programs import run_program


def _tf_config(workers, task_type="worker", index=0):
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": task_type, "index": index}})


def test_tf_config_round_trip_and_the_chief_address():
    cluster = TFCluster(("127.0.0.1:2222", "127.0.0.1:2223"))
    parsed = TFCluster.from_tf_config(cluster.tf_config("worker", 1))
    assert parsed == TFCluster(("127.0.0.1:2222", "127.0.0.1:2223"), "worker", 1)
    kubeflow = json.dumps({"cluster": {"chief": ["c:1"], "worker": ["w0:2222"]}, "task": {"type": "chief", "index": 0}})
    assert TFCluster.from_tf_config(kubeflow) == TFCluster(("w0:2222",), "chief", 0, chief="c:1")
    with_chief = TFCluster(("w0:2222",), chief="c:1")
    assert TFCluster.from_tf_config(with_chief.tf_config("worker", 0)) == TFCluster(("w0:2222",), "worker", 0, "c:1")
    assert parsed.target == "grpc://127.0.0.1:2222"
    assert parsed.describe_task(1) == "worker task 1 (127.0.0.1:2223)"


@pytest.mark.parametrize("text,message", [
    ("", "TF_CONFIG is not set"),
    ("{not json", "TF_CONFIG is not JSON"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), 'TF_CONFIG needs "cluster": {"worker"'),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), 'TF_CONFIG needs "task"'),
    (_tf_config(["a:1", "b:2"], "worker", 2), "this task is worker 2 but the cluster has worker tasks 0..1"),
    (_tf_config(["a:1"], "ps", 0), "task type 'ps' is not one of ('worker', 'chief')"),
    (_tf_config(["localhost"], "chief"), "worker task 0: 'localhost' is not host:port"),
    (_tf_config(["h:99999"], "chief"), "worker task 0: 'h:99999' is not host:port with a port in 1..65535"),
    (_tf_config(["h:1", "h:1"], "chief"), "two worker tasks share an address"),
    (json.dumps({"cluster": {"worker": ["h:1"], "chief": ["c:1", "c:2"]}, "task": {"type": "chief"}}),
     'TF_CONFIG "chief" must list one "host:port", got [\'c:1\', \'c:2\']'),
    (json.dumps({"cluster": {"worker": ["h:1"], "chief": ["c"]}, "task": {"type": "chief"}}),
     "the chief: 'c' is not host:port"),
    (json.dumps({"cluster": {"worker": ["h:1"], "chief": ["h:1"]}, "task": {"type": "chief"}}),
     "the chief's address h:1 is also worker task 0's"),
])
def test_wrong_tf_config_is_a_clear_error(text, message):
    with pytest.raises(ClusterError) as e:
        TFCluster.from_tf_config(text)
    assert message in str(e.value)


def test_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"worker task 0 127.0.0.1:{port}: port {port} is in use"):
            check_port_free(f"127.0.0.1:{port}", "worker task 0")
        cluster = TFCluster((f"127.0.0.1:{port}",), "worker", 0)
        with pytest.raises(ClusterError, match="is in use"):
            start_server(cluster)


def test_server_config_names_the_group_leader():
    config = server_config(2)
    assert config.experimental.collective_group_leader == "/job:worker/replica:0/task:0"
    assert config.device_count["CPU"] == 2


def test_one_spelling_per_remote_device():
    full = "/job:worker/replica:0/task:1/device:CPU:0"
    assert canonical_device("/job:worker/task:1/cpu:0") == full
    assert canonical_device(full) == full
    assert canonical_device("/job:worker/task:0/device:GPU:3") == "/job:worker/replica:0/task:0/device:GPU:3"
    assert canonical_device("/job:localhost/replica:0/task:0/device:CPU:1") == "/device:CPU:1"


def test_two_spellings_of_one_remote_device_are_refused():
    import dapple_tf
    from tests import toy_models

    plan = dapple_tf.Plan.from_stages(
        [(0, 1, ["/job:worker/task:0/cpu:0"]), (2, 4, ["/job:worker/replica:0/task:0/device:CPU:0"])], 2)
    with tf.Graph().as_default(), pytest.raises(dapple_tf.PlanError, match="is used by stages 0 and 1"):
        x, y = toy_models.batch(8)
        dapple_tf.build_pipeline(toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x),
                                 tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan)


def test_plan_devices_map_onto_the_cluster():
    cpus = [f"/job:worker/replica:0/task:{t}/device:CPU:{d}" for t in range(2) for d in range(2)]
    gpu_plan = [f"/job:worker/replica:0/task:{t}/device:GPU:{d}" for t in range(2) for d in range(2)]
    assert map_devices(gpu_plan, cpus) == tuple(cpus)  # CPU devices where there are no GPUs
    assert map_devices(cpus[:2], cpus) == tuple(cpus[:2])
    with pytest.raises(ClusterError, match=r"the plan uses devices that are not available here: "
                                           r"\['/job:worker/replica:0/task:2/device:CPU:0'\]"):
        map_devices(["/job:worker/replica:0/task:2/device:CPU:0"], cpus)
    with pytest.raises(ClusterError, match="not available here"):
        map_devices(["/device:CPU:0"], cpus)  # a plan for one process's devices


def test_planner_cluster_of_local_tasks():
    cluster = load_cluster("local:3x2")
    assert (cluster.num_servers, cluster.devices_per_server) == (3, 2)
    assert cluster.device_names[3] == "/job:worker/replica:0/task:1/device:CPU:1"
    for bad in ("local:3", "local:0x2", "local:ax2"):
        with pytest.raises(PlannerClusterError, match="a local cluster is local:TASKSxDEVICES"):
            load_cluster(bad)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_that_is_not_up_is_waited_for_then_named():
    port = _free_port()
    cluster = TFCluster((f"127.0.0.1:{port}",))
    started = time.monotonic()
    with pytest.raises(ClusterError) as e:
        wait_for_workers(cluster, timeout_s=1.5)
    assert 1.5 <= time.monotonic() - started < 15
    assert f"after waiting 1.5 s, these worker tasks are not up: worker task 0 (127.0.0.1:{port}): unreachable" in str(e.value)


def test_probe_tells_a_stopped_process_from_a_live_server():
    server = tf.distribute.Server(tf.train.ClusterSpec({"worker": [f"127.0.0.1:{_free_port()}"]}), "worker", 0)
    address = server.target[len("grpc://"):]
    assert probe_task(address) is None
    listener = subprocess.Popen([sys.executable, "-c", "import socket,time; s=socket.socket(); "
                                 "s.bind(('127.0.0.1',0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        listener.send_signal(signal.SIGSTOP)  # accepts TCP (kernel backlog) but never answers
        why = probe_task(f"127.0.0.1:{port}", timeout_s=1.0)
        assert why == "not answering within 1 s (stopped or overloaded)"
    finally:
        listener.kill()
        listener.wait()


@pytest.mark.parametrize("args,message", [
    ([], "choose one: --cluster=local:TxD"),
    (["--cluster=local:3x2"], "no command to run: put it after `--`"),
    (["--cluster=local:3", "--", "dapple_train"], "a local cluster is local:TASKSxDEVICES"),
    (["--cluster=local:2x1", "--", "no_such_program_xyz"], "'no_such_program_xyz' is not a program on PATH"),
    (["--emit=k8s", "--cluster=paper_a", "--", "dapple_train"], "--emit=k8s needs --image"),
    (["--emit=slurm", "--cluster=paper_a"], "--emit needs the command after `--`"),
])
def test_launch_usage_errors(args, message):
    result = run_program("dapple_launch", *args, timeout=120)
    assert result.returncode == 1
    assert message in result.stderr


def test_launch_tf_config_errors_before_serving():
    env = dict(os.environ, TF_CONFIG=_tf_config(["127.0.0.1:1"], "worker", 3))
    result = subprocess.run([sys.executable, "-m", "scripts.dapple_launch", "--tf_config"], env=env,
                            capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 1
    assert "this task is worker 3 but the cluster has worker tasks 0..0" in result.stderr


def test_kubernetes_pods_manifest_names_every_task():
    docs = list(yaml.safe_load_all(job_specs.kubernetes("bert", "reg/dapple:1", 2, 8, ["dapple_train", "--model=bert"])))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Service", "NetworkPolicy", "Pod", "Pod", "Pod"]
    assert docs[0]["spec"]["clusterIP"] == "None"
    pods = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Pod"}
    assert sorted(pods) == ["bert-chief", "bert-worker-0", "bert-worker-1"]
    for name, pod in pods.items():
        container = pod["spec"]["containers"][0]
        config = json.loads(next(e["value"] for e in container["env"] if e["name"] == "TF_CONFIG"))
        assert config["cluster"]["worker"] == ["bert-worker-0.bert:2222", "bert-worker-1.bert:2222"]
        assert config["cluster"]["chief"] == ["bert-chief.bert:2222"]  # where the workers watch their chief
        assert pod["spec"]["restartPolicy"] == "OnFailure"  # every task fails together and restarts
        if name == "bert-chief":
            assert config["task"] == {"type": "chief", "index": 0}
            assert container["command"] == ["dapple_launch", "--tf_config", "--", "dapple_train", "--model=bert"]
        else:
            assert config["task"] == {"type": "worker", "index": int(name[-1])}
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
            assert pod["spec"]["hostname"] == name and pod["spec"]["subdomain"] == "bert"
    ingress = docs[1]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert ingress == {"app": "bert"}  # only the job's own pods reach the unauthenticated gRPC ports


def test_kubeflow_tfjob_manifest():
    job, policy = yaml.safe_load_all(job_specs.kubernetes("j", "img", 3, 0, ["dapple_train"], kind="tfjob",
                                                          cpu_devices=2))
    specs = job["spec"]["tfReplicaSpecs"]
    assert (job["kind"], specs["Chief"]["replicas"], specs["Worker"]["replicas"]) == ("TFJob", 1, 3)
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    assert worker["name"] == "tensorflow"
    assert worker["command"] == ["dapple_launch", "--tf_config", "--virtual_devices=2"]
    assert policy["kind"] == "NetworkPolicy"
    assert job["spec"]["runPolicy"]["backoffLimit"] == 3
    assert {spec["restartPolicy"] for spec in specs.values()} == {"OnFailure"}


def test_emit_k8s_from_a_cluster_preset(tmp_path):
    out = tmp_path / "job.yaml"
    result = run_program("dapple_launch", "--emit=k8s", "--noper_host", "--cluster=paper_a", "--image=img", f"--output={out}",
                         "--", "dapple_train", "--model=bert", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "2 worker tasks and a chief" in result.stdout
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(out.read_text()) if d["kind"] == "Pod"] == [
        "dapple-worker-0", "dapple-worker-1", "dapple-chief"]


def _stub(path, body):
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _slurm_run(tmp_path, chief_failures, max_restarts):
    """Runs the emitted Slurm script with stub scontrol/srun/dapple_launch; the stub chief fails its first
    `chief_failures` runs. Returns the result and the (TF_CONFIG, arguments) of every task started."""
    script = tmp_path / "job.sbatch"
    script.write_text(job_specs.slurm("j", 3, 0, ["dapple_train", "--model=mlp", "--steps=5"], cpu_devices=2,
                                      max_restarts=max_restarts))
    bin_dir, log, runs = tmp_path / "bin", tmp_path / "log", tmp_path / "chief_runs"
    bin_dir.mkdir()
    _stub(bin_dir / "scontrol", "printf 'node1\\nnode2\\nnode3\\n'\n")
    _stub(bin_dir / "srun", 'while [[ "$1" == --* ]]; do shift; done\n'
          'for i in 0 1 2; do SLURM_PROCID=$i "$@"; done\n')
    # the chief's stub waits (up to 10 s) for this attempt's 3 workers, which srun starts in the background
    _stub(bin_dir / "dapple_launch", f'echo "$TF_CONFIG | $*" >> {log}\n'
          f'if [[ "$*" == *" -- "* ]]; then echo run >> {runs}; for i in $(seq 100); do\n'
          f'  [ $(( $(wc -l < {log}) % 4 )) -eq 0 ] && break; sleep 0.1; done\n'
          f'  [ "$(wc -l < {runs})" -gt {chief_failures} ] || exit 7; fi\n')
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-3]")
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    lines = log.read_text().splitlines()
    return result, [(json.loads(line.split(" | ")[0]), line.split(" | ")[1]) for line in lines]


def test_slurm_script_starts_every_task_with_its_tf_config(tmp_path):
    result, started = _slurm_run(tmp_path, chief_failures=0, max_restarts=3)
    assert result.returncode == 0, result.stderr
    workers = ["node1:2222", "node2:2222", "node3:2222"]
    assert [c["cluster"] for c, _ in started] == [{"worker": workers, "chief": ["node1:2223"]}] * 4
    tasks = sorted((c["task"]["type"], c["task"]["index"]) for c, _ in started)
    assert tasks == [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]
    commands = {c["task"]["type"]: args for c, args in started}
    assert commands["chief"] == "--tf_config -- dapple_train --model=mlp --steps=5"
    assert commands["worker"] == "--tf_config --virtual_devices=2"
    assert "#SBATCH --nodes=3" in (tmp_path / "job.sbatch").read_text()


@pytest.mark.parametrize("failures, max_restarts, code", [(2, 3, 0), (2, 1, 7)])
def test_slurm_script_starts_every_task_again_after_a_failure(tmp_path, failures, max_restarts, code):
    result, started = _slurm_run(tmp_path, chief_failures=failures, max_restarts=max_restarts)
    assert result.returncode == code, result.stderr
    attempts = min(failures, max_restarts + 1) + (code == 0)
    assert len(started) == 4 * attempts  # every task, every attempt
    assert sorted(c["task"]["type"] for c, _ in started).count("chief") == attempts
    failed = [line for line in result.stderr.splitlines() if line.startswith("dapple: attempt")]
    assert failed == [f"dapple: attempt {i} failed (chief exit code 7)" for i in range(min(failures, attempts))]


WAIT_FOR_WORKERS = ("from dapple_tf.cluster.servers import TFCluster, wait_for_workers; "
                    "wait_for_workers(TFCluster.from_tf_config(), 60); print('workers up')")


@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_launcher_pins_workers_and_their_thread_pools_reach_the_servers():
    """Each worker reports, from inside its own process, the cores it runs on and the thread pools its
    server was started with: one core each, intra 1 and inter 2 (one thread left for transfers), or
    what the flags say."""
    from dapple_tf.cluster.servers import worker_cores

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to pin 2 workers")
    result = run_program("dapple_launch", "--cluster=local:2x1", "--noper_host", "--isolate_network=false", "--cores_per_worker=1",
                         "--", sys.executable, "-c", WAIT_FOR_WORKERS, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    reported = [line.split("cores ")[1].split("]")[0] + "]" for line in result.stdout.splitlines()
                if "serving at" in line]
    assert len(reported) == 2 and reported[0] != reported[1], result.stdout  # two different single cores
    for i in range(2):
        cores = list(worker_cores(i, 1))
        assert f"cores {cores}, threads intra 1 inter 2" in result.stdout, result.stdout
    assert "[chief] workers up" in result.stdout
    result = run_program("dapple_launch", "--cluster=local:2x1", "--noper_host", "--isolate_network=false", "--cores_per_worker=0",
                         "--inter_op_threads=3", "--", sys.executable, "-c", WAIT_FOR_WORKERS, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    everything = sorted(os.sched_getaffinity(0))
    assert result.stdout.count(f"cores {everything}, threads intra 0 inter 3") == 2, result.stdout


def test_worker_threads_for_pinned_cores():
    from dapple_tf.cluster.servers import WorkerThreads

    assert WorkerThreads.for_cores(1) == WorkerThreads(1, 2)
    assert WorkerThreads.for_cores(4) == WorkerThreads(4, 5)
    assert WorkerThreads.for_cores(0) == WorkerThreads(0, 0)  # unpinned: TF's defaults
    config = server_config(2, WorkerThreads(1, 2))
    assert (config.intra_op_parallelism_threads, config.inter_op_parallelism_threads) == (1, 2)
    assert config.device_count["CPU"] == 2
