"""Gradients of the variables: accumulated over micro-batches per device, then all-reduced.

`GradientAccumulator` keeps, per (variable, device), a running sum of the gradients the
device's backward tasks produce (one live copy, not M). A variable only ever read by gathers
(embedding lookups) also gets a running count of the rows each gather touched, so that the
reduced gradient can be applied as IndexedSlices of exactly those rows: lazy optimizers
(Momentum, RMSProp, ...) then update the same rows as single-device `minimize` does.

`reduce_and_pair` all-reduces each (device set, dtype) group in buckets of about `bucket_bytes`
(planner.formats.constants.ALLREDUCE_BUCKET_BYTES by default, which the cost model assumes too), in the order the last micro-batch's backward
produces the gradients (the variables whose gradient ops were created first, i.e. the last layers,
first), one bucket after another on every device. A bucket's collective depends only on its own
gradients, so it runs while the backward of earlier layers still computes (backward/AllReduce
overlap: tests/test_planner_overlap.py measures it, planner.planning.cost_model.allreduce_tail_ms models it).
The apply step waits for every bucket of the device set. The sums are paired with every copy of the
variable for the apply step.
"""

from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from dapple_tf.rewrite.update import collectives
from dapple_tf.rewrite.update.replicas import StaleCopyCheck, VariableCopies
from planner.formats.constants import ALLREDUCE_BUCKET_BYTES

Key = Tuple[tf.Variable, str]  # (variable, device)


class GradientAccumulator:
    def __init__(self, square_sparse: bool = False):
        """square_sparse: also keep, per key summed from gathered rows alone, the sum of the squares of every
        gradient's rows (what tf.clip_by_global_norm counts of IndexedSlices: `sparse_squares`)."""
        self._square_sparse = square_sparse
        self.sparse_squares: Dict[Key, tf.Tensor] = {}
        self.sums: Dict[Key, tf.Tensor] = {}
        self.row_counts: Dict[Key, tf.Tensor] = {}  # for keys whose every gradient so far was sparse
        self._dense: set = set()  # keys that got a dense gradient at least once
        self.last_gradient: Dict[Key, tf.Tensor] = {}  # the latest micro-batch's gradient (its ops' creation order)
        # keys summed from dense gradients alone: each backward task's gradient and the additions of the running sum
        self.parts: Dict[Key, List[tf.Tensor]] = {}
        self.sum_ops: Dict[Key, List[tf.Operation]] = {}

    def add(self, variable: tf.Variable, device: str, grad) -> None:
        """Adds one backward task's gradient (a Tensor or IndexedSlices) on `device`."""
        key = (variable, device)
        if isinstance(grad, tf.IndexedSlices) and key not in self._dense:
            rows = tf.compat.dimension_value(variable.shape[0])
            counts = tf.math.unsorted_segment_sum(
                tf.ones_like(grad.indices, dtype=variable.dtype.base_dtype), grad.indices, rows
            )
            self.row_counts[key] = counts if key not in self.row_counts else self.row_counts[key] + counts
            if self._square_sparse:
                squares = tf.reduce_sum(tf.square(grad.values))
                self.sparse_squares[key] = squares if key not in self.sparse_squares else \
                    self.sparse_squares[key] + squares
        else:
            self._dense.add(key)
            self.row_counts.pop(key, None)
            self.sparse_squares.pop(key, None)
        dense = tf.convert_to_tensor(grad)
        dense.set_shape(variable.shape)  # gradients through control flow may lose it
        self.last_gradient[key] = dense
        if key not in self.sums:
            self.sums[key] = dense
            self.parts[key], self.sum_ops[key] = [dense], []
        else:
            self.sums[key] = self.sums[key] + dense
            if key in self.parts:
                self.parts[key].append(dense)
                self.sum_ops[key].append(self.sums[key].op)
        if isinstance(grad, tf.IndexedSlices):
            self.parts.pop(key, None)
            self.sum_ops.pop(key, None)

    def running_sum(self, variable: tf.Variable, device: str):
        """The dense sum so far of `variable`'s gradients on `device` (None before the first, or while sparse)."""
        key = (variable, device)
        return self.sums.get(key) if key in self._dense else None

    def set_sum(self, variable: tf.Variable, device: str, total: tf.Tensor) -> None:
        """Records `total` (the running sum plus one backward task's dense gradient, added by the caller)."""
        key = (variable, device)
        self._dense.add(key)
        self.row_counts.pop(key, None)
        self.sparse_squares.pop(key, None)
        self.parts.pop(key, None)
        self.sum_ops.pop(key, None)
        total.set_shape(variable.shape)
        self.last_gradient[key] = total
        self.sums[key] = total

    def replace_sum(self, key: Key, total: tf.Tensor) -> None:
        """Makes `total` the sum of `key`'s dense gradients (computed otherwise than by adding its parts up)."""
        if key not in self.parts:
            raise ValueError(f"{key[0].name} on {key[1]}: no dense per-task gradients to replace")
        total.set_shape(key[0].shape)
        self.sums[key] = self.last_gradient[key] = total
        self.parts.pop(key, None)
        self.sum_ops.pop(key, None)

    def devices_of(self) -> Dict[tf.Variable, Tuple[str, ...]]:
        result: Dict[tf.Variable, Tuple[str, ...]] = {}
        for variable, device in self.sums:
            result[variable] = result.get(variable, ()) + (device,)
        return {v: tuple(sorted(d)) for v, d in result.items()}

    def is_sparse(self, variable: tf.Variable, devices) -> bool:
        return all((variable, d) in self.row_counts for d in devices)

    def squares_of_sparse(self) -> Dict[tf.Variable, Dict[str, tf.Tensor]]:
        """Variable -> device -> the sum of the squares of its gathered rows there, for variables whose every
        gradient on every device was gathered rows (square_sparse=True)."""
        out: Dict[tf.Variable, Dict[str, tf.Tensor]] = {}
        for variable, devices in self.devices_of().items():
            if all((variable, d) in self.sparse_squares for d in devices):
                out[variable] = {d: self.sparse_squares[(variable, d)] for d in devices}
        return out


