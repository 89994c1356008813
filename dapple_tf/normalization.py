"""Which normalizations normalize over the batch: decided by what the ops compute, not by their type.

An op computes batch statistics when the axes its statistics reduce over include the *sample axis*: the
axis of its input that indexes the samples of the model's inputs. `SampleAxes` follows that axis through
the template graph: the model's inputs are batch-leading (axis 0), tensors that do not depend on them
have none, and layout ops move it:
- Reshape: the sample axis is a contiguous block of the row-major flat index, so it lands in the output
  axis whose extent covers that block. The dims are taken as products of symbols (static sizes, or the
  entries of `tf.shape(...)`, the sample entry as its own symbol) evaluated from the shape tensor, so
  Keras 2's LayerNormalization, which reshapes x [N, D] to [1, N, D, 1] (built from `tf.shape(x)`) and
  runs FusedBatchNormV3 in NCHW, is seen to normalize per sample: N lands in the channel axis, which the
  fused op does not reduce over.
- Transpose / ExpandDims / Squeeze with constant arguments, and elementwise ops (broadcasting aligned
  right) move or keep it.
Anything else keeps the convention that a batch-dependent tensor is batch-leading (axis 0); so does a
reshape that cannot be followed (an unknown reshape is treated as the code did before: axis 0).

Batch statistics are then
- a training-mode FusedBatchNorm* whose reduced axes (all but the channel axis) include a sample axis;
- a Mean or Sum keeping dimensions (tf.nn.moments', so Keras 2 non-fused and Keras 3 BatchNormalization's)
  over constant axes including a sample axis.
LayerNormalization, GroupNormalization and instance norms reduce over per-sample axes only: not batch
statistics, so no BatchNormWarning and sync batch norm leaves them alone.
"""

import collections
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

TRAINING_NORMS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
REDUCTIONS = ("Mean", "Sum")
_CHANNEL_AXIS = {"NHWC": -1, "NDHWC": -1, "NCHW": 1, "NCDHW": 1}
_SAMPLE = "<sample>"
_ELEMENTWISE = {
    "Identity", "Cast", "StopGradient", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Neg",
    "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Abs", "Reciprocal", "Softplus", "Add", "AddV2", "Sub", "Mul",
    "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "SquaredDifference", "Pow", "BiasAdd", "CheckNumerics",
    "ClipByValue", "Erf",
}
_MAX_DEPTH = 100  # ops followed back from a statistic; deeper: the batch-leading convention


def is_training_fused_norm(op) -> bool:
    """A FusedBatchNorm* op (tf.Operation or NodeDef) in training mode (computing its input's statistics)."""
    if isinstance(op, tf.Operation):
        return op.type in TRAINING_NORMS and op.get_attr("is_training")
    return op.op in TRAINING_NORMS and ("is_training" not in op.attr or op.attr["is_training"].b)


# A symbolic dimension: (integer coefficient, sorted tuple of symbols), their product.
_Dim = Tuple[int, Tuple]


def _mul(a: _Dim, b: _Dim) -> _Dim:
    return a[0] * b[0], tuple(sorted(a[1] + b[1], key=repr))


def _divides(a: _Dim, b: _Dim) -> bool:
    if a[0] == 0 or b[0] % a[0]:
        return False
    need, have = collections.Counter(a[1]), collections.Counter(b[1])
    return all(have[s] >= n for s, n in need.items())


def _divide(a: _Dim, b: _Dim) -> Optional[_Dim]:
    """a / b, when b divides a."""
    if not _divides(b, a):
        return None
    left = collections.Counter(a[1])
    left.subtract(collections.Counter(b[1]))
    return a[0] // b[0], tuple(sorted(left.elements(), key=repr))


def _product(dims: Iterable[_Dim]) -> _Dim:
    out: _Dim = (1, ())
    for d in dims:
        out = _mul(out, d)
    return out


def _constant(tensor: tf.Tensor):
    value = tf.get_static_value(tensor)
    return None if value is None else np.asarray(value)


