"""Cluster descriptions (planner/formats/plan.proto's Cluster): the paper's presets, this machine's
virtual CPU devices, and cluster files.

Constants (bytes, bytes/s) and why:
- V100_MEMORY_BYTES = 15 GiB: a V100 has 16 GiB of HBM2 (nvidia-smi reports 16160 MiB);
  about 1 GiB goes to the CUDA context, cuDNN workspace and allocator fragmentation.
- NVLINK_BANDWIDTH = 130e9: the DAPPLE paper (section 6.2) quotes "up to 130GB/s" intra-server
  bandwidth for its 8x V100 NVLink servers (the NCCL ring AllReduce bus bandwidth of a DGX-1).
  The same figure is used for point-to-point activation transfers inside a server.
- ETHERNET_25G = 25e9 / 8 and ETHERNET_10G = 10e9 / 8: the paper's line rates (Table 2),
  undiscounted. How they are shared (planner/planning/cost_model.py): gradient AllReduce across servers
  goes through one link per server (hierarchical: the server's devices share it), which is what
  makes the paper's 8:8 beat DP for GNMT-16 and BERT-48 on config A (with a link per device DP
  wins both); activation transfers between stages give every device pair its own link at this
  bandwidth, as the paper's ACR values imply (Options.link_contention=True shares them instead).
- Local CPU devices: one server; memory = physical memory / number of devices (or given);
  LOCAL_BANDWIDTH = 10e9 (an in-process memcpy between virtual devices).
- Local worker tasks ("local:TxD", what dapple_launch starts): T servers of D virtual CPU devices;
  LOOPBACK_GRPC_BANDWIDTH = 1e9 between tasks (tensors serialized through gRPC on loopback).
"""

from __future__ import annotations

import os
from typing import Optional

from planner.formats import plan_pb2, read_message

GIB = float(1 << 30)
V100_MEMORY_BYTES = 15 * GIB
NVLINK_BANDWIDTH = 130e9
ETHERNET_25G = 25e9 / 8
ETHERNET_10G = 10e9 / 8
LOCAL_BANDWIDTH = 10e9
LOOPBACK_GRPC_BANDWIDTH = 1e9
DEFAULT_DEVICES = 16

# name -> (devices per server, inter-server bandwidth)
PRESETS = {
    "paper_a": (8, ETHERNET_25G),
    "paper_b": (1, ETHERNET_25G),
    "paper_c": (1, ETHERNET_10G),
}


class ClusterError(ValueError):
    """An invalid cluster description."""


def task_device_names(num_servers: int, devices_per_server: int, device_type: str = "GPU"):
    """Server s is TF worker task s: "/job:worker/replica:0/task:s/device:TYPE:d"."""
    return [
        f"/job:worker/replica:0/task:{s}/device:{device_type}:{d}"
        for s in range(num_servers)
        for d in range(devices_per_server)
    ]


def gpu_device_names(num_servers: int, devices_per_server: int):
    return task_device_names(num_servers, devices_per_server, "GPU")


def make_cluster(name, num_servers, devices_per_server, device_memory_bytes, intra_server_bandwidth,
                 inter_server_bandwidth, device_names=None, device_kind="") -> plan_pb2.Cluster:
    cluster = plan_pb2.Cluster(
        name=name, num_servers=num_servers, devices_per_server=devices_per_server,
        device_memory_bytes=device_memory_bytes, intra_server_bandwidth=intra_server_bandwidth,
        inter_server_bandwidth=inter_server_bandwidth, device_kind=device_kind,
    )
    cluster.device_names.extend(device_names or gpu_device_names(num_servers, devices_per_server))
    return validate_cluster(cluster)


def validate_cluster(cluster: plan_pb2.Cluster, path: str = "cluster") -> plan_pb2.Cluster:
    """Checks sizes and bandwidths are positive; fills device_names if empty."""
    if cluster.num_servers < 1 or cluster.devices_per_server < 1:
        raise ClusterError(f"{path}: num_servers and devices_per_server must be >= 1, "
                           f"got {cluster.num_servers} x {cluster.devices_per_server}")
    for field in ("device_memory_bytes", "intra_server_bandwidth", "inter_server_bandwidth"):
        if not getattr(cluster, field) > 0:
            raise ClusterError(f"{path}: {field} must be > 0, got {getattr(cluster, field)}")
    total = cluster.num_servers * cluster.devices_per_server
    if not cluster.device_names:
        cluster.device_names.extend(gpu_device_names(cluster.num_servers, cluster.devices_per_server))
    if len(cluster.device_names) != total:
        raise ClusterError(f"{path}: {len(cluster.device_names)} device_names for {total} devices")
    return cluster


