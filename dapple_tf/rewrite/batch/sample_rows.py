"""Which tensors keep the samples in row blocks: row r of axis 0 belongs to sample r // k.

Between stages of different replication a batch-dependent tensor is cut into (or glued from) row ranges, one
per replica's slice of samples. That is right for a tensor whose axis 0 is the batch (k = 1) and for one
reshaped from it to [batch * k, ...] (TF1 BERT keeps its hidden states as [batch * seq, hidden]); it would mix
samples up for a time-major [seq * batch, ...] tensor of the same shape. `SampleRows.rows_per_sample` proves
the row blocks and their k from what the ops compute and the template's static shapes, starting at the model's
inputs (k = 1): row-wise ops keep k, a reshape keeps the flat order (k rows of p values per sample become
k * p / q rows of q values, when whole). Where nothing is proven (a loop's output), the stage builder takes the
first dimension for the batch when each producer clone's has as many rows as its slice has samples.
"""

from typing import Dict, Iterable, Optional, Set

import numpy as np
import tensorflow as tf

from dapple_tf.rewrite.batch import normalization
from dapple_tf.rewrite.graphs import graph_walk

_UNIFORM = {"Fill", "ZerosLike", "OnesLike"}  # the same value in every row: any row layout fits
_ROW_WISE = {  # row r of the output from row r of the first input
    "MatMul", "Cast", "Identity", "Softmax", "LogSoftmax", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "AvgPool", "CheckNumerics", "EnsureShape",
    "StopGradient", "PreventGradient"}


def _constant(tensor: tf.Tensor):
    value = tf.get_static_value(tensor)
    return None if value is None else np.asarray(value)


def _static_product(dims) -> Optional[int]:
    return None if any(d is None for d in dims) else int(np.prod(dims, dtype=np.int64))


_ANY = 0  # a tensor with the same value in every row (tf.ones of a shape): fits any row blocks


