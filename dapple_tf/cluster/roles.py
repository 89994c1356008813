"""dapple_launch's three ways to run, as functions of plain arguments: a host's role from TF_CONFIG
(`serve_or_run`: a worker serves until its chief ends, or runs the command itself (per-host training); the chief
runs its command under a lease), a
job spec for a cluster file (`emit_spec`), and a local cluster on loopback (`launch_local_cluster`).
"""

import dataclasses
import json
import os
import sys
import threading
from typing import Optional, Sequence, Tuple

# how a worker task running a command (per-host training) is told its server's devices and threads
WORKER_SERVER_ENV = "DAPPLE_WORKER_SERVER"
RESUME_HINT = ("dapple_launch: training did not finish; to resume from the last checkpoint, run the same command "
               "again (dapple_train continues from the latest checkpoint in its --model_dir)")


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """How a worker task serves: its virtual devices, thread pools and how long it waits for its chief."""

    virtual_devices: int = 0
    intra_op_threads: Optional[int] = None
    inter_op_threads: Optional[int] = None
    chief_wait_timeout_s: float = 600
    failure_timeout_s: float = 30


def pinned_cores() -> int:
    """The cores this process may run on when it was pinned to fewer than the machine has, else 0."""
    if not hasattr(os, "sched_getaffinity"):
        return 0
    mine = len(os.sched_getaffinity(0))
    return mine if mine < (os.cpu_count() or mine) else 0


def worker_threads(cores: int, intra_op: Optional[int] = None, inter_op: Optional[int] = None):
    """WorkerThreads of the given pool sizes, each defaulting to those for `cores`."""
    from dapple_tf.cluster.servers import WorkerThreads

    default = WorkerThreads.for_cores(cores)
    intra = default.intra_op if intra_op is None else intra_op
    inter = default.inter_op if inter_op is None else inter_op
    if intra < 0 or inter < 0:
        raise ValueError(f"thread counts must be >= 0, got intra {intra}, inter {inter}")
    return WorkerThreads(intra, inter)


def serve_or_run(command: Sequence[str], settings: WorkerSettings) -> int:
    """This host's role from TF_CONFIG: a worker starts its server and waits; the chief runs the command."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from dapple_tf.cluster.servers import TFCluster

    cluster = TFCluster.from_tf_config()
    if cluster.task_type == "chief":
        return run_chief(cluster, command)
    if command:
        return run_per_host(command, settings)
    return serve(cluster, settings)


def run_per_host(command: Sequence[str], settings: WorkerSettings) -> int:
    """A worker task with a command runs it: per-host training, where the command (dapple_train) starts this
    task's server itself, with the settings passed in WORKER_SERVER_ENV, and builds only this task's part."""
    from dapple_tf.cluster.launch_local import command_line, run_child

    threads = worker_threads(pinned_cores(), settings.intra_op_threads, settings.inter_op_threads)
    os.environ[WORKER_SERVER_ENV] = json.dumps({"virtual_devices": settings.virtual_devices,
                                                "intra_op": threads.intra_op, "inter_op": threads.inter_op})
    return run_child(command_line(command), role="worker task's")


def server_settings() -> Tuple[Optional[int], "WorkerThreads"]:
    """(virtual CPU devices or None, WorkerThreads) for a per-host task's own server, from WORKER_SERVER_ENV."""
    from dapple_tf.cluster.servers import WorkerThreads

    settings = json.loads(os.environ.get(WORKER_SERVER_ENV) or "{}")
    threads = WorkerThreads(settings.get("intra_op", 0), settings.get("inter_op", 0))
    return settings.get("virtual_devices") or None, threads


def run_chief(cluster, command: Sequence[str]) -> int:
    """Runs the chief command; with the chief's address in TF_CONFIG, holds the lease the workers watch."""
    from dapple_tf.cluster.chief_lease import ChiefLease
    from dapple_tf.cluster.launch_local import command_line, run_child

    args = command_line(command)
    if not cluster.chief:
        print('dapple_launch: TF_CONFIG names no chief address ("cluster": {"chief": ["host:port"]}): the workers '
              "will not end when this chief does", file=sys.stderr, flush=True)
        os.execvp(args[0], args)
    with ChiefLease(cluster.chief) as lease:
        print(f"dapple_launch: the chief's workers watch it at {cluster.chief}", flush=True)
        code = run_child(args)
        lease.release(code)
    return code


