"""A TensorFlow cluster for the pipelined graph: TF_CONFIG, worker servers, the client's session.

DAPPLE's runtime is in-graph replication: one client (the chief) builds the whole pipelined graph
and runs it through a session on worker task 0; every worker task is a `tf.distribute.Server`
that executes its part. Server s of a plan is worker task s, its devices
"/job:worker/replica:0/task:s/device:GPU:d" (CPU:d where a task has no GPU).

What TensorFlow needs for collectives across tasks is set here and only here: every server's own
ConfigProto names task 0 as the collective group leader (set only in the client it does nothing,
and the first step hangs), and the client's session bounds every operation by a timeout (a
stopped or killed master otherwise hangs the client forever).

Threads and cores (`WorkerThreads`): a worker pinned to c cores runs c intra-op threads (one per
core: a kernel's own parallelism) and c + 1 inter-op threads, so that one thread is left to
receive, send and start the next task while the others compute (with a single inter-op thread a
pipeline stage overlaps nothing: measured in WORKSPACE_NOTES.md, "Speed"). 0 keeps TF's default.

TF_CONFIG is TensorFlow's usual JSON: {"cluster": {"worker": ["host:port", ...]}, "task":
{"type": "worker" | "chief", "index": i}}. A chief runs no TF server; a "chief" entry in "cluster"
(["host:port"], as Kubeflow writes it) is where the chief's process tells the workers it is alive
(chief_lease.py), so that workers end with their chief.
"""

import dataclasses
import json
import os
import socket
import time
from typing import Dict, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError

JOB = "worker"
GROUP_LEADER = f"/job:{JOB}/replica:0/task:0"
ROLES = ("worker", "chief")


class ClusterError(DappleError):
    """A cluster that is misdescribed, not reachable, or lost a task while training."""


def parse_address(text: str, where: str = "address") -> Tuple[str, int]:
    """'host:port' -> (host, port); a clear error for anything else."""
    if not isinstance(text, str) or ":" not in text:
        raise ClusterError(f"{where}: {text!r} is not host:port")
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"{where}: {text!r} is not host:port with a port in 1..65535")
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class TFCluster:
    """The worker tasks' addresses and this process's role in the cluster."""

    workers: Tuple[str, ...]
    task_type: str = "chief"
    task_index: int = 0
    chief: Optional[str] = None

    def __post_init__(self):
        if not self.workers:
            raise ClusterError("the cluster names no worker task")
        for i, address in enumerate(self.workers):
            parse_address(address, f"worker task {i}")
        if len(set(self.workers)) != len(self.workers):
            raise ClusterError(f"two worker tasks share an address: {list(self.workers)}")
        if self.chief is not None:
            parse_address(self.chief, "the chief")
            if self.chief in self.workers:
                raise ClusterError(f"the chief's address {self.chief} is also worker task "
                                   f"{self.workers.index(self.chief)}'s")
        if self.task_type not in ROLES:
            raise ClusterError(f"task type {self.task_type!r} is not one of {ROLES}")
        if self.task_type == "worker" and not 0 <= self.task_index < len(self.workers):
            raise ClusterError(
                f"this task is worker {self.task_index} but the cluster has worker tasks 0..{len(self.workers) - 1}"
            )

    @classmethod
    def from_tf_config(cls, text: Optional[str] = None) -> "TFCluster":
        """Reads TF_CONFIG (the environment variable when `text` is None)."""
        text = os.environ.get("TF_CONFIG", "") if text is None else text
        if not text.strip():
            raise ClusterError("TF_CONFIG is not set: it names the cluster's worker tasks and this task")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterError(f"TF_CONFIG is not JSON: {e}") from None
        cluster, task = config.get("cluster"), config.get("task")
        if not isinstance(cluster, dict) or not isinstance(cluster.get(JOB), list):
            raise ClusterError('TF_CONFIG needs "cluster": {"worker": ["host:port", ...]}')
        if not isinstance(task, dict) or "type" not in task:
            raise ClusterError('TF_CONFIG needs "task": {"type": "worker" or "chief", "index": i}')
        index = task.get("index", 0)
        if not isinstance(index, int):
            raise ClusterError(f"TF_CONFIG task index must be an integer, got {index!r}")
        chief = cluster.get("chief")
        if chief is not None and not (isinstance(chief, list) and len(chief) == 1):
            raise ClusterError(f'TF_CONFIG "chief" must list one "host:port", got {chief!r}')
        return cls(tuple(cluster[JOB]), task["type"], index, chief[0] if chief else None)

    def tf_config(self, task_type: str, task_index: int = 0) -> str:
        """The TF_CONFIG JSON of one task of this cluster."""
        spec = {JOB: list(self.workers), **({"chief": [self.chief]} if self.chief else {})}
        return json.dumps({"cluster": spec, "task": {"type": task_type, "index": task_index}})

    @property
    def target(self) -> str:
        """The session target: worker task 0's master service."""
        return f"grpc://{self.workers[0]}"

    def describe_task(self, index: int) -> str:
        return f"worker task {index} ({self.workers[index]})"

    def device(self, task: int, device_type: str, index: int) -> str:
        return f"/job:{JOB}/replica:0/task:{task}/device:{device_type}:{index}"


