"""Gradient AllReduce across the devices that hold copies of the same variables.

TF collective ops (`collective_ops.all_reduce`): NCCL on GPUs, ring on CPUs of one process
(virtual CPU devices). Across processes on CPUs, the sum is built from the graph's own transfers
instead (`exchange_sum`: each tensor, or pack of small ones, summed on one owner device, read by the
others): TF's
collective ring over gRPC moved 33 MB between two local pinned workers in 76 ms, the plain tensor
transfers that carry activations between stages in 26 ms (WORKSPACE_NOTES.md, "Speed"); every
device also gets bit-identical sums. For collectives, gradients of one device set and dtype are
flattened into one buffer, reduced once, and cut back into shapes.
"""

import zlib
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from dapple_tf.rewrite.update import halving_exchange
from planner.formats.program import slice_sizes


class CollectiveKeys:
    """Keys for the collectives of one build_pipeline call.

    A group key names a device set (the same set always gets the same key: a CRC of the names);
    instance keys start at the graph's operation count when the build began, so builds in one
    graph never share one (each build adds more operations than it uses instance keys).
    """

    def __init__(self, graph: tf.Graph):
        self._next_instance = len(graph.get_operations()) + 1

    @classmethod
    def counted_alike(cls, description: str) -> "CollectiveKeys":
        """Keys that every task's graph counts alike (per-host graphs: every task allocates them in the same order)
        from a start derived from `description`, in [2**29, 2**30): apart from the counted keys of a graph (from its
        operation count) and from named keys (`shared_instance_key`). A worker keeps what it resolved for a group's
        instance key across sessions, so another build on the same servers that all-reduces other shapes must not
        reuse its keys (the worker's collectives then fail for good): a description of what is all-reduced (devices,
        shapes) gives it another start."""
        keys = cls.__new__(cls)
        keys._next_instance = 0x20000000 + (zlib.crc32(description.encode()) & 0x0FFFFFFF)
        return keys

    @staticmethod
    def group_key(devices: Sequence[str]) -> int:
        return zlib.crc32(",".join(devices).encode()) & 0x7FFFFFFF or 1

    def instance_key(self) -> int:
        return self.instance_keys(1)

    @staticmethod
    def shared_instance_key(name: str) -> int:
        """An instance key every task's graph derives from the same `name` (per-host graphs), in a range apart from
        the counted keys (those start at a graph's operation count)."""
        return (zlib.crc32(name.encode()) & 0x3FFFFFFF) | 0x40000000

    def instance_keys(self, count: int) -> int:
        """The first of `count` consecutive unused instance keys."""
        self._next_instance += count
        return self._next_instance - count


def communication_hint(devices: Sequence[str]) -> str:
    return "nccl" if all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices) else "auto"


def uses_exchange(devices: Sequence[str]) -> bool:
    """True for device sets that `all_reduce_sum` reduces by `exchange_sum` in one graph: CPUs of several processes.
    (A per-host graph's lowering, hosts/lowering.py, chooses the exchange for every CPU group: TF's collectives across
    per-host sessions were not reliable; docs/design.md, per-host graphs.)"""
    tasks = set()
    for d in devices:
        spec = tf.DeviceSpec.from_string(d)
        tasks.add((spec.job, spec.replica, spec.task))
    return len(tasks) > 1 and communication_hint(devices) != "nccl"


class InProcess:
    """What `all_reduce_sum` and `gradients.reduce_and_pair` ask of the lowering (hosts/lowering.py) when given none:
    the choices of a graph that builds every device (the one graph), where every tensor is read where it is."""

    @staticmethod
    def built(devices: Sequence[str]) -> List[str]:
        """The devices of `devices` this graph builds: all of them."""
        return list(devices)

    @staticmethod
    def exchanges(devices: Sequence[str]) -> bool:
        """Whether `devices` sum by exchange_sum rather than TF's collectives."""
        return uses_exchange(devices)

    @staticmethod
    def instance_key(keys: "CollectiveKeys", devices: Sequence[str], name: str) -> int:
        """The instance key of a collective over `devices` (`name`: what every task's graph calls it)."""
        del devices, name
        return keys.instance_key()

    @staticmethod
    def move(tensor, source: str, target: str, key: str, dtype: tf.DType, shape: tf.TensorShape):
        """`tensor`, made on `source`, where `target` reads it: the tensor itself."""
        del source, target, key, dtype, shape
        return tensor


IN_PROCESS = InProcess()


# Gradients smaller than this travel packed with their neighbours: one transfer each would cost a round
# trip and the workers' CPU time per tensor (BERT's ~200 small gradients, measured in WORKSPACE_NOTES.md).
PACK_BYTES = 2**20


def _owners(sizes: Sequence[int], num_devices: int) -> List[int]:
    """A device index per tensor, largest tensors first to the least-loaded device (bytes balanced)."""
    load = [0] * num_devices
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(num_devices), key=lambda d: (load[d], d))
        load[owner[i]] += sizes[i]
    return owner


