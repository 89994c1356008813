"""Stage boundaries as one graph builds them: what a consumer replica reads of its producer replicas' tensors
(split/concat between stages of different replication: the rows its slice overlaps, gathered on its device; a
tensor not split by samples read whole), the pieces its input gradient is cut into for them, and the sum of the
pieces a producer's output gets back. The pairs are the program's row pairing (planner/formats/program.py). A
producer or consumer replica on another task (a per-host graph) sends or receives through a queue (queue_names.py
names it, host_part.py moves it), and so do the clones' values of what is combined once per step (extra outputs,
batch statistics, summaries' tensors); every such method is also what the other task's graph computes for the same
pair. StageBuilder calls it while it builds this graph's clones; in one graph every replica is this graph's and
nothing is sent or received.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.rewrite.batch import microbatch
from dapple_tf.rewrite.hosts import queue_names
from dapple_tf.rewrite.template.template import BOUNDARY, Template
from planner.formats import program as program_lib


class BoundaryExchange:
    """Stage boundaries between this task's clones and other tasks'; see the module docstring."""

    def __init__(self, template: Template, sizes: Sequence[Sequence[int]], host, differentiable: Callable):
        """sizes: per stage, its replicas' slice sizes of a micro-batch; host: the lowering (lowering.py: TaskGraph,
        a host_part.HostPart; OneGraph, an InGraph: every replica is local, nothing is sent or received);
        differentiable(stage): the stage's boundary inputs that get gradients (StageBuilder's)."""
        self.template, self.sizes, self.host, self._differentiable = template, sizes, host, differentiable
        self._extras_sent = set()
        self._extras_received: Dict[str, tf.Tensor] = {}
        # (stage, micro-batch, replica, output name) -> [(first row, consumer replica, piece)] per consumer stage
        self._grad_pieces: Dict[Tuple[int, int, int, str], Dict[int, List[Tuple[int, int, tf.Tensor]]]] = {}
        self._broadcast_outputs = set()  # (stage, output name) read whole by every consumer replica
        self._rows_per_sample: Dict[Tuple[int, str], int] = {}  # (stage, output name) cut into row ranges -> k
        self._rows_per_sample_unproven: Dict[Tuple[int, str], bool] = {}  # k = 1 taken, checked when the step runs

    # -- activations -----------------------------------------------------------------------------------------
    def read(self, ext, m: int, consumer: Tuple[int, int], start: int, size: int, device: str,
             local_output: Callable[[int], tf.Tensor]) -> tf.Tensor:
        """What consumer replica `consumer` (stage, replica) of rows [start, start + size) of micro-batch m reads for
        boundary tensor `ext`, on `device`; local_output(i): this graph's clone of producer replica i's tensor."""
        p = ext.producer_stage
        producers = self._producer_outputs(ext, m, consumer, start, size, device, local_output)
        same_samples = [i for i, (first, n) in enumerate(zip(program_lib.offsets(self.sizes[p]), self.sizes[p]))
                        if (first, n) == (start, size)]
        if not ext.batch_major:
            received = producers[0]
        elif same_samples:  # a producer replica had exactly this slice: its tensor whole, whatever its row layout
            received = producers[same_samples[0]]
        else:
            k, axis = self._row_blocks(ext, p, producers), ext.batch_axis
            if self._rows_per_sample_unproven.get((p, ext.tensor.name)):
                producers = [t if t is None else _checked_rows(ext.tensor.name, p, t, n, axis)
                             for t, n in zip(producers, self.sizes[p])]
            received = microbatch.concat_rows(
                microbatch.gather_rows(producers, [n * k for n in self.sizes[p]], start * k, size * k, axis), axis)
        # A tensor of this task's own, so that the gradient w.r.t. it covers only this clone's paths
        # (not a path through another boundary tensor the same producer computed from it).
        return tf.identity(received)

    def _row_blocks(self, ext, p: int, producers: List[tf.Tensor]) -> int:
        """Rows per sample along the batch axis of a boundary tensor cut into row ranges: proven from its ops
        (sample_rows.py, batch-leading tensors), else one, as its batch axis has as many rows as the slice has
        samples (checked when the step runs where the clones' shapes do not tell)."""
        key, axis = (p, ext.tensor.name), ext.batch_axis
        if key not in self._rows_per_sample:
            k = self.template.rows.rows_per_sample(ext.tensor) if axis == 0 else None
            _check_rows(ext.tensor.name, p, producers, self.sizes[p], k or 1, axis)
            self._rows_per_sample[key] = k or 1
            self._rows_per_sample_unproven[key] = k is None and any(_dimension(t, axis) is None for t in producers
                                                                           if t is not None)
        return self._rows_per_sample[key]

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
    def cut_input_gradient(self, ext, s: int, m: int, j: int, grad: tf.Tensor) -> List[tf.Tensor]:
        """Cuts the gradient of consumer replica (s, j)'s input `ext` into pieces for the producer replicas; returns
        them (what the task sends: part of its B, which zero-bubble schedules run before its W). A piece for a replica
        of this graph is kept for its output_gradient; one for a replica on another task is sent there, once it is
        made: no task waits for the sending (tasks.chain)."""
        p = ext.producer_stage
        if not ext.batch_major:
            self._broadcast_outputs.add((p, ext.tensor.name))
        sizes = self.sizes[s]
        start = program_lib.offsets(sizes)[j]
        producer_offsets = program_lib.offsets(self.sizes[p])
        k = self._rows_per_sample.get((p, ext.tensor.name), 1)
        pieces = []
        for i, row, count in program_lib.gradient_pieces(ext.batch_major, self.sizes[p], start, sizes[j]):
            piece = grad if count == sizes[j] else microbatch.rows(grad, row * k, (row + count) * k, ext.batch_axis)
            first_row = start + row - producer_offsets[i] if ext.batch_major else 0
            producer_device = self.template.stages[p].stage.devices[i]
            if not self.host.is_local(producer_device):
                self.host.send(queue_names.gradient_key(ext.tensor.name, (p, i), (s, j), m), piece, producer_device)
            else:
                key = (p, m, i, ext.tensor.name)
                self._grad_pieces.setdefault(key, {}).setdefault(s, []).append((first_row, j, piece))
            pieces.append(piece)
        return pieces

    def output_gradient(self, s: int, m: int, j: int, name: str, output: tf.Tensor, device: str
                        ) -> Optional[tf.Tensor]:
        """The gradient of clone (s, m, j)'s output `name` (`output`) on `device`: the pieces its consumers cut for
        it (kept here, or received from consumer replicas on other tasks), concatenated per consumer stage (summed
        where it was read whole), summed over the consumer stages. None when no consumer sent any."""
        per_consumer = dict(self._grad_pieces.get((s, m, j, name), {}))
        received, read_whole = self._remote_gradient_pieces(s, m, j, output, name, device)
        for c, pieces in received.items():
            per_consumer[c] = per_consumer.get(c, []) + pieces
        if read_whole:  # a consumer on another task read the whole tensor (its cut_input_gradient did not run here)
            self._broadcast_outputs.add((s, name))
        if not per_consumer:
            return None
        sums = []
        for consumer in sorted(per_consumer):
            pieces = [g for _, _, g in sorted(per_consumer[consumer], key=lambda x: x[:2])]
            if (s, name) in self._broadcast_outputs:  # every consumer replica's gradient of the whole tensor
                sums.append(tf.add_n(pieces))
            else:
                sums.append(microbatch.concat_rows(pieces, self._output_batch_axis(s, name)))
        total = sums[0] if len(sums) == 1 else tf.add_n(sums)
        if self.host.per_host:  # received pieces have no static shape; together they cover the output
            total.set_shape(output.shape)
        return total

    def _output_batch_axis(self, s: int, name: str) -> int:
        """The batch axis of stage s's output `name` as its consumers split it by samples."""
        return next((e.batch_axis for st in self.template.stages[s + 1:] for e in st.externals
                     if e.kind == BOUNDARY and e.producer_stage == s and e.tensor.name == name and e.batch_major), 0)

    def _remote_gradient_pieces(self, s: int, m: int, j: int, output: tf.Tensor, name: str, device: str
                                ) -> Tuple[Dict[int, List[Tuple[int, int, tf.Tensor]]], bool]:
        """({consumer stage: [(first row, consumer replica, piece)]} of the gradient pieces of clone (s, m, j)'s
        output `name` that consumer replicas on other tasks send, received here; whether some consumer, of this
        task or another, reads the output whole (not split by samples), which this graph does not see from those on
        other tasks: always in a per-host graph)."""
        out: Dict[int, List[Tuple[int, int, tf.Tensor]]] = {}
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
        read_whole = self.host.per_host and any(
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


def _dimension(t: tf.Tensor, axis: int):
    """The static size of `t`'s axis `axis`, None where unknown."""
    return tf.compat.dimension_value(t.shape[axis]) if t.shape.rank else None


def _axis_words(axis: int) -> str:
    return "its first dimension" if axis == 0 else f"its dimension {axis} (its batch axis)"


def _check_rows(name: str, stage: int, producers: List[tf.Tensor], sizes, rows_per_sample: int, axis: int) -> None:
    """Each producer replica's clone of `name` must have rows_per_sample rows per sample of its slice along `axis`."""
    for i, (t, samples) in enumerate(zip(producers, sizes)):
        if t is not None and _dimension(t, axis) not in (None, samples * rows_per_sample):
            raise DappleError(
                f"{name} leaves stage {stage} and is split by samples, but {_axis_words(axis)} is not the batch: "
                f"replica {i}'s slice of {samples} samples makes it {t.shape}; give it a leading batch dimension "
                "before the stage boundary, or move the boundary"
            )


def _checked_rows(name: str, stage: int, t: tf.Tensor, samples: int, axis: int) -> tf.Tensor:
    """`t`, once its batch axis is checked to have a row per sample of its slice (when the step runs)."""
    check = tf.debugging.assert_equal(
        tf.shape(t)[axis], samples, message=f"{name} leaves stage {stage} and is split by samples, but "
        f"{_axis_words(axis)} is not the batch: give it a leading batch dimension before the stage boundary, or move "
        "the boundary")
    with tf.control_dependencies([check]):
        return tf.identity(t)