@dataclasses.dataclass(frozen=True)
class WorkerThreads:
    """A worker's TF thread pools (0: TF's default, one thread per core the process may use)."""

    intra_op: int = 0
    inter_op: int = 0

    @classmethod
    def for_cores(cls, cores: int) -> "WorkerThreads":
        """The defaults for a worker pinned to `cores` cores (module docstring); 0 cores: TF's defaults."""
        return cls(cores, cores + 1) if cores > 0 else cls()

    def apply(self, config: tf.compat.v1.ConfigProto) -> tf.compat.v1.ConfigProto:
        config.intra_op_parallelism_threads = self.intra_op
        config.inter_op_parallelism_threads = self.inter_op
        return config


def split_cpu(num_devices: int) -> None:
    """Splits this process's CPU into `num_devices` virtual devices (/device:CPU:0..n-1); call it before
    TensorFlow initialises its devices."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)


def usable_cores() -> Tuple[int, ...]:
    """The cores this process may run on (all of them where the platform has no CPU affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def worker_cores(task: int, cores_per_worker: int, num_cores: Optional[int] = None) -> Tuple[int, ...]:
    """The cores of worker task `task` when each worker gets `cores_per_worker` consecutive cores
    (wrapping around when there are more workers than cores)."""
    usable = usable_cores()
    usable = usable[:num_cores] if num_cores else usable
    return tuple(usable[(task * cores_per_worker + k) % len(usable)] for k in range(cores_per_worker))


def server_config(num_cpu_devices: Optional[int] = None,
                  threads: WorkerThreads = WorkerThreads()) -> tf.compat.v1.ConfigProto:
    """The ConfigProto every worker server starts with (group leader; CPU devices if given; thread pools)."""
    config = threads.apply(tf.compat.v1.ConfigProto())
    if num_cpu_devices:
        config.device_count["CPU"] = num_cpu_devices
    config.experimental.collective_group_leader = GROUP_LEADER
    return config


def session_config(timeout_s: float) -> tf.compat.v1.ConfigProto:
    """The client's ConfigProto: every operation ends within `timeout_s` (0: no bound)."""
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(timeout_s * 1000), allow_soft_placement=False)
    config.experimental.collective_group_leader = GROUP_LEADER
    return config


def check_port_free(address: str, where: str) -> None:
    """Raises ClusterError if this host cannot listen on the address's port."""
    _, port = parse_address(address, where)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as e:
            raise ClusterError(f"{where} {address}: port {port} is in use on this host ({e.strerror})") from None