def preset_cluster(name: str, num_servers: Optional[int] = None) -> plan_pb2.Cluster:
    """The paper's Table 2 configurations: paper_a (8x V100 NVLink servers, 25 Gbps),
    paper_b (1x V100 servers, 25 Gbps), paper_c (1x V100 servers, 10 Gbps).

    num_servers defaults to 16 devices in all (2 servers for paper_a, 16 for b and c).
    """
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset {name!r}; expected one of {', '.join(PRESETS)}")
    per_server, inter = PRESETS[name]
    if num_servers is None:
        num_servers = DEFAULT_DEVICES // per_server
    if num_servers < 1:
        raise ClusterError(f"--num_servers must be >= 1, got {num_servers}")
    return make_cluster(name, num_servers, per_server, V100_MEMORY_BYTES, NVLINK_BANDWIDTH, inter,
                        device_kind="V100-16GB")


def _memory_share(num_devices: int) -> float:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * GIB
    return float(total) / num_devices


def local_cluster(num_devices: int, memory_bytes: Optional[float] = None) -> plan_pb2.Cluster:
    """This machine's `num_devices` virtual CPU devices ("/device:CPU:i") on one server."""
    if num_devices < 1:
        raise ClusterError(f"--num_devices must be >= 1, got {num_devices}")
    memory_bytes = _memory_share(num_devices) if memory_bytes is None else memory_bytes
    return make_cluster("local", 1, num_devices, float(memory_bytes), LOCAL_BANDWIDTH, LOCAL_BANDWIDTH,
                        device_names=[f"/device:CPU:{i}" for i in range(num_devices)], device_kind="CPU")


def parse_local_tasks(text: str) -> tuple:
    """"local:3x2" -> (3, 2): worker tasks on this machine and virtual CPU devices in each."""
    shape = text[len("local:"):] if text.startswith("local:") else ""
    tasks, sep, devices = shape.partition("x")
    if not (sep and tasks.isdigit() and devices.isdigit() and int(tasks) >= 1 and int(devices) >= 1):
        raise ClusterError(f"{text!r}: a local cluster is local:TASKSxDEVICES, e.g. local:3x2")
    return int(tasks), int(devices)


def local_task_cluster(num_tasks: int, devices_per_task: int, memory_bytes: Optional[float] = None) -> plan_pb2.Cluster:
    """`num_tasks` worker processes on this machine with `devices_per_task` virtual CPU devices each
    ("/job:worker/replica:0/task:s/device:CPU:d"); transfers between tasks cross loopback gRPC."""
    total = num_tasks * devices_per_task
    memory_bytes = _memory_share(total) if memory_bytes is None else memory_bytes
    cluster = make_cluster(f"local:{num_tasks}x{devices_per_task}", num_tasks, devices_per_task, float(memory_bytes),
                           LOCAL_BANDWIDTH, LOOPBACK_GRPC_BANDWIDTH, device_names=task_device_names(
                               num_tasks, devices_per_task, "CPU"), device_kind="CPU")
    cluster.communication_uses_compute = True  # the workers' cores serialize and add what they exchange
    return cluster


def load_cluster(path_or_name: str, num_servers: Optional[int] = None, num_devices: Optional[int] = None,
                 memory_bytes: Optional[float] = None) -> plan_pb2.Cluster:
    """A preset name (paper_a/b/c), "local" (num_devices, default 2), "local:TxD" (T local worker
    tasks of D devices), or a .pbtxt/.json/.pb file."""
    if path_or_name in PRESETS:
        return preset_cluster(path_or_name, num_servers)
    if path_or_name == "local":
        return local_cluster(num_devices or 2, memory_bytes)
    if path_or_name.startswith("local:"):
        return local_task_cluster(*parse_local_tasks(path_or_name), memory_bytes=memory_bytes)
    if not os.path.splitext(path_or_name)[1]:
        raise ClusterError(f"unknown cluster {path_or_name!r}; expected paper_a, paper_b, paper_c, local, "
                           "local:TASKSxDEVICES or a cluster file (.pbtxt/.json/.pb)")
    cluster = read_message(path_or_name, plan_pb2.Cluster)
    return validate_cluster(cluster, path_or_name)


def num_devices(cluster: plan_pb2.Cluster) -> int:
    return cluster.num_servers * cluster.devices_per_server


def server_of(cluster: plan_pb2.Cluster, device_id: int) -> int:
    """Device ids are server-major: device i lives on server i // devices_per_server."""
    return device_id // cluster.devices_per_server
