"""Values computed from the batch's shape: what TF1 code does with `batch_size = tf.shape(x)[0]`.

A tensor that depends on the inputs only through shapes (`tf.shape`, `tf.size`, `tf.rank` of batched tensors,
then arithmetic, slicing, packing, `tf.ones(...)` of them) is the same for every slice of the batch of the
same size. Such a value never crosses a stage boundary as data: each stage that consumes it computes it
itself (template.py copies its operations into the stage), from the shape of the source tensor at the
stage's own slice size. That shape is found before anything runs: the source tensor's ancestors are imported
into a scratch graph whose inputs have the slice's static size, and TF's shape inference gives it (`ShapeValues`).

`shape_only_ops` tells those operations apart from the ones that compute from the batch's values (and from
stateful ops fed by shapes, such as `tf.random.normal(tf.shape(x))`: two stages drawing it would disagree).
"""

from typing import Dict, Iterable, Set, Tuple

import numpy as np
import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.rewrite.graphs import graph_defs as graph_defs_lib, graph_walk

SHAPE_READING_OPS = ("Shape", "ShapeN", "Size", "Rank")


def is_stateful(op: tf.Operation) -> bool:
    try:
        return op.op_def.is_stateful
    except (AttributeError, ValueError):  # an op without a registered definition: assume it has state
        return True


def shape_only_ops(input_ops: Iterable[tf.Operation], batch_dependent: Set[tf.Operation]) -> Set[tf.Operation]:
    """Of the ops computed from the inputs (`batch_dependent`), those that depend on them only through the shapes
    of batched tensors: the shape-reading ops and what is computed from their outputs alone, without state."""
    values = graph_walk.descendants(list(input_ops), SHAPE_READING_OPS)
    stateful = [op for op in batch_dependent - values if is_stateful(op)]
    values |= graph_walk.descendants(stateful)
    return {op for op in batch_dependent - values}


def source(shape_tensor: tf.Tensor) -> tf.Tensor:
    """The batched tensor whose shape a shape-reading op's output `shape_tensor` reads."""
    op = shape_tensor.op
    return op.inputs[shape_tensor.value_index] if op.type == "ShapeN" else op.inputs[0]


class ShapeValues:
    """The value of each shape-reading op's output at a given slice size, by static shape inference."""

    def __init__(self, graph: tf.Graph, placeholders: Iterable[tf.Tensor], shape_tensors: Iterable[tf.Tensor],
                 crossing: Dict[str, Tuple[int, int]]):
        """placeholders: the template's inputs (batch dimension unknown); shape_tensors: the shape-reading ops'
        outputs that stages compute for themselves; crossing: their names -> (producing stage, consuming stage),
        for messages. The sources' ancestors are cut out of the template now, before any clone joins the graph."""
        self._placeholders = {p.name: p for p in placeholders}
        self._shape_tensors = {t.name: t for t in shape_tensors}
        self._sources = {name: source(t) for name, t in self._shape_tensors.items()}
        self._crossing = crossing
        self._by_size: Dict[int, Dict[str, np.ndarray]] = {}
        computed = [t.op for t in self._sources.values() if t.name not in self._placeholders]
        inputs = {p.op for p in self._placeholders.values()}
        ops = sorted(set(computed) | set(graph_walk.ancestors_in_order(computed, lambda op: op not in inputs)),
                     key=lambda op: op._id)  # pylint: disable=protected-access
        self._graph_def = graph_defs_lib.stage_graph_defs(graph, [ops])[0].graph_def if ops else None

    def value(self, shape_tensor: tf.Tensor, size: int) -> np.ndarray:
        if size not in self._by_size:
            self._by_size[size] = self._evaluate(size)
        return self._by_size[size][shape_tensor.name]

    def _static_shapes(self, size: int) -> Dict[str, tf.TensorShape]:
        """Each source's static shape when the inputs hold `size` samples."""
        shapes = {p.name: tf.TensorShape([size] + p.shape.as_list()[1:]) for p in self._placeholders.values()}
        wanted = sorted({t.name for t in self._sources.values()} - set(shapes))
        if wanted:
            read = {graph_defs_lib.tensor_name(i) for node in self._graph_def.node for i in node.input}
            with tf.Graph().as_default():
                input_map = {name: tf.compat.v1.placeholder(p.dtype, shapes[name])
                             for name, p in self._placeholders.items() if name in read}
                imported = tf.compat.v1.import_graph_def(self._graph_def, input_map=input_map,
                                                         return_elements=wanted, name="shape_values")
                shapes.update({name: t.shape for name, t in zip(wanted, imported)})
        return shapes

    def _evaluate(self, size: int) -> Dict[str, np.ndarray]:
        shapes = self._static_shapes(size)
        values = {}
        for name, shape_tensor in self._shape_tensors.items():
            source_name = self._sources[name].name
            shape = shapes[source_name]
            if not shape.is_fully_defined():
                producer, consumer = self._crossing[name]
                raise DappleError(
                    f"{shape_tensor.name}, the shape of {source_name} (stage {producer}), is used in stage {consumer}, "
                    f"which reads it for its own slice of the batch; but for a slice of {size} samples it is {shape}, "
                    "not known before the step runs (it depends on the values of the batch, or on a loop TF cannot "
                    "infer shapes through): move the stage boundary, or compute the shape in the stage that uses it"
                )
            dims = shape.as_list()
            number = {"Size": int(np.prod(dims)), "Rank": len(dims)}.get(shape_tensor.op.type)
            values[name] = np.asarray(dims if number is None else number, dtype=shape_tensor.dtype.as_numpy_dtype)
        return values