def start_server(cluster: TFCluster, num_cpu_devices: Optional[int] = None,
                 threads: WorkerThreads = WorkerThreads()) -> tf.distribute.Server:
    """Starts this process's worker server (cluster.task_type must be "worker")."""
    if cluster.task_type != "worker":
        raise ClusterError(f"only worker tasks run a server; this task is {cluster.task_type!r}")
    where = cluster.describe_task(cluster.task_index)
    check_port_free(cluster.workers[cluster.task_index], where)
    spec = tf.train.ClusterSpec({JOB: list(cluster.workers)})
    try:
        return tf.distribute.Server(
            spec, job_name=JOB, task_index=cluster.task_index, config=server_config(num_cpu_devices, threads), start=True
        )
    except (tf.errors.OpError, RuntimeError) as e:
        raise ClusterError(f"{where}: the server did not start: {e}") from None


def free_ports(count: int, host: str = "127.0.0.1") -> Tuple[int, ...]:
    """`count` distinct ports that were free on `host` a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return tuple(s.getsockname()[1] for s in sockets)
    finally:
        for s in sockets:
            s.close()


def probe_task(address: str, timeout_s: float = 3.0) -> Optional[str]:
    """None if the task's server answers an RPC within the timeout, else why not."""
    import grpc

    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        return f"unreachable ({e.strerror or e})"
    channel = grpc.insecure_channel(address)
    try:
        channel.unary_unary("/tensorflow.WorkerService/GetStatus")(b"", timeout=timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"not answering within {timeout_s:g} s (stopped or overloaded)"
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return f"unavailable ({e.details()})"
    finally:
        channel.close()
    return None


def wait_for_workers(cluster: TFCluster, timeout_s: float, poll_s: float = 0.5,
                     tasks: Optional[Sequence[int]] = None) -> None:
    """Waits until every worker task (or those of index `tasks`) answers, or raises ClusterError naming those that
    do not."""
    indices = range(len(cluster.workers)) if tasks is None else tasks
    deadline = time.monotonic() + timeout_s
    while True:
        down = {i: probe_task(cluster.workers[i], timeout_s=min(3.0, max(0.5, timeout_s))) for i in indices}
        down = {i: why for i, why in down.items() if why}
        if not down:
            return
        if time.monotonic() >= deadline:
            names = "; ".join(f"{cluster.describe_task(i)}: {why}" for i, why in down.items())
            raise ClusterError(f"after waiting {timeout_s:g} s, these worker tasks are not up: {names}")
        time.sleep(poll_s)


def failed_tasks(cluster: TFCluster) -> Dict[int, str]:
    """Task index -> why it does not answer, for the tasks that do not."""
    down = {i: probe_task(a) for i, a in enumerate(cluster.workers)}
    return {i: why for i, why in down.items() if why}


def cluster_devices(cluster: TFCluster, timeout_s: float) -> Tuple[str, ...]:
    """Every device of the cluster's worker tasks (canonical names), as the master lists them."""
    with tf.Graph().as_default(), tf.compat.v1.Session(cluster.target, config=session_config(timeout_s)) as sess:
        return tuple(sorted(d.name for d in sess.list_devices() if f"/job:{JOB}/" in d.name))


def map_devices(devices: Sequence[str], available: Sequence[str]) -> Tuple[str, ...]:
    """The plan's devices on the cluster: as named, or CPU:d for GPU:d on a task without GPUs.

    Raises ClusterError listing the devices the cluster does not have.
    """
    have = set(available)
    gpu_tasks = {d.rsplit("/device:", 1)[0] for d in available if "/device:GPU:" in d}
    mapped, missing = [], []
    for device in devices:
        task, _, kind = device.rpartition("/device:")
        if device not in have and kind.startswith("GPU:") and task not in gpu_tasks:
            device = f"{task}/device:CPU:{kind.split(':', 1)[1]}"
        (mapped if device in have else missing).append(device)
    if missing:
        raise ClusterError(f"the plan uses devices that are not available here: {missing}; available: {sorted(have)}")
    return tuple(mapped)