class SampleRows:
    """Rows per sample of axis 0 of a template tensor, where proven; see the module docstring."""

    def __init__(self, input_ops: Iterable[tf.Operation], batch_dependent: Set[tf.Operation]):
        self._inputs = set(input_ops)
        self._dependent = batch_dependent
        self._known: Dict[str, Optional[int]] = {}

    def rows_per_sample(self, tensor: tf.Tensor) -> Optional[int]:
        """k when row r of `tensor` belongs to sample r // k, else None (not proven)."""
        unknown = [tensor.op] if tensor.name not in self._known else []
        for before in graph_walk.ancestors_in_order(unknown, self._unknown):  # ancestors first: no deep recursion
            for t in before.outputs:
                if t.name not in self._known:
                    self._known[t.name] = self._compute(t)
        if tensor.name not in self._known:
            self._known[tensor.name] = self._compute(tensor)
        k = self._known[tensor.name]
        return k if k != _ANY else None

    def _unknown(self, op: tf.Operation) -> bool:
        return op in self._dependent and op.outputs[0].name not in self._known

    def _of(self, tensor: tf.Tensor) -> Optional[int]:
        return self._known[tensor.name] if tensor.name in self._known else self._compute(tensor)

    def _compute(self, tensor: tf.Tensor) -> Optional[int]:
        op = tensor.op
        rank = tensor.shape.rank
        if not rank:
            return None
        if op in self._inputs:
            return 1
        if op not in self._dependent:
            return None
        try:
            return self._follow(op, tensor, rank)
        except (IndexError, KeyError, TypeError, ValueError):  # a computation not followed: not proven
            return None

    def _follow(self, op: tf.Operation, tensor: tf.Tensor, rank: int) -> Optional[int]:
        kind = op.type
        if kind in _UNIFORM:
            return _ANY
        if kind in normalization.ELEMENTWISE or kind == "SelectV2":
            return self._elementwise(op.inputs, rank)
        if kind in _ROW_WISE:
            if kind == "MatMul" and op.get_attr("transpose_a") or tensor.value_index != 0:  # batch norm's statistics
                return None
            if any(t.op in self._dependent for t in op.inputs[1:2]):
                return None
            return self._of(op.inputs[0])
        if kind in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
            return self._elementwise(op.inputs[:2], rank) if rank > 2 else None
        if kind == "Reshape":
            return self._reshape(op)
        if kind == "Transpose":
            perm = _constant(op.inputs[1])
            return self._of(op.inputs[0]) if perm is not None and int(perm[0]) == 0 else None
        if kind == "ConcatV2":
            return self._elementwise(op.inputs[:-1], rank) if self._keeps_axis_0(op) else None
        if kind == "Pack":  # the pieces' axis 0 stays axis 0 when they are stacked along another axis
            return self._elementwise(op.inputs, rank - 1) if self._keeps_axis_0(op) else None
        if kind in ("ExpandDims", "OneHot", "Squeeze", "Mean", "Sum", "Max", "Min", "Prod"):
            return self._of(op.inputs[0]) if self._keeps_axis_0(op) else None
        if kind in ("StridedSlice", "Slice"):
            return self._of(op.inputs[0]) if self._whole_axis_0(op) else None
        if kind in ("GatherV2", "ResourceGather"):
            axis = _constant(op.inputs[2]) if kind == "GatherV2" else np.array(0)
            if axis is None or int(np.ravel(axis)[0]) != 0 or op.inputs[0].op in self._dependent:
                return None
            return self._of(op.inputs[1])
        return None

    def _elementwise(self, inputs, rank: int) -> Optional[int]:
        """Inputs broadcast against each other (aligned right): every one of the full rank in the same row blocks
        (or 1 row, not computed from the batch); those of a lower rank broadcast over the rows."""
        found = None
        for t in inputs:
            if t.shape.rank is None:
                return None
            if t.shape.rank < rank:
                continue
            if t.op not in self._dependent:
                if tf.compat.dimension_value(t.shape[0]) != 1:
                    return None
                continue
            k = self._of(t)
            if k == _ANY:
                found = _ANY if found is None else found
                continue
            if k is None or found not in (None, _ANY, k):
                return None
            found = k
        return found

    def _keeps_axis_0(self, op: tf.Operation) -> bool:
        kind = op.type
        out_rank = op.outputs[0].shape.rank
        if kind == "ExpandDims":
            axis = _constant(op.inputs[1])
            return axis is not None and int(np.ravel(axis)[0]) % out_rank != 0
        if kind == "ConcatV2":
            axis = _constant(op.inputs[-1])
            return axis is not None and int(axis) % out_rank != 0
        if kind in ("Pack", "OneHot"):
            return op.get_attr("axis") % out_rank != 0
        in_rank = op.inputs[0].shape.rank
        if kind == "Squeeze":
            dims = op.get_attr("squeeze_dims")
            return bool(dims) and in_rank is not None and all(d % in_rank != 0 for d in dims)
        axes = _constant(op.inputs[1])
        return axes is not None and in_rank is not None and all(int(a) % in_rank != 0 for a in np.ravel(axes))

    def _whole_axis_0(self, op: tf.Operation) -> bool:
        """A slice that takes all of axis 0, in order."""
        if op.type == "Slice":
            begin, size = _constant(op.inputs[1]), _constant(op.inputs[2])
            return begin is not None and size is not None and int(begin[0]) == 0 and int(size[0]) == -1
        if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask") & 1 or op.get_attr("shrink_axis_mask") & 1:
            return False
        strides = _constant(op.inputs[3])
        return (strides is not None and int(strides[0]) == 1 and bool(op.get_attr("begin_mask") & 1)
                and bool(op.get_attr("end_mask") & 1))

    def _reshape(self, op: tf.Operation) -> Optional[int]:
        """A reshape keeps the flat order: k rows of `per_row` values per sample become rows of `rest` values,
        k * per_row / rest of them per sample when that is whole."""
        source, out = op.inputs[0], op.outputs[0]
        k = self._of(source)
        if k in (None, _ANY) or source.shape.rank is None or out.shape.rank in (None, 0):
            return None
        per_row = _static_product(source.shape.as_list()[1:])
        rest = _static_product(out.shape.as_list()[1:])
        if per_row is None or not rest or (k * per_row) % rest:
            return None
        return k * per_row // rest
