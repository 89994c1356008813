"""Stage boundaries in a per-host graph: what crosses between this task's replicas and another task's goes through a
queue (queue_names.py names it, host_part.py moves it). A consumer replica here receives the rows it reads of a
producer replica there; a producer replica here sends them to each consumer replica there that reads them; the
gradient pieces travel back alike; the clones' values of what is combined once per step (extra outputs, batch
statistics, summaries' tensors) go to the loss's task. Every send is what the other task's graph receives for the
same pair. Between this task's own replicas, and in one graph, boundaries are stages/boundaries.py's, which this
extends: the lowering (lowering.py, TaskGraph.boundaries) gives it to the builder.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.rewrite.hosts import queue_names
from dapple_tf.rewrite.stages.boundaries import Boundaries, Pieces
from dapple_tf.rewrite.template.template import BOUNDARY, Template
from planner.formats import program as program_lib


class BoundaryExchange(Boundaries):
    """Stage boundaries between this task's clones and other tasks'; see the module docstring."""

    def __init__(self, template: Template, sizes: Sequence[Sequence[int]], host, differentiable: Callable):
        """host: the lowering (lowering.py: TaskGraph, a host_part.HostPart); the rest as Boundaries'."""
        super().__init__(template, sizes, differentiable)
        self.host = host
        self._extras_sent = set()
        self._extras_received: Dict[str, tf.Tensor] = {}

    # -- activations -----------------------------------------------------------------------------------------
    def _producer_outputs(self, ext, m: int, consumer: Tuple[int, int], start: int, size: int, device: str,
                          local_output: Callable[[int], tf.Tensor]) -> List[Optional[tf.Tensor]]:
        """Per replica of ext's producer stage, what consumer replica `consumer` (stage, replica) of rows
        [start, start + size) reads of it: local_output(i) for this task's replicas, the received tensor for those
        of other tasks it reads, None for the rest."""
        p, sizes = ext.producer_stage, self.sizes[ext.producer_stage]
        read = program_lib.producers_read(ext.batch_major, sizes, start, size)
        out = []
        for i, producer_device in enumerate(self.template.stages[p].stage.devices):
            if self.host.is_local(producer_device):
                out.append(local_output(i))
            elif i in read:
                key = queue_names.activation_key(ext.tensor.name, (p, i), consumer, m)
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
                for j in program_lib.consumers_reading(ext.batch_major, self.sizes[s], self.sizes[c], i):
                    device = consumer.stage.devices[j]
                    if not self.host.is_local(device):
                        key = queue_names.activation_key(ext.tensor.name, (s, i), (c, j), m)
                        self.host.send(key, outputs[ext.tensor.name], device)

    # -- gradients -------------------------------------------------------------------------------------------
    def _give(self, ext, producer: Tuple[int, int], consumer: Tuple[int, int], m: int, first_row: int,
              piece: tf.Tensor) -> None:
        """A piece for a replica of this graph is kept; one for a replica on another task is sent there, once it is
        made: no task waits for the sending (tasks.chain)."""
        p, i = producer
        producer_device = self.template.stages[p].stage.devices[i]
        if self.host.is_local(producer_device):
            super()._give(ext, producer, consumer, m, first_row, piece)
        else:
            self.host.send(queue_names.gradient_key(ext.tensor.name, producer, consumer, m), piece, producer_device)

    def output_gradient(self, s: int, m: int, j: int, name: str, output: tf.Tensor, device: str
                        ) -> Optional[tf.Tensor]:
        """As in one graph, of the pieces kept here and received from consumer replicas on other tasks."""
        total = super().output_gradient(s, m, j, name, output, device)
        if total is not None:  # received pieces have no static shape; together they cover the output
            total.set_shape(output.shape)
        return total

    def _pieces_for(self, s: int, m: int, j: int, name: str, output: tf.Tensor, device: str) -> Pieces:
        """The pieces kept here and those received from consumer replicas on other tasks (whose reading the
        output whole this graph does not see: it asks the template)."""
        per_consumer = super()._pieces_for(s, m, j, name, output, device)
        received, read_whole = self._remote_gradient_pieces(s, m, j, output, name, device)
        for c, pieces in received.items():
            per_consumer[c] = per_consumer.get(c, []) + pieces
        if read_whole:  # a consumer on another task read the whole tensor (its cut_input_gradient did not run here)
            self._broadcast_outputs.add((s, name))
        return per_consumer

    def _remote_gradient_pieces(self, s: int, m: int, j: int, output: tf.Tensor, name: str, device: str
                                ) -> Tuple[Pieces, bool]:
        """({consumer stage: [(first row, consumer replica, piece)]} of the gradient pieces of clone (s, m, j)'s
        output `name` that consumer replicas on other tasks send, received here; whether some consumer, of this
        task or another, reads the output whole (not split by samples), which this graph does not see from those on
        other tasks)."""
        out: Pieces = {}
        for consumer in self.template.stages[s + 1:]:
            c = consumer.stage.index
            for ext in self._differentiable(consumer):
                if ext.producer_stage != s or ext.tensor.name != name:
                    continue
                for jc, first_row, count in program_lib.gradient_pieces_for(ext.batch_major, self.sizes[s],
                                                                            self.sizes[c], j):
                    if not self.host.is_local(consumer.stage.devices[jc]):
                        key = queue_names.gradient_key(name, (s, j), (c, jc), m)
                        shape = _piece_shape(output.shape, ext, self.sizes[s][j], count)
                        piece = self.host.receive(key, output.dtype, shape, device)
                        out.setdefault(c, []).append((first_row, jc, piece))
        read_whole = any(
            not e.batch_major for st in self.template.stages[s + 1:] for e in st.externals
            if e.kind == BOUNDARY and e.producer_stage == s and e.tensor.name == name)
        return out, read_whole

    # -- once per step ---------------------------------------------------------------------------------------
    def send_extra(self, tensor: tf.Tensor, s: int, m: int, j: int, value: Callable[[], tf.Tensor], device: str
                   ) -> None:
        """Sends clone (s, m, j)'s `value()` of template tensor `tensor` to `device`, once however often asked, where
        this graph built the clone."""
        if not self.host.is_local(self.template.stages[s].stage.devices[j]):
            return
        key = queue_names.extra_key(tensor.name, s, j, m)
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
        key = queue_names.extra_key(tensor.name, s, j, m)
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