def serve(cluster, settings: WorkerSettings) -> int:
    """A worker: starts its server and serves until its chief ends (or for ever, with no chief address)."""
    from dapple_tf.cluster.servers import start_server, usable_cores

    threads = worker_threads(pinned_cores(), settings.intra_op_threads, settings.inter_op_threads)
    server = start_server(cluster, settings.virtual_devices or None, threads)
    cores = list(usable_cores())
    where = f"{cluster.describe_task(cluster.task_index)}"
    print(f"worker task {cluster.task_index} serving at {cluster.workers[cluster.task_index]} "
          f"(target {server.target}; cores {cores}, threads intra {threads.intra_op} inter {threads.inter_op})",
          flush=True)
    if cluster.chief:
        threading.Thread(target=end_with_chief, args=(cluster.chief, where, settings), daemon=True).start()
    else:
        print(f"{where}: TF_CONFIG names no chief address: serving until stopped", flush=True)
    server.join()
    return 0


def end_with_chief(chief: str, where: str, settings: WorkerSettings) -> None:
    """Ends this worker's process when its chief ends or is lost (the server's join cannot be interrupted)."""
    from dapple_tf.cluster.chief_lease import watch_chief

    outcome = watch_chief(chief, connect_timeout_s=settings.chief_wait_timeout_s, silence_s=settings.failure_timeout_s)
    print(f"{where}: {outcome.reason}: exiting", file=sys.stdout if outcome.exit_code == 0 else sys.stderr,
          flush=True)
    os._exit(outcome.exit_code)  # pylint: disable=protected-access


@dataclasses.dataclass(frozen=True)
class JobSpecSettings:
    """What `dapple_launch --emit` writes: the spec's kind and its job's name, image, port and restarts."""

    kind: str  # k8s or slurm
    name: str = "dapple"
    image: Optional[str] = None
    port: int = 2222
    k8s_kind: str = "pods"
    max_restarts: int = 3
    per_host: bool = False  # every worker task runs the command (per-host training), no chief


def emit_spec(cluster_name: Optional[str], command: Sequence[str], spec: JobSpecSettings,
              output: Optional[str] = None) -> int:
    """Writes the job spec that runs `command` as the chief of the cluster (a file or preset; `spec.per_host`: in
    every worker task) to `output`
    (stdout when empty)."""
    from planner.formats.cluster import load_cluster
    from dapple_tf.cluster import job_specs

    if not cluster_name:
        raise ValueError("--emit needs --cluster (a cluster file or preset: its servers become worker tasks)")
    if not command:
        raise ValueError("--emit needs the command after `--`, e.g. -- dapple_train --model=bert ...")
    cluster = load_cluster(cluster_name)
    cpu = cluster.device_kind.upper() == "CPU"
    gpus = 0 if cpu else cluster.devices_per_server
    cpu_devices = cluster.devices_per_server if cpu else 0
    if spec.kind == "k8s":
        if not spec.image:
            raise ValueError("--emit=k8s needs --image (a container image with dapple_tf installed)")
        text = job_specs.kubernetes(spec.name, spec.image, cluster.num_servers, gpus, command, spec.port,
                                    spec.k8s_kind, cpu_devices, spec.max_restarts, spec.per_host)
    else:
        text = job_specs.slurm(spec.name, cluster.num_servers, gpus, command, spec.port, cpu_devices,
                               spec.max_restarts, spec.per_host)
    if output:
        with open(output, "w") as f:
            f.write(text)
        print(f"wrote {output}: {cluster.num_servers} worker tasks"
              + (", each running the command (per host)" if spec.per_host else " and a chief"))
    else:
        sys.stdout.write(text)
    return 0


def launch_local_cluster(local_spec: str, command: Sequence[str], argv: Sequence[str], isolate_network: bool = True,
                         grace_s: float = 10.0, cores_per_worker: Optional[int] = None,
                         intra_op_threads: Optional[int] = None, inter_op_threads: Optional[int] = None,
                         per_host: bool = False) -> int:
    """Runs `command` as the chief of a local cluster `local:TASKSxDEVICES` (`per_host`: in every worker task
    instead); `argv` (this program's arguments) re-runs it in a private network namespace when
    `isolate_network`. Returns the chief's exit code (per host: 0 when every task's is)."""
    from planner.formats.cluster import parse_local_tasks
    from dapple_tf.cluster import launch_local
    from dapple_tf.cluster.servers import usable_cores

    tasks, devices = parse_local_tasks(local_spec)
    launch_local.command_line(command)  # a bad command fails before anything starts
    if isolate_network:
        launch_local.reexec_in_private_network(argv)
    cores = launch_local.default_cores_per_worker(tasks) if cores_per_worker is None else cores_per_worker
    threads = worker_threads(min(cores, len(usable_cores())), intra_op_threads, inter_op_threads)
    code = launch_local.run_local(tasks, devices, command, grace_s=grace_s, cores_per_worker=cores, threads=threads,
                                  per_host=per_host)
    if code:
        print(RESUME_HINT, file=sys.stderr, flush=True)
    return code