class SampleAxes:
    """The sample axes of the tensors of a template graph whose inputs (batch-leading) are `inputs`."""

    def __init__(self, graph: tf.Graph, inputs: Sequence[tf.Operation]):
        self.inputs = set(inputs)
        dependent = set(inputs)
        for op in graph.get_operations():  # creation order is a topological order
            if any(t.op in dependent for t in op.inputs):
                dependent.add(op)
        self.batch_dependent = dependent
        self._axes: Dict[str, Optional[FrozenSet[int]]] = {}

    # -- sample axes of a tensor ------------------------------------------------------------------------------

    def of(self, tensor: tf.Tensor, depth: int = 0) -> FrozenSet[int]:
        """The axes of `tensor` holding (part of) the sample index; empty for batch-independent tensors."""
        if tensor.name not in self._axes:
            self._axes[tensor.name] = self._compute(tensor, depth)
        return self._axes[tensor.name]

    def _default(self, tensor: tf.Tensor) -> FrozenSet[int]:
        rank = tensor.shape.rank
        return frozenset() if rank == 0 else frozenset([0])

    def _compute(self, tensor: tf.Tensor, depth: int) -> FrozenSet[int]:
        op = tensor.op
        if op not in self.batch_dependent:
            return frozenset()
        rank = tensor.shape.rank
        if op in self.inputs or depth > _MAX_DEPTH or rank is None:
            return self._default(tensor)
        try:
            follow = self._follow(op, tensor, rank, depth + 1)
        except (IndexError, TypeError, ValueError):  # a shape computation not followed: the convention
            follow = None
        return self._default(tensor) if follow is None else frozenset(a for a in follow if 0 <= a < rank)

    def _follow(self, op: tf.Operation, tensor: tf.Tensor, rank: int, depth: int) -> Optional[FrozenSet[int]]:
        kind = op.type
        if kind in TRAINING_NORMS:
            return self.of(op.inputs[0], depth) if tensor.value_index == 0 else None
        if kind in _ELEMENTWISE:
            axes = set()
            for t in op.inputs:
                r = t.shape.rank
                if r is None:
                    return None
                axes |= {a + rank - r for a in self.of(t, depth)}
            return frozenset(axes)
        if kind == "Reshape":
            return self._reshape(op, depth)
        if kind == "Transpose":
            perm = _constant(op.inputs[1])
            if perm is None:
                return None
            inner = self.of(op.inputs[0], depth)
            return frozenset(j for j, p in enumerate(perm.tolist()) if p in inner)
        if kind == "ExpandDims":
            axis = _constant(op.inputs[1])
            if axis is None:
                return None
            axis = int(np.ravel(axis)[0]) % rank
            return frozenset(a + (a >= axis) for a in self.of(op.inputs[0], depth))
        if kind == "Squeeze":
            in_rank = op.inputs[0].shape.rank
            dims = [d % in_rank for d in op.get_attr("squeeze_dims")] if in_rank is not None else None
            if not dims:
                return None
            kept = [a for a in range(in_rank) if a not in dims]
            inner = self.of(op.inputs[0], depth)
            return frozenset(j for j, a in enumerate(kept) if a in inner)
        if kind in REDUCTIONS and op.get_attr("keep_dims"):
            return self.of(op.inputs[0], depth)  # a reduced axis keeps its place (size 1)
        return None

    def _symbolic_dims(self, tensor: tf.Tensor, depth: int) -> Optional[List[_Dim]]:
        """tensor's dimensions as symbols: the sample axis -> _SAMPLE, a static size -> itself, else a name."""
        shape = tensor.shape
        if shape.rank is None:
            return None
        sample = self.of(tensor, depth)
        dims = []
        for i, size in enumerate(shape.as_list()):
            if i in sample:
                dims.append((1, (_SAMPLE,)))
            elif size is not None:
                dims.append((int(size), ()))
            else:
                dims.append((1, ((tensor.name, i),)))
        return dims

    def _evaluate(self, tensor: tf.Tensor, depth: int):
        """An int tensor (a shape, a dimension) as symbolic dims: a list (1-D) or one _Dim (scalar); None if
        it cannot be followed."""
        if depth > _MAX_DEPTH:
            return None
        op = tensor.op
        value = _constant(tensor)
        if value is not None and op not in self.batch_dependent:
            if value.ndim == 0:
                return (int(value), ())
            return [(int(v), ()) if v >= 0 else None for v in value.tolist()]
        kind, depth = op.type, depth + 1
        if kind == "Shape":
            return self._symbolic_dims(op.inputs[0], depth)
        if kind in ("Identity", "Cast"):
            return self._evaluate(op.inputs[0], depth)
        if kind == "Pack":
            parts = [self._evaluate(t, depth) for t in op.inputs]
            return None if any(p is None or isinstance(p, list) for p in parts) else parts
        if kind == "ConcatV2":
            parts = [self._evaluate(t, depth) for t in op.inputs[:-1]]
            return None if any(not isinstance(p, list) for p in parts) else [d for p in parts for d in p]
        if kind in ("Mul",):
            a, b = (self._evaluate(t, depth) for t in op.inputs)
            if isinstance(a, tuple) and isinstance(b, tuple):
                return _mul(a, b)
            return None
        if kind == "Prod":
            inner, axis = self._evaluate(op.inputs[0], depth), _constant(op.inputs[1])
            if not isinstance(inner, list) or axis is None or any(d is None for d in inner):
                return None
            total = _product(inner)
            return [total] if op.get_attr("keep_dims") else total
        if kind == "StridedSlice":
            return self._strided_slice(op, depth)
        if kind in ("GatherV2", "Gather"):
            inner, indices = self._evaluate(op.inputs[0], depth), _constant(op.inputs[1])
            if not isinstance(inner, list) or indices is None:
                return None
            if indices.ndim == 0:
                return inner[int(indices)]
            return [inner[int(i)] for i in indices.tolist()]
        return None

    def _strided_slice(self, op: tf.Operation, depth: int):
        inner = self._evaluate(op.inputs[0], depth)
        begin, end, strides = (_constant(t) for t in op.inputs[1:4])
        if not isinstance(inner, list) or begin is None or end is None or strides is None or begin.size != 1:
            return None
        if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
            return None
        b = None if op.get_attr("begin_mask") & 1 else int(begin[0])
        e = None if op.get_attr("end_mask") & 1 else int(end[0])
        if op.get_attr("shrink_axis_mask") & 1:
            return inner[b or 0]
        return inner[slice(b, e, int(strides[0]))]

    def _reshape(self, op: tf.Operation, depth: int) -> Optional[FrozenSet[int]]:
        source = op.inputs[0]
        sample = self.of(source, depth)
        if not sample:
            return frozenset()
        if len(sample) != 1:
            return None
        axis = next(iter(sample))
        in_dims = self._symbolic_dims(source, depth)
        out_dims = self._evaluate(op.inputs[1], depth)
        if in_dims is None or not isinstance(out_dims, list):
            return None
        unknown = [j for j, d in enumerate(out_dims) if d is None]
        if len(unknown) > 1:
            return None
        if unknown:  # a -1: what the others leave of the input's size
            rest = _divide(_product(in_dims), _product(d for d in out_dims if d is not None))
            if rest is None:
                return None
            out_dims = list(out_dims)
            out_dims[unknown[0]] = rest
        # The sample index occupies [before, before * N) of the flat index's outer products; the output axis j
        # holding it whole spans [outer_j, outer_j * size_j) with outer_j | before and before * N | outer_j * size_j.
        before = _product(in_dims[:axis])
        block = _mul(before, in_dims[axis])
        for j, size in enumerate(out_dims):
            outer = _product(out_dims[:j])
            if _divides(outer, before) and _divides(block, _mul(outer, size)):
                return frozenset([j])
        return None

    # -- batch statistics -------------------------------------------------------------------------------------

    def fused_norm_over_batch(self, op: tf.Operation) -> bool:
        """A training-mode FusedBatchNorm* reducing over a sample axis of its input (a batch norm)."""
        if not is_training_fused_norm(op):
            return False
        x = op.inputs[0]
        rank = x.shape.rank or 4
        data_format = op.get_attr("data_format").decode() or "NHWC"
        channel = _CHANNEL_AXIS.get(data_format, -1) % rank
        sizes = x.shape.as_list() if x.shape.rank is not None else [None] * rank
        reduced = {a for a in range(rank) if a != channel and sizes[a] != 1}
        return bool(self.of(x) & reduced)

    def reduction_over_batch(self, op: tf.Operation) -> bool:
        """A Mean or Sum keeping dimensions over constant axes that include a sample axis (tf.nn.moments')."""
        if op.type not in REDUCTIONS or not op.get_attr("keep_dims"):
            return False
        axes, rank = _constant(op.inputs[1]), op.inputs[0].shape.rank
        if axes is None or not rank:
            return False
        return bool(self.of(op.inputs[0]) & {int(a) % rank for a in np.ravel(axes)})

    def batch_statistics(self, ops: Iterable[tf.Operation]) -> List[tf.Operation]:
        """The ops among `ops` computing statistics over the batch: batch norms, fused or not."""
        return [op for op in ops if self.fused_norm_over_batch(op) or self.reduction_over_batch(op)]
