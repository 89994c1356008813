"""What the profiler needs to know about a marked model's graph, without running it.

For each recorded layer (dapple_tf.LayerRecorder): the tensors it consumes from outside itself
(`inputs`: produced by an earlier layer or outside every layer, e.g. the feature placeholders), the
tensors leaving it (`outputs`: consumed by a later layer; the last layer's outputs also include the
loss), the layers it consumes from (the layer DAG: layer j -> layer i when i consumes a tensor j
produced) and the trainable variables it owns (created inside its marker; a variable created outside
every marker belongs to the first layer that reads it). Resource handles (variables) are not data and
are never inputs or outputs.
"""

import dataclasses
from typing import List

import tensorflow as tf

from dapple_tf.errors import LayerMarkerError


@dataclasses.dataclass
class LayerInfo:
    name: str
    index: int
    ops: List[tf.Operation]
    inputs: List[tf.Tensor]          # consumed from outside the layer, in first-use order
    outputs: List[tf.Tensor]         # leaving the layer, in creation order
    input_layers: List[int]          # sorted producer layer indices (the DAG edges into this layer)
    variables: List[tf.Variable]     # trainable variables owned by the layer


def _is_data(tensor):
    return tensor.dtype != tf.resource and tensor.dtype != tf.variant


def analyze_layers(recorder, loss, model_ops=(), input_tensors=()):
    """LayerInfo per recorded layer; checks the model contract and raises LayerMarkerError.

    `model_ops`: the operations model_fn created (to find computation outside every marker);
    `input_tensors`: the features/labels tensors (computation from them must be in a layer).
    """
    layers = recorder.layers
    if not layers:
        raise LayerMarkerError(
            "the model has no dapple_tf.layer markers: wrap each layer's ops in `with dapple_tf.layer(name):`")
    layer_of = recorder.layer_of_op()
    last = layers[-1]
    if loss.op.name not in layer_of or layer_of[loss.op.name] != last.index:
        where = f"layer {layers[layer_of[loss.op.name]].name!r}" if loss.op.name in layer_of else "no layer"
        raise LayerMarkerError(f"the loss {loss.name} must be computed inside the last layer marker "
                               f"({last.name!r}); it is in {where}")
    if loss.shape.ndims != 0 or not loss.dtype.is_floating:
        raise LayerMarkerError(f"the loss must be a float scalar, got {loss.dtype.name} of shape {loss.shape}")
    _check_no_unmarked_computation(model_ops, layer_of, input_tensors)

    infos = []
    for record in layers:
        own = {op.name for op in record.ops}
        inputs, seen = [], set()
        outputs = []
        for op in record.ops:
            for t in op.inputs:
                if t.op.name not in own and _is_data(t) and t.name not in seen:
                    seen.add(t.name)
                    inputs.append(t)
            for t in op.outputs:
                consumers = [c for c in t.consumers() if c.name in layer_of and c.name not in own]
                if _is_data(t) and (consumers or t.name == loss.name):
                    outputs.append(t)
        producers = sorted({layer_of[t.op.name] for t in inputs if t.op.name in layer_of})
        infos.append(LayerInfo(record.name, record.index, list(record.ops), inputs, outputs, producers, []))

    for var in tf.compat.v1.trainable_variables():
        owner = layer_of.get(var.op.name)
        if owner is None:  # created outside every marker: the first layer reading it owns it
            readers = [layer_of[c.name] for c in var.op.outputs[0].consumers() if c.name in layer_of]
            owner = min(readers) if readers else None
        if owner is not None:
            infos[owner].variables.append(var)
    return infos


def _check_no_unmarked_computation(model_ops, layer_of, input_tensors):
    """Every op model_fn created that reads the inputs or a layer's output must be inside a layer."""
    sources = {t.op.name for t in input_tensors}
    for op in model_ops:
        if op.name in layer_of or op.name in sources:
            continue
        for t in op.inputs:
            if _is_data(t) and (t.op.name in layer_of or t.op.name in sources):
                raise LayerMarkerError(
                    f"op {op.name} ({op.type}) computes from the model's inputs outside every dapple_tf.layer "
                    "marker; move it into a layer")


def tensor_bytes(tensor_or_variable) -> int:
    """Bytes of a fully defined tensor or variable (static shape)."""
    shape = tensor_or_variable.shape
    if not shape.is_fully_defined():
        raise ValueError(f"{tensor_or_variable.name} has no fully defined shape: {shape}")
    return int(shape.num_elements()) * tensor_or_variable.dtype.size