def _groups(tensors: Sequence[tf.Tensor], pack_bytes: int) -> List[List[int]]:
    """Indices of `tensors` in transfer groups: a tensor of at least `pack_bytes` alone, consecutive
    smaller ones packed together until a pack holds `pack_bytes`."""
    groups, pack, size = [], [], 0
    for i, t in enumerate(tensors):
        nbytes = t.shape.num_elements() * t.dtype.size
        if nbytes >= pack_bytes:
            groups.append([i])
            continue
        pack.append(i)
        size += nbytes
        if size >= pack_bytes:
            groups.append(pack)
            pack, size = [], 0
    return groups + [pack] if pack else groups


def _buffer(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return tensors[0] if len(tensors) == 1 else tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def _unpack(buffer: tf.Tensor, like: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    if len(like) == 1:
        return [tf.identity(buffer)]
    parts = tf.split(buffer, [t.shape.num_elements() for t in like])
    return [tf.reshape(p, t.shape) for p, t in zip(parts, like)]


def exchange_sum(grads_per_device: Dict[str, Optional[List[tf.Tensor]]], pack_bytes: int = PACK_BYTES,
                 transport=IN_PROCESS, key: str = "") -> Dict[str, List[tf.Tensor]]:
    """Element-wise sums of same-shaped tensor lists, one list per device, from plain cross-device reads.

    Tensors travel in groups (`_groups`: large ones alone, small ones packed, since every transfer costs
    a round trip and CPU time). Reduce-scatter by ownership: each group's buffer (one larger than an
    even share first cut along its first axis into one piece per device) is summed on one owner
    device, in one fixed order of devices, the owners' bytes balanced; every other device reads the
    owner's sum (all-gather). Each device sends and receives about (n - 1) / n of the bytes twice, like
    a ring, in one round each way; every device gets the same bits. Groups of three devices or more are
    summed by recursive halving and doubling instead (halving_exchange.py: a per-host graph's operations grow with
    the logarithm of the group's size).

    In a per-host graph the lists of other tasks' devices are None, and `transport` (its lowering: hosts/lowering.py)
    moves each piece to its owner and the sum back, through queues named from `key` where they cross tasks.
    """
    devices = sorted(grads_per_device)
    n = len(devices)
    local = [d for d in devices if grads_per_device[d] is not None]
    like = grads_per_device[local[0]]
    groups = _groups(like, pack_bytes)
    if n >= halving_exchange.HALVING_DEVICES:
        return _halving_sums(grads_per_device, groups, transport, key)
    buffers = {}
    for d in local:
        with tf.device(d):
            buffers[d] = [_buffer([grads_per_device[d][i] for i in g]) for g in groups]
    total = sum(b.shape.num_elements() for b in buffers[local[0]])
    rows = [tf.compat.dimension_value(b.shape[0]) if b.shape.rank else 0 for b in buffers[local[0]]]
    counts = [n if r and b.shape.num_elements() * n > total and r >= n else 1
              for b, r in zip(buffers[local[0]], rows)]
    pieces = {}
    for d in local:
        with tf.device(d):
            pieces[d] = [p for b, c, r in zip(buffers[d], counts, rows)
                         for p in (tf.split(b, list(slice_sizes(r, c))) if c > 1 else [b])]
    sums = {}  # (piece, device) -> the piece's sum on that device
    for k, o in enumerate(_owners([p.shape.num_elements() for p in pieces[local[0]]], n)):
        sums.update(_piece_sums(k, devices[o], devices, pieces, transport, key))
    result = {}
    for d in local:
        with tf.device(d):
            out, k = [None] * len(like), 0
            for g, c in zip(groups, counts):
                buffer = tf.concat([sums[(i, d)] for i in range(k, k + c)], axis=0) if c > 1 else sums[(k, d)]
                for i, t in zip(g, _unpack(buffer, [like[i] for i in g])):
                    out[i] = t
                k += c
            result[d] = out
    return result


def _halving_sums(grads_per_device: Dict[str, Optional[List[tf.Tensor]]], groups: List[List[int]], transport,
                  key: str) -> Dict[str, List[tf.Tensor]]:
    """exchange_sum by recursive halving and doubling, group by group (each starts when its gradients are made)."""
    like = next(t for t in grads_per_device.values() if t is not None)
    out = {d: [None] * len(like) for d, tensors in grads_per_device.items() if tensors is not None}
    for k, g in enumerate(groups):
        buffers = {}
        for d, tensors in grads_per_device.items():
            with tf.device(d):
                buffers[d] = None if tensors is None else tf.reshape(_buffer([tensors[i] for i in g]), [-1])
        for d, total in halving_exchange.halving_doubling_sum(buffers, transport, f"{key}/g{k}").items():
            with tf.device(d):
                parts = _unpack(total, [like[i] for i in g]) if len(g) > 1 else [tf.reshape(total, like[g[0]].shape)]
                for i, t in zip(g, parts):
                    out[d][i] = t
    return out


def _piece_sums(k: int, owner: str, devices: Sequence[str], pieces: Dict[str, List[tf.Tensor]], transport, key: str
                ) -> Dict[tuple, tf.Tensor]:
    """{(k, device): piece k's sum there} for the devices of this graph (`pieces`' keys), summed on `owner`: every
    device's piece moved to the owner, the sum moved back (`transport.move`)."""
    like = next(iter(pieces.values()))[k]

    def to_owner(d):  # device d's piece, where the owner reads it
        return transport.move(pieces[d][k] if d in pieces else None, d, owner, f"{key}/piece{k}/{d}", like.dtype,
                              like.shape)

    def from_owner(total, d):  # the sum, where device d reads it
        return transport.move(total, owner, d, f"{key}/sum{k}/{d}", like.dtype, like.shape)

    if owner in pieces:
        parts = [to_owner(d) for d in devices]
        with tf.device(owner):
            total = deterministic_sum(parts)
        back = {d: from_owner(total, d) for d in devices}
        return {(k, d): back[d] for d in pieces}
    out = {}
    for d in pieces:
        to_owner(d)
        out[(k, d)] = from_owner(None, d)
    return out


def deterministic_sum(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The same bits on every run. A chain of adds would not do: grappler turns it into one AddN, whose
    order of additions depends on which input buffer it can reuse, which depends on when each arrives
    from another process (two runs of a 3-device exchange differed in the last bit)."""
    if len(tensors) <= 2:
        return tensors[0] if len(tensors) == 1 else tf.add(tensors[0], tensors[1])  # a + b == b + a exactly
    return tf.reduce_sum(tf.stack(tensors), axis=0)


def ordered_sum(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """A sum of scalars in a fixed order (an AddN's order moves with when its inputs arrive): a loss's terms, sums of
    squares (hosts/task_sums.py sums them per task, then over the tasks)."""
    return tensors[0] if len(tensors) == 1 else tf.reduce_sum(tf.stack(list(tensors)))


def all_reduce_sum(
    grads_per_device: Dict[str, Optional[List[tf.Tensor]]], keys: CollectiveKeys, after: Dict[str, tf.Tensor] = None,
    cross_process_reduce: Optional[Callable[[tf.Tensor], tf.Tensor]] = None, lowering=IN_PROCESS, key: str = "",
) -> Dict[str, List[tf.Tensor]]:
    """Sums, element-wise across devices, lists of same-shaped tensors; one collective per call.

    `grads_per_device[d][i]` lives on device d; every device gets the list of sums. On device d
    the collective starts after `after[d]` (if given), so every device launches collectives in
    the same order. `cross_process_reduce`, if given, is applied once to the summed buffer (on the
    first device) and its result is what every device gets (hierarchical: in-process, then across).
    `lowering` (hosts/lowering.py; IN_PROCESS: one graph's) chooses between exchange_sum and TF's collectives and
    moves the exchange's tensors. In a per-host graph, other tasks' devices map to None: exchange_sum's queues join
    CPUs of several tasks (not TF's collectives: across the tasks' sessions, their first step failed one run in
    three in TF 2.15, "ValidateDevices called before initialization"); GPUs of several tasks (NCCL) join by a
    collective whose instance key every task derives from `key`.
    """
    after = after or {}
    devices = sorted(grads_per_device)
    if cross_process_reduce is not None:
        return _reduce_across_processes(grads_per_device, keys, after, cross_process_reduce)
    if len(devices) == 1:
        return dict(grads_per_device)
    if lowering.exchanges(devices):
        started = {}
        for device in devices:
            with tf.device(device), tf.control_dependencies([after[device]] if device in after else []):
                grads = grads_per_device[device]
                started[device] = None if grads is None else [tf.identity(g) for g in grads]
        return exchange_sum(started, transport=lowering, key=key)
    group_key = keys.group_key(devices)
    instance_key = lowering.instance_key(keys, devices, key)
    local = [d for d in devices if grads_per_device[d] is not None]
    shapes = [g.shape for g in grads_per_device[local[0]]]
    sizes = [s.num_elements() for s in shapes]
    result = {}
    for device in local:
        with tf.device(device), tf.control_dependencies([after[device]] if device in after else []):
            flat = tf.concat([tf.reshape(g, [-1]) for g in grads_per_device[device]], axis=0)
            summed = collective_ops.all_reduce(
                flat, len(devices), group_key, instance_key, "Add", "Id", communication_hint=communication_hint(devices)
            )
            result[device] = [tf.reshape(p, s) for p, s in zip(tf.split(summed, sizes), shapes)]
    return result


def _reduce_across_processes(grads_per_device, keys, after, cross_process_reduce):
    devices = sorted(grads_per_device)
    first = devices[0]
    if len(devices) > 1:
        in_process = all_reduce_sum(grads_per_device, keys, after)
    else:
        in_process = dict(grads_per_device)
    shapes = [g.shape for g in in_process[first]]
    with tf.device(first):
        flat = tf.concat([tf.reshape(g, [-1]) for g in in_process[first]], axis=0)
        total = cross_process_reduce(flat)
    result = {}
    for device in devices:
        # Every device's collective must run even though only the first one's sum is read.
        with tf.device(device), tf.control_dependencies([in_process[device][0]]):
            parts = tf.split(tf.identity(total), [s.num_elements() for s in shapes])
            result[device] = [tf.reshape(p, s) for p, s in zip(parts, shapes)]
    return result
