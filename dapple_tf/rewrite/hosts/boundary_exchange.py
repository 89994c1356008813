"""The tensors a per-host graph exchanges with other tasks' graphs at stage boundaries: activations a consumer
replica receives and its producer sends, gradient pieces a producer receives, and the loss terms summed on the
loss's device, and the clones' values of what is combined once per step (extra outputs, batch statistics,
summaries' tensors) (host_boundaries.py pairs the replicas, host_part.py moves the tensors). StageBuilder calls it
while it builds this graph's clones, in one graph too, where every replica is this graph's and nothing crosses
(every clone's value is kept, nothing is sent or received); every method is also what the other task's graph
computes for the same pair.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.rewrite.hosts import host_boundaries
from dapple_tf.rewrite.template.template import BOUNDARY, Template


class BoundaryExchange:
    """Stage boundaries between this task's clones and other tasks'; see the module docstring."""

    def __init__(self, template: Template, sizes: Sequence[Sequence[int]], host):
        """sizes: per stage, its replicas' slice sizes of a micro-batch; host: the lowering (lowering.py: TaskGraph,
        a host_part.HostPart; OneGraph, an InGraph: every replica is local, nothing is sent or received)."""
        self.template, self.sizes, self.host = template, sizes, host
        self._extras_sent = set()
        self._extras_received: Dict[str, tf.Tensor] = {}

    def producer_outputs(self, ext, m: int, consumer: Tuple[int, int], start: int, size: int, device: str,
                         local_output: Callable[[int], tf.Tensor]) -> List[Optional[tf.Tensor]]:
        """Per replica of ext's producer stage, what consumer replica `consumer` (stage, replica) of rows
        [start, start + size) reads of it: local_output(i) for this task's replicas, the received tensor for those
        of other tasks it reads, None for the rest."""
        p, sizes = ext.producer_stage, self.sizes[ext.producer_stage]
        read = host_boundaries.producers_read(ext.batch_major, sizes, start, size)
        out = []
        for i, producer_device in enumerate(self.template.stages[p].stage.devices):
            if self.host.is_local(producer_device):
                out.append(local_output(i))
            elif i in read:
                key = host_boundaries.activation_key(ext.tensor.name, (p, i), consumer, m)
                out.append(self.host.receive(key, ext.tensor.dtype, self._received_shape(ext, sizes[i]), device))
            else:
                out.append(None)
        return out

    def _received_shape(self, ext, samples: int) -> tf.TensorShape:
        """A boundary tensor's static shape as the producer replica of `samples` samples makes it, as far as the
        template tells (its rows where they are proven per sample)."""
        shape = ext.tensor.shape
        if not ext.batch_major or not shape.rank:
            return shape
        k = self.template.rows.rows_per_sample(ext.tensor) if ext.batch_axis == 0 else 1
        if k is None:
            return shape
        dims = shape.as_list()
        dims[ext.batch_axis] = samples * k
        return tf.TensorShape(dims)

    def send_outputs(self, s: int, m: int, i: int, outputs: Dict[str, tf.Tensor]) -> None:
        """Sends clone (s, m, i)'s boundary tensors to the consumer replicas on other tasks that read them."""
        for consumer in self.template.stages[s + 1:]:
            c = consumer.stage.index
            for ext in consumer.externals:
                if ext.kind != BOUNDARY or ext.producer_stage != s:
                    continue
                for j in host_boundaries.consumers_reading(ext.batch_major, self.sizes[s], self.sizes[c], i):
                    device = consumer.stage.devices[j]
                    if not self.host.is_local(device):
                        key = host_boundaries.activation_key(ext.tensor.name, (s, i), (c, j), m)
                        self.host.send(key, outputs[ext.tensor.name], device)

    def gradient_piece(self, name: str, producer: Tuple[int, int], consumer: Tuple[int, int], m: int,
                       piece: tf.Tensor, keep: Callable[[tf.Tensor], None]) -> None:
        """A piece of the gradient of boundary tensor `name` that `consumer` (stage, replica) cut for `producer`,
        micro-batch m: sent to the producer's task when that is another, else kept (`keep(piece)`)."""
        p, i = producer
        producer_device = self.template.stages[p].stage.devices[i]
        if not self.host.is_local(producer_device):
            self.host.send(host_boundaries.gradient_key(name, producer, consumer, m), piece, producer_device)
        else:
            keep(piece)

    def remote_gradient_pieces(self, s: int, m: int, j: int, output: tf.Tensor, name: str, device: str,
                               differentiable: Callable) -> Tuple[Dict[int, List[Tuple[int, int, tf.Tensor]]], bool]:
        """({consumer stage: [(first row, consumer replica, piece)]} of the gradient pieces of clone (s, m, j)'s
        output `name` that consumer replicas on other tasks send, received here; whether some consumer, of this
        task or another, reads the output whole (not split by samples), which this graph does not see from those on
        other tasks: always in a per-host graph). `differentiable(stage)`: the stage's boundary inputs that get
        gradients (StageBuilder's)."""
        out: Dict[int, List[Tuple[int, int, tf.Tensor]]] = {}
        for consumer in self.template.stages[s + 1:]:
            c = consumer.stage.index
            for ext in differentiable(consumer):
                if ext.producer_stage != s or ext.tensor.name != name:
                    continue
                for jc, first_row, count in host_boundaries.gradient_pieces_for(ext.batch_major, self.sizes[s],
                                                                                self.sizes[c], j):
                    if not self.host.is_local(consumer.stage.devices[jc]):
                        key = host_boundaries.gradient_key(name, (s, j), (c, jc), m)
                        shape = _piece_shape(output.shape, ext, self.sizes[s][j], count)
                        piece = self.host.receive(key, output.dtype, shape, device)
                        out.setdefault(c, []).append((first_row, jc, piece))
        read_whole = self.host.per_host and any(
            not e.batch_major for st in self.template.stages[s + 1:] for e in st.externals
            if e.kind == BOUNDARY and e.producer_stage == s and e.tensor.name == name)
        return out, read_whole

    def received_shape(self, total: tf.Tensor, shape: tf.TensorShape) -> None:
        """A per-host graph's sum of an output's gradient pieces takes the output's static `shape`: received pieces
        have none, and together they cover the output."""
        if self.host.per_host:
            total.set_shape(shape)

    def send_extra(self, tensor: tf.Tensor, s: int, m: int, j: int, value: Callable[[], tf.Tensor], device: str
                   ) -> None:
        """Sends clone (s, m, j)'s `value()` of template tensor `tensor` to `device`, once however often asked, where
        this graph built the clone."""
        if not self.host.is_local(self.template.stages[s].stage.devices[j]):
            return
        key = host_boundaries.extra_key(tensor.name, s, j, m)
        if key not in self._extras_sent:
            self._extras_sent.add(key)
            self.host.send(key, value(), device)

    def extra_value(self, tensor: tf.Tensor, s: int, m: int, j: int, value: Callable[[], tf.Tensor], device: str
                    ) -> tf.Tensor:
        """Clone (s, m, j)'s value of template tensor `tensor` where `device` combines it: `value()` where this graph
        built the clone, else received (`receive_extra`)."""
        if self.host.is_local(self.template.stages[s].stage.devices[j]):
            return value()
        return self.receive_extra(tensor, s, m, j, device)

    def combining_devices(self, devices: Sequence[str], loss_device: str) -> Sequence[str]:
        """The devices a stage's extra output is combined on (outputs.combine): its replicas', or, where its first
        device is another task's, the loss's device (which receives the values)."""
        if devices and not self.host.is_local(devices[0]):
            return (loss_device,)
        return devices

    def receive_extra(self, tensor: tf.Tensor, s: int, m: int, j: int, device: str) -> tf.Tensor:
        """Clone (s, m, j)'s value of template tensor `tensor`, received on `device` by every step (what
        send_extra sends in the clone's task)."""
        key = host_boundaries.extra_key(tensor.name, s, j, m)
        if key not in self._extras_received:
            self._extras_received[key] = self.host.receive(key, tensor.dtype, tensor.shape, device)
        return self._extras_received[key]


def _piece_shape(shape: tf.TensorShape, ext, samples: int, count: int) -> tf.TensorShape:
    """The static shape of a gradient piece of `count` of the `samples` samples of an output of `shape` (that the
    boundary `ext` splits along its batch axis)."""
    if not ext.batch_major or count == samples:
        return shape
    rows = tf.compat.dimension_value(shape[ext.batch_axis]) if shape.rank else None
    if rows is None:
        return tf.TensorShape(None)
    dims = shape.as_list()
    dims[ext.batch_axis] = rows // samples * count
    return tf.TensorShape(dims)
