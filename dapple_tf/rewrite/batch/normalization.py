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
- Transpose / ExpandDims / Squeeze with constant arguments, elementwise ops (broadcasting aligned right),
  MatMul / BatchMatMul / Einsum, convolutions and pools, reductions, pads, slices, concatenations,
  gathers (embedding lookups) and ops making a tensor of a given shape (Fill, dropout's random masks)
  move or keep it.
Anything else (a Keras RNN's while loop, a map_fn, a reshape that cannot be followed) gives an *unknown*
sample axis, and so does every layout op applied to it: no axis is assumed. (An RNN with
return_sequences=True runs time-major inside its loop and transposes back; guessing axis 0 for the
loop's output and following the transpose would put the samples on the time axis.)

Batch statistics are then, where the sample axis is proven,
- a training-mode FusedBatchNorm* whose reduced axes (all but the channel axis) include a sample axis;
- a Mean or Sum keeping dimensions (tf.nn.moments', so Keras 2 non-fused and Keras 3 BatchNormalization's)
  over constant axes including a sample axis.
LayerNormalization, GroupNormalization and instance norms reduce over per-sample axes only: not batch
statistics, so no BatchNormWarning and sync batch norm leaves them alone.
Where the sample axis is unknown the rule from before the analysis holds: a training-mode FusedBatchNorm*
is a batch norm, and a Mean or Sum keeping dimensions over constant axes including axis 0
(`unproven_reductions`) is refused by batch_norm="sync" in a replicated stage; nothing else is
synchronized or warned about.
"""

import collections
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

TRAINING_NORMS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
REDUCTIONS = ("Mean", "Sum")
_CHANNEL_AXIS = {"NHWC": -1, "NDHWC": -1, "NCHW": 1, "NCDHW": 1}
_SAMPLE = "<sample>"
ELEMENTWISE = {
    "Identity", "Cast", "StopGradient", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Neg",
    "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Abs", "Reciprocal", "Softplus", "Add", "AddV2", "Sub", "Mul",
    "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "SquaredDifference", "Pow", "BiasAdd", "CheckNumerics",
    "ClipByValue", "Erf",
}
ELEMENTWISE |= {
    "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot",
    "SelectV2", "FloorDiv", "FloorMod", "Mod", "Floor", "Ceil", "Round", "Sign", "Softsign", "Sin", "Cos",
    "Log1p", "Expm1", "Gelu", "Swish", "IsFinite", "AddN", "ZerosLike", "OnesLike",
}
_SAME_SHAPE = {"Softmax", "LogSoftmax", "PreventGradient", "EnsureShape", "Cumsum", "Cumprod"}  # first input's layout
_MADE_FROM_SHAPE = {  # shape first
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt", "StatelessRandomUniform",
    "StatelessRandomNormal", "StatelessTruncatedNormal", "StatelessRandomUniformV2", "StatelessRandomNormalV2",
    "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
}
_REDUCING = {"Mean", "Sum", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"}
_SPATIAL = {
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D", "Conv",
}
_FOLLOWED = _SPATIAL | _REDUCING | {
    "Reshape", "Transpose", "ExpandDims", "Squeeze", "Pad", "PadV2", "MirrorPad", "Tile", "Slice", "Reverse",
    "ReverseV2", "Roll", "StridedSlice", "ConcatV2", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
    "Einsum", "GatherV2", "ResourceGather", "Split", "SplitV", "ArgMax", "ArgMin", "Unpack", "OneHot",
    "SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits",
}
_MAX_DEPTH = 100  # ops followed back recursively (ancestors are computed first, so only shape computations)


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


def _strided_slice_axes(op: tf.Operation) -> Optional[Dict[int, int]]:
    """Input axis -> output axis of a StridedSlice's kept axes (`x[None, :, 0, ..., None]`: new axes inserted,
    shrunk axes gone, an ellipsis standing for the axes no entry names); None where its spec is not static."""
    begin, in_rank = _constant(op.inputs[1]), op.inputs[0].shape.rank
    if begin is None or in_rank is None or begin.ndim != 1:
        return None
    ellipsis, new, shrink = (op.get_attr(m) for m in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask"))
    entries = len(begin)
    if bin(ellipsis).count("1") > 1 or new & shrink:
        return None
    named = sum(1 for i in range(entries) if not (ellipsis >> i & 1 or new >> i & 1))
    kept, axis, out = {}, 0, 0
    for i in range(entries):
        if ellipsis >> i & 1:
            for _ in range(in_rank - named):
                kept[axis], axis, out = out, axis + 1, out + 1
        elif new >> i & 1:
            out += 1
        elif shrink >> i & 1:
            axis += 1
        else:
            kept[axis], axis, out = out, axis + 1, out + 1
    while axis < in_rank:  # the axes after the last entry are kept whole
        kept[axis], axis, out = out, axis + 1, out + 1
    return kept


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

    def of(self, tensor: tf.Tensor, depth: int = 0) -> Optional[FrozenSet[int]]:
        """The axes of `tensor` holding (part of) the sample index; empty for batch-independent tensors; None
        when unknown (computed by an op the analysis does not follow, or from such a tensor)."""
        if tensor.name not in self._axes:
            if depth == 0:  # the ancestors first, in creation (topological) order: no deep recursion
                for before in self._uncomputed_ancestors(tensor.op):
                    for t in before.outputs:
                        self._axes[t.name] = self._compute(t, 0)
            self._axes[tensor.name] = self._compute(tensor, depth)
        return self._axes[tensor.name]

    def _uncomputed_ancestors(self, op: tf.Operation) -> List[tf.Operation]:
        seen, stack = set(), [t.op for t in op.inputs]
        while stack:
            current = stack.pop()
            if current in seen or current not in self.batch_dependent or not current.outputs:
                continue
            if current.outputs[0].name in self._axes:
                continue
            seen.add(current)
            stack.extend(t.op for t in current.inputs)
        return sorted(seen, key=lambda o: o._id)  # pylint: disable=protected-access

    def _compute(self, tensor: tf.Tensor, depth: int) -> Optional[FrozenSet[int]]:
        op = tensor.op
        if op not in self.batch_dependent:
            return frozenset()
        rank = tensor.shape.rank
        if op in self.inputs:
            return frozenset() if rank == 0 else frozenset([0])
        if depth > _MAX_DEPTH or rank is None:
            return None
        try:
            follow = self._follow(op, tensor, rank, depth + 1)
        except (IndexError, KeyError, TypeError, ValueError):  # a computation not followed: unknown
            follow = None
        return None if follow is None else frozenset(a for a in follow if 0 <= a < rank)

    def _all(self, tensors: Iterable[tf.Tensor], depth: int) -> Optional[List[FrozenSet[int]]]:
        """The sample axes of each of `tensors`; None if any is unknown."""
        out = []
        for t in tensors:
            axes = self.of(t, depth)
            if axes is None:
                return None
            out.append(axes)
        return out

    def _follow(self, op: tf.Operation, tensor: tf.Tensor, rank: int, depth: int) -> Optional[FrozenSet[int]]:
        kind = op.type
        if kind in TRAINING_NORMS:
            return self.of(op.inputs[0], depth) if tensor.value_index == 0 else None
        if kind in ELEMENTWISE or kind in _SAME_SHAPE:
            inputs = list(op.inputs) if kind in ELEMENTWISE else list(op.inputs[:1])
            inner = self._all(inputs, depth)
            if inner is None or any(t.shape.rank is None for t in inputs):
                return None
            return frozenset(a + rank - t.shape.rank for t, axes in zip(inputs, inner) for a in axes)
        if kind in ("Shape", "ShapeN", "Size", "Rank"):  # sizes: no axis indexes the samples
            return frozenset()
        if kind == "Pack":
            parts = self._all(op.inputs, depth)
            axis = op.get_attr("axis") % rank
            return None if parts is None else frozenset(a + (a >= axis) for a in frozenset().union(*parts))
        if kind in _MADE_FROM_SHAPE:
            return self._from_shape(op.inputs[0], depth)
        if kind in ("Fill", "BroadcastTo"):
            if kind == "BroadcastTo" and self.of(op.inputs[0], depth) != frozenset():
                return None
            return self._from_shape(op.inputs[1 if kind == "BroadcastTo" else 0], depth)
        if kind in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
            return self._matmul(op, rank, depth)
        if kind == "Einsum":
            return self._einsum(op, depth)
        if kind in ("GatherV2", "ResourceGather"):
            return self._gather(op, depth)
        if kind == "ConcatV2":
            parts = self._all(op.inputs[:-1], depth)
            return None if parts is None else frozenset().union(*parts)
        if kind in ("Split", "SplitV"):  # the pieces keep the value's layout
            value = op.inputs[1] if kind == "Split" else op.inputs[0]
            others = [t for t in op.inputs if t is not value]
            return self.of(value, depth) if all(self.of(t, depth) == frozenset() for t in others) else None
        inner = self.of(op.inputs[0], depth) if kind in _FOLLOWED else None
        return None if inner is None else self._move(op, tensor, inner, rank, depth)

    def _move(self, op: tf.Operation, tensor: tf.Tensor, inner: FrozenSet[int], rank: int,
              depth: int) -> Optional[FrozenSet[int]]:
        """The sample axes of a layout op's output whose (first) input has the sample axes `inner`."""
        kind = op.type
        if kind == "Reshape":
            return self._reshape(op, depth)
        if kind == "Transpose":
            perm = _constant(op.inputs[1])
            if perm is None:
                return None
            return frozenset(j for j, p in enumerate(perm.tolist()) if p in inner)
        if kind == "ExpandDims":
            axis = _constant(op.inputs[1])
            if axis is None:
                return None
            axis = int(np.ravel(axis)[0]) % rank
            return frozenset(a + (a >= axis) for a in inner)
        if kind == "Squeeze":
            in_rank = op.inputs[0].shape.rank
            dims = [d % in_rank for d in op.get_attr("squeeze_dims")] if in_rank is not None else None
            if not dims:
                return None
            kept = [a for a in range(in_rank) if a not in dims]
            return frozenset(j for j, a in enumerate(kept) if a in inner)
        if kind in _REDUCING:
            axes, in_rank = _constant(op.inputs[1]), op.inputs[0].shape.rank
            if axes is None or in_rank is None:
                return None
            if op.get_attr("keep_dims"):
                return inner  # a reduced axis keeps its place (size 1)
            reduced = {int(a) % in_rank for a in np.ravel(axes)}
            kept = [a for a in range(in_rank) if a not in reduced]
            return frozenset(j for j, a in enumerate(kept) if a in inner)
        if kind in _SPATIAL:  # convolutions and pools: the samples stay in axis 0 (NHWC and NCHW alike)
            return inner if inner <= {0} and self.of(op.inputs[-1], depth) in (frozenset(), inner) else None
        if kind == "Tile":
            return self._tile(op, inner, depth)
        if kind in ("Pad", "PadV2", "MirrorPad", "Slice", "Reverse", "ReverseV2", "Roll"):
            return inner if all(self.of(t, depth) == frozenset() for t in op.inputs[1:]) else None
        if kind == "StridedSlice":
            if any(self.of(t, depth) != frozenset() for t in op.inputs[1:]):
                return None
            if not inner:  # slicing a tensor no axis of which indexes the samples (a shape)
                return frozenset()
            kept = _strided_slice_axes(op)
            return None if kept is None else frozenset(kept[a] for a in inner if a in kept)
        return self._drop_or_add(op, tensor, inner, rank, depth)

    def _tile(self, op: tf.Operation, inner: FrozenSet[int], depth: int) -> Optional[FrozenSet[int]]:
        """A tile keeps the sample axes; an axis of size 1 tiled to the batch size (`tf.tile(pos[:, None], [1, bsz,
        1])` with bsz = tf.shape(x)[1]) becomes one: every sample's entry is the same."""
        multiples = self._evaluate(op.inputs[1], depth) if self.of(op.inputs[1], depth) == frozenset() else None
        if not isinstance(multiples, list) or op.inputs[0].shape.rank != len(multiples):
            return None
        sizes, tiled = op.inputs[0].shape.as_list(), set()
        for j, m in enumerate(multiples):
            if m is not None and _SAMPLE in m[1]:
                if m != (1, (_SAMPLE,)) or sizes[j] != 1:
                    return None
                tiled.add(j)
        return frozenset(inner | tiled)

    def _drop_or_add(self, op: tf.Operation, tensor: tf.Tensor, inner: FrozenSet[int], rank: int,
                     depth: int) -> Optional[FrozenSet[int]]:
        """Ops removing one axis of their first input or adding one."""
        kind = op.type
        if kind in ("ArgMax", "ArgMin", "Unpack") or (
                kind in ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits")
                and tensor.value_index == 0):  # one axis goes: the reduced one, the unpacked one, the classes
            in_rank = op.inputs[0].shape.rank
            if kind == "Unpack":
                gone = op.get_attr("axis") % in_rank
            elif kind.startswith("Arg"):
                gone = int(_constant(op.inputs[1])) % in_rank
            else:
                gone = in_rank - 1
                if kind.startswith("Sparse") and self.of(op.inputs[1], depth) is None:
                    return None
            return frozenset(a - (a > gone) for a in inner if a != gone)
        if kind == "OneHot":
            axis = op.get_attr("axis") % rank
            return frozenset(a + (a >= axis) for a in inner)
        return None

    def _from_shape(self, shape: tf.Tensor, depth: int) -> Optional[FrozenSet[int]]:
        """The sample axes of a tensor made with the shape `shape` (an int tensor)."""
        dims = self._evaluate(shape, depth)
        if not isinstance(dims, list) or any(d is None for d in dims):
            return None
        if any(_SAMPLE in d[1] and d != (1, (_SAMPLE,)) for d in dims):
            return None
        return frozenset(j for j, d in enumerate(dims) if d == (1, (_SAMPLE,)))

    def _matmul(self, op: tf.Operation, rank: int, depth: int) -> Optional[FrozenSet[int]]:
        x, y = op.inputs[:2]
        inner = self._all((x, y), depth)
        if inner is None or x.shape.rank is None or y.shape.rank is None:
            return None
        if op.type == "MatMul":
            flips = op.get_attr("transpose_a"), op.get_attr("transpose_b")
        else:
            flips = op.get_attr("adj_x"), op.get_attr("adj_y")
        out = set()
        for side, (t, axes, flip) in enumerate(zip((x, y), inner, flips)):
            r = t.shape.rank
            kept = (r - 1 if flip else r - 2) if side == 0 else (r - 2 if flip else r - 1)  # rows of x, columns of y
            for a in axes:
                if a == kept:
                    out.add(rank - 2 + side)
                elif a < r - 2:  # a batch axis, aligned right
                    out.add(a + rank - r)
                # the contracted axis: summed away
        return frozenset(out)

    def _einsum(self, op: tf.Operation, depth: int) -> Optional[FrozenSet[int]]:
        equation = op.get_attr("equation").decode().replace(" ", "")
        if "." in equation or "->" not in equation:
            return None
        inputs, output = equation.split("->")
        specs = inputs.split(",")
        inner = self._all(op.inputs, depth)
        if inner is None or len(specs) != len(inner):
            return None
        return frozenset(output.index(spec[a]) for spec, axes in zip(specs, inner) for a in axes
                         if spec[a] in output)

    def _gather(self, op: tf.Operation, depth: int) -> Optional[FrozenSet[int]]:
        params, indices = op.inputs[:2]
        axis = _constant(op.inputs[2]) if op.type == "GatherV2" else np.array(0)
        if axis is None or int(np.ravel(axis)[0]) != 0 or op.get_attr("batch_dims"):
            return None
        if self.of(params, depth) != frozenset():  # gathering from a batch-dependent tensor: not followed
            return None
        return self.of(indices, depth)  # gathered rows [indices..., row...]: the indices' axes lead

    def _symbolic_dims(self, tensor: tf.Tensor, depth: int) -> Optional[List[_Dim]]:
        """tensor's dimensions as symbols: the sample axis -> _SAMPLE, a static size -> itself, else a name."""
        shape = tensor.shape
        if shape.rank is None:
            return None
        sample = self.of(tensor, depth)
        if sample is None:
            return None
        dims = []
        for i, size in enumerate(shape.as_list()):
            if i in sample and size is None:
                dims.append((1, (_SAMPLE,)))
            elif size is not None:  # a static batch size too: the block arithmetic holds for numbers
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
        if sample is None:
            return None
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
        """A training-mode FusedBatchNorm* reducing over a sample axis of its input (a batch norm), or whose
        input's sample axis is unknown (then a batch norm, as every training-mode fused norm was before)."""
        if not is_training_fused_norm(op):
            return False
        x = op.inputs[0]
        sample = self.of(x)
        if sample is None:
            return True
        rank = x.shape.rank or 4
        data_format = op.get_attr("data_format").decode() or "NHWC"
        channel = _CHANNEL_AXIS.get(data_format, -1) % rank
        sizes = x.shape.as_list() if x.shape.rank is not None else [None] * rank
        reduced = {a for a in range(rank) if a != channel and sizes[a] != 1}
        return bool(sample & reduced)

    def _reduction_axes(self, op: tf.Operation) -> Optional[FrozenSet[int]]:
        """The axes of a Mean or Sum keeping dimensions over constant axes; None for anything else."""
        if op.type not in REDUCTIONS or not op.get_attr("keep_dims"):
            return None
        axes, rank = _constant(op.inputs[1]), op.inputs[0].shape.rank
        if axes is None or not rank:
            return None
        return frozenset(int(a) % rank for a in np.ravel(axes))

    def reduction_over_batch(self, op: tf.Operation) -> bool:
        """A Mean or Sum keeping dimensions over constant axes that include a proven sample axis (tf.nn.moments')."""
        axes = self._reduction_axes(op)
        sample = self.of(op.inputs[0]) if axes is not None else None
        return sample is not None and bool(sample & axes)

    def batch_statistics(self, ops: Iterable[tf.Operation]) -> List[tf.Operation]:
        """The ops among `ops` computing statistics over the batch: batch norms, fused or not (the fused ones
        whose input's sample axis is unknown included)."""
        return [op for op in ops if self.fused_norm_over_batch(op) or self.reduction_over_batch(op)]

    def unproven_reductions(self, ops: Iterable[tf.Operation]) -> List[tf.Operation]:
        """The Means and Sums keeping dimensions over constant axes including axis 0 of an input whose sample
        axis is unknown: maybe batch statistics (the rule before the analysis), neither synchronized nor warned
        about; batch_norm="sync" refuses them in replicated stages."""
        out = []
        for op in ops:
            axes = self._reduction_axes(op)
            if axes is not None and 0 in axes and self.of(op.inputs[0]) is None:
                out.append(op)
        return out