def _as_slices(dense: tf.Tensor, counts: tf.Tensor) -> tf.IndexedSlices:
    rows = tf.reshape(tf.where(counts > 0), [-1])
    return tf.IndexedSlices(tf.gather(dense, rows), rows, dense_shape=tf.shape(dense, out_type=tf.int64))


def _identity_after(grad, deps):
    with tf.control_dependencies(deps):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices), grad.dense_shape)
        return tf.identity(grad)


def _buckets(group: List[tf.Variable], accumulator: GradientAccumulator, device: str, bucket_bytes: float,
             position: Dict[tf.Operation, int]) -> List[List[tf.Variable]]:
    """`group` in backward order (by the creation of each variable's last gradient op on `device`),
    cut into consecutive buckets of at least `bucket_bytes` (the last one may be smaller)."""
    ordered = sorted(group, key=lambda v: position[accumulator.last_gradient[(v, device)].op])
    buckets, current, size = [], [], 0
    for v in ordered:
        current.append(v)
        size += v.shape.num_elements() * v.dtype.base_dtype.size
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


def _exchange_key(devices, dtype: tf.DType, bucket: int) -> str:
    """The queue names' prefix of a bucket's exchange in per-host graphs: the same on every task."""
    return f"dapple/exchange/{collectives.CollectiveKeys.group_key(devices)}/{dtype.name}/b{bucket}"


def _uses_collective_ops(devices: Tuple[str, ...], cross_process_reduce, lowering) -> bool:
    """Whether all_reduce_sum reduces the device set with TF collective ops (not the graph's own transfers)."""
    return len(devices) > 1 and not (cross_process_reduce is None and lowering.exchanges(devices))


def _first_waits(check: StaleCopyCheck, devices: List[str], whole: bool) -> Dict[str, tf.Operation]:
    """Per device, what its first reduction waits for: the whole stale-copy check (`whole`: TF collective ops run),
    else its own comparing (nothing where it holds no copies)."""
    waits = {}
    for d in devices:
        if whole:
            waits[d] = check.after_all(d)
        elif d not in check.by_device:
            with tf.device(d), tf.control_dependencies(None):
                waits[d] = tf.no_op(name="dapple_no_copies")
        else:
            waits[d] = check.by_device[d]
    return waits


