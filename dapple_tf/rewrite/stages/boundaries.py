"""Stage boundaries as one graph builds them: what a consumer replica reads of its producer replicas' tensors
(split/concat between stages of different replication: the rows its slice overlaps, gathered on its device; a
tensor not split by samples read whole), the pieces its input gradient is cut into for them, and the sum of the
pieces a producer's output gets back. The pairs are the program's row pairing (planner/formats/program.py).
StageBuilder calls it while it builds the clones. `Boundaries` is the one graph's, where every replica is this
graph's; the lowering gives the builder one (hosts/lowering.py), and a per-host graph's sends and receives what
crosses to another task's replicas (hosts/boundary_exchange.py).
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.rewrite.batch import microbatch
from dapple_tf.rewrite.template.template import BOUNDARY, Template
from planner.formats import program as program_lib

Pieces = Dict[int, List[Tuple[int, int, tf.Tensor]]]  # consumer stage -> [(first row, consumer replica, piece)]


class Boundaries:
    """Stage boundaries between the clones of one graph; see the module docstring."""

    def __init__(self, template: Template, sizes: Sequence[Sequence[int]], differentiable: Callable):
        """sizes: per stage, its replicas' slice sizes of a micro-batch; differentiable(stage): the stage's boundary
        inputs that get gradients (StageBuilder's)."""
        self.template, self.sizes, self._differentiable = template, sizes, differentiable
        # (stage, micro-batch, replica, output name) -> its gradient's pieces
        self._grad_pieces: Dict[Tuple[int, int, int, str], Pieces] = {}
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
        [start, start + size) reads of it: every replica's clone, in one graph."""
        del m, consumer, start, size, device
        return [local_output(i) for i in range(len(self.sizes[ext.producer_stage]))]

    def send_outputs(self, s: int, m: int, i: int, outputs: Dict[str, tf.Tensor]) -> None:
        """Sends clone (s, m, i)'s boundary tensors to the consumer replicas on other tasks: none in one graph."""
        del s, m, i, outputs

    # -- gradients -------------------------------------------------------------------------------------------
    def cut_input_gradient(self, ext, s: int, m: int, j: int, grad: tf.Tensor) -> List[tf.Tensor]:
        """Cuts the gradient of consumer replica (s, j)'s input `ext` into pieces for the producer replicas; returns
        them (what the task sends: part of its B, which zero-bubble schedules run before its W), each kept for its
        replica's output_gradient (`_give`)."""
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
            self._give(ext, (p, i), (s, j), m, first_row, piece)
            pieces.append(piece)
        return pieces

    def _give(self, ext, producer: Tuple[int, int], consumer: Tuple[int, int], m: int, first_row: int,
              piece: tf.Tensor) -> None:
        """Keeps a gradient piece for producer replica `producer` (stage, replica)'s output_gradient."""
        (p, i), (s, j) = producer, consumer
        self._grad_pieces.setdefault((p, m, i, ext.tensor.name), {}).setdefault(s, []).append((first_row, j, piece))

    def output_gradient(self, s: int, m: int, j: int, name: str, output: tf.Tensor, device: str
                        ) -> Optional[tf.Tensor]:
        """The gradient of clone (s, m, j)'s output `name` (`output`) on `device`: the pieces its consumers cut for
        it, concatenated per consumer stage (summed where it was read whole), summed over the consumer stages. None
        when no consumer sent any."""
        per_consumer = self._pieces_for(s, m, j, name, output, device)
        if not per_consumer:
            return None
        sums = []
        for consumer in sorted(per_consumer):
            pieces = [g for _, _, g in sorted(per_consumer[consumer], key=lambda x: x[:2])]
            if (s, name) in self._broadcast_outputs:  # every consumer replica's gradient of the whole tensor
                sums.append(tf.add_n(pieces))
            else:
                sums.append(microbatch.concat_rows(pieces, self._output_batch_axis(s, name)))
        return sums[0] if len(sums) == 1 else tf.add_n(sums)

    def _pieces_for(self, s: int, m: int, j: int, name: str, output: tf.Tensor, device: str) -> Pieces:
        """The pieces of clone (s, m, j)'s output gradient: those its consumers kept."""
        del output, device
        return dict(self._grad_pieces.get((s, m, j, name), {}))

    def _output_batch_axis(self, s: int, name: str) -> int:
        """The batch axis of stage s's output `name` as its consumers split it by samples."""
        return next((e.batch_axis for st in self.template.stages[s + 1:] for e in st.externals
                     if e.kind == BOUNDARY and e.producer_stage == s and e.tensor.name == name and e.batch_major), 0)

    # -- once per step ---------------------------------------------------------------------------------------
    def extra_value(self, tensor: tf.Tensor, s: int, m: int, j: int, value: Callable[[], tf.Tensor], device: str
                    ) -> tf.Tensor:
        """Clone (s, m, j)'s value of template tensor `tensor` where `device` combines it: `value()`."""
        del tensor, s, m, j, device
        return value()

    def combining_devices(self, devices: Sequence[str], loss_device: str) -> Sequence[str]:
        """The devices a stage's extra output is combined on (outputs.combine): its replicas'."""
        del loss_device
        return devices


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
