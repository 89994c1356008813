"""All-reduce of one flat buffer per device by recursive halving and doubling, for exchange groups of three devices
or more (collectives.exchange_sum picks it).

With p the largest power of two at most n, devices p..n-1 first add their buffer into devices 0..n-1-p. Then
the p devices halve: in round k each device sends half of the rows it still sums to its partner (index XOR
p / 2^(k+1)) and adds the partner's half into the other, until each holds one row summed over every device;
then they double back, each sending its summed rows to the same partners in reverse order; the first devices
send the whole sum to the extra ones. That is 2 log2(p) rounds (2 more when n is not a power of two), each
device's bytes about twice its buffer, and O(log n) operations per device in a per-host graph, where a pairwise
exchange has O(n) and a ring, which needs a loop, pays for the loop's control across tasks in every step.

Both kinds of graph run the same steps: the transport the lowering passes in (hosts/) moves each tensor, through
queues where the partner is another task's device in a per-host graph; in the one graph it is the partner's
tensor. Every element is summed in the same tree in both, so they agree to the bit (each add reads a slice or a
received tensor, never another add, so grappler merges no chain of adds into an AddN, whose order of additions
follows the arrival of its inputs).
"""

from typing import Dict, Optional

import tensorflow as tf

HALVING_DEVICES = 3  # two devices exchange halves either way: exchange_sum's pieces are the same rounds


def halving_doubling_sum(buffers: Dict[str, Optional[tf.Tensor]], transport, key: str) -> Dict[str, tf.Tensor]:
    """{device: the element-wise sum of every device's 1-D buffer} for this graph's devices (per host: those whose
    buffer is not None; `transport` moves a tensor between devices (the lowering's `move`), `key` names what
    crosses to other tasks' graphs)."""
    devices = sorted(buffers)
    n = len(devices)
    p = 1 << (n.bit_length() - 1)
    like = next(b for b in buffers.values() if b is not None)
    size = tf.compat.dimension_value(like.shape[0])
    width = -(-size // p)
    move = _Mover(devices, transport, key, like.dtype, width)
    rows = {}
    for i, d in enumerate(devices):
        if buffers[d] is not None:
            with tf.device(d):
                rows[i] = tf.reshape(tf.pad(buffers[d], [[0, p * width - size]]), [p, width])
    for i in range(p, n):  # the extra devices fold into the first ones
        rows = _added(rows, i - p, move(rows.get(i), i, i - p, f"fold{i}", p), devices)
    span = {i: (0, p) for i in range(p)}
    distance = p // 2
    while distance:
        sent = {}
        for i in range(p):
            lo, hi = span[i]
            mid = (lo + hi) // 2
            span[i], give = ((lo, mid), (mid, hi)) if not i & distance else ((mid, hi), (lo, mid))
            if i in rows:
                with tf.device(devices[i]):
                    sent[i] = rows[i][give[0] - lo:give[1] - lo]
                    rows[i] = rows[i][span[i][0] - lo:span[i][1] - lo]
        for i in range(p):
            half = span[i][1] - span[i][0]
            rows = _added(rows, i, move(sent.get(i ^ distance), i ^ distance, i, f"half{distance}", half), devices)
        distance //= 2
    distance = 1
    while distance < p:
        grown = {}
        for i in range(p):
            got = move(rows.get(i ^ distance), i ^ distance, i, f"double{distance}", span[i][1] - span[i][0])
            if i in rows:
                with tf.device(devices[i]):
                    grown[i] = tf.concat([rows[i], got] if not i & distance else [got, rows[i]], axis=0)
        rows = grown
        span = {i: (min(span[i][0], span[i ^ distance][0]), max(span[i][1], span[i ^ distance][1])) for i in span}
        distance *= 2
    for i in range(p, n):  # the extra devices get the whole sum
        got = move(rows.get(i - p), i - p, i, f"unfold{i}", p)
        if got is not None:
            rows[i] = got
    out = {}
    for i, d in enumerate(devices):
        if buffers[d] is not None:
            with tf.device(d):
                out[d] = tf.reshape(rows[i], [-1])[:size]
    return out


def _added(rows: Dict[int, tf.Tensor], i: int, got: Optional[tf.Tensor], devices) -> Dict[int, tf.Tensor]:
    if i in rows:
        with tf.device(devices[i]):
            rows[i] = tf.add(rows[i], got)
    return rows


class _Mover:
    """Device j's tensor where device i reads it, through `transport.move` (the lowering's: the tensor itself in one
    graph and between one task's devices, queues between tasks of per-host graphs; None where i is not this
    graph's). A transport of None: the tensor itself."""

    def __init__(self, devices, transport, key: str, dtype: tf.DType, width: int):
        self._devices, self._transport, self._key, self._dtype, self._width = devices, transport, key, dtype, width

    def __call__(self, tensor: Optional[tf.Tensor], j: int, i: int, tag: str, rows: int) -> Optional[tf.Tensor]:
        if self._transport is None:
            return tensor
        source, target = self._devices[j], self._devices[i]
        return self._transport.move(tensor, source, target, f"{self._key}/{tag}/{source}", self._dtype,
                                    tf.TensorShape([rows, self._width]))