def reduce_and_pair(accumulator: GradientAccumulator, copies: VariableCopies, keys: collectives.CollectiveKeys,
                    cross_process_reduce=None, bucket_bytes: Optional[float] = None,
                    start_after: Optional[StaleCopyCheck] = None, lowering=collectives.IN_PROCESS, devices_of=None,
                    gathered=None):
    """AllReduce per (device set, dtype) in buckets; returns (grads_and_vars, (grad, copy) pairs to apply).

    cross_process_reduce(buffer) -> buffer, if given, reduces each bucket's packed in-process sum
    once across processes (dapple_tf.frontends.horovod), weighted by the process's share of the batch.
    bucket_bytes: see the module docstring (None: ALLREDUCE_BUCKET_BYTES; 0: one bucket per variable).
    start_after: build_pipeline's stale-copy check: the first reduction on each device holding copies waits for
    its comparing (`by_device`); where any reduction runs TF collective ops, every device's first waits for the whole
    check: a collective op that has started in a step that fails aborts the process's collectives for good (TF:
    "Restart your program to reset"), so a failed check must stop the step before any starts.
    lowering: what this graph builds (`built(devices)`: sums and pairs are those of its devices), its choice of
    exchange or collective per device set and the exchange's transport (hosts/lowering.py; IN_PROCESS: every device).
    devices_of, gathered: every device of the cluster that accumulates each variable's gradient, in order (None: the
    accumulator's, all in this graph), and the variables whose gradient is gathered rows on all of them (None: as
    the accumulator has them): a per-host graph's from the plan (hosts/lowering.py)."""
    bucket_bytes = ALLREDUCE_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    devices_of = accumulator.devices_of() if devices_of is None else devices_of
    groups: Dict[Tuple[Tuple[str, ...], tf.DType], List[tf.Variable]] = {}
    for variable, devices in devices_of.items():
        groups.setdefault((devices, variable.dtype.base_dtype), []).append(variable)
    graph = next(iter(accumulator.sums.values())).graph if accumulator.sums else None
    position = {op: i for i, op in enumerate(graph.get_operations())} if graph is not None else {}
    reduced: Dict[Key, object] = {}
    exposed: Dict[tf.Variable, object] = {}
    last_collective: Dict[str, object] = {} if start_after is None else _first_waits(
        start_after, sorted(lowering.built({d for devices in devices_of.values() for d in devices})),
        any(_uses_collective_ops(devices, cross_process_reduce, lowering) for devices, _ in groups))
    # One fixed order of collectives on every device (NCCL needs it on overlapping groups).
    for devices, dtype in sorted(groups, key=lambda key: (key[0], key[1].name)):
        local = lowering.built(devices)
        exchange = cross_process_reduce is None and lowering.exchanges(devices)
        summed = _bucket_sums(groups[(devices, dtype)], devices, dtype, local, exchange, accumulator, keys,
                              last_collective, cross_process_reduce, lowering, bucket_bytes, position, gathered)
        group = groups[(devices, dtype)]
        # The apply step waits for the device set's last bucket; fetching one device's sum must run
        # every participant's collectives.
        chained = len(devices) > 1 and all(d in last_collective for d in local)
        everyone = [last_collective[d] for d in local] if chained else []
        for d in local:
            with tf.device(d), tf.control_dependencies([last_collective[d]] if chained else []):
                for v in group:
                    total, count = summed[(v, d)]
                    total = tf.identity(total)
                    reduced[(v, d)] = _as_slices(total, count) if count is not None else total
        for v in group:
            home = next((d for d, c in copies.copies_of(v).items() if c is v), None)
            source = home if home in local else local[0]
            with tf.device(source):
                exposed[v] = _identity_after(reduced[(v, source)], everyone)
    grads_and_vars, apply_pairs = [], []
    for variable in devices_of:
        grads_and_vars.append((exposed[variable], variable))
        held = copies.copies_of(variable)
        for device in lowering.built(list(held)):  # other tasks' graphs apply the others
            apply_pairs.append((reduced.get((variable, device), exposed[variable]), held[device]))
    return grads_and_vars, apply_pairs


def _bucket_sums(group, devices, dtype: tf.DType, local, exchange: bool, accumulator: GradientAccumulator, keys,
                 last_collective, cross_process_reduce, lowering, bucket_bytes: float, position, gathered
                 ) -> Dict[Key, tuple]:
    """(variable, device) -> (its sum, its row counts or None) of a (device set, dtype) group, bucket by bucket, for
    this graph's devices `local`; each device's last collective recorded in `last_collective`."""
    summed: Dict[Key, tuple] = {}
    # exchange_sum needs no launch order and packs small gradients itself: one bucket, each group of it
    # reduced as soon as the last backward has made it
    size = float("inf") if exchange else bucket_bytes
    buckets = _buckets(group, accumulator, local[0], size, position)
    for b, bucket in enumerate(buckets):
        sparse = [v for v in bucket if (v in gathered if gathered is not None else accumulator.is_sparse(v, local))]
        per_device = {
            d: [accumulator.sums[(v, d)] for v in bucket] + [accumulator.row_counts[(v, d)] for v in sparse]
            if d in local else None
            for d in devices
        }
        sums = collectives.all_reduce_sum(per_device, keys, after=last_collective,
                                          cross_process_reduce=cross_process_reduce, lowering=lowering,
                                          key=_exchange_key(devices, dtype, b))
        for d in local:
            if len(devices) > 1 and not exchange:
                last_collective[d] = sums[d][0]
            counts = dict(zip(sparse, sums[d][len(bucket):]))
            for v, total in zip(bucket, sums[d][: len(bucket)]):
                summed[(v, d)] = (total, counts.get(v))
    return summed

