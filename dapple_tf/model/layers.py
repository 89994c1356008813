"""`dapple_tf.layer(name)`: the marker users put around each layer of their model.

Markers are recorded by the `LayerRecorder` that build_pipeline or the profiler activates in the
graph's own collection (no process-wide state). A layer owns exactly the operations created
while its context is open; the order in which layers are opened is the layer order the
profiler, the planner and the pipeline builder share.
"""

import contextlib
import dataclasses
from typing import Callable, List, Optional

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

from dapple_tf.errors import LayerMarkerError

_RECORDER_COLLECTION = "dapple_tf.layer_recorder"
# Recorders are Python objects: leave them out of exported meta graphs (Saver.save) quietly.
tf_ops.register_proto_function(_RECORDER_COLLECTION, to_proto=lambda item, export_scope=None: None)


@dataclasses.dataclass
class LayerRecord:
    name: str
    index: int
    ops: List[tf.Operation]


class LayerRecorder:
    """The layers marked in one graph, in order, with the operations each one created.

    `device_for_layer`, if given, maps a layer's name and index to the device its operations (and
    variables) are placed on while the layer is built.
    """

    def __init__(self, graph: tf.Graph, device_for_layer: Optional[Callable[[str, int], Optional[str]]] = None):
        self.graph = graph
        self.device_for_layer = device_for_layer
        self.layers: List[LayerRecord] = []
        self._open: Optional[str] = None

    @property
    def names(self) -> List[str]:
        return [r.name for r in self.layers]

    def layer_of_op(self):
        """A dict from every recorded operation's name to its layer index."""
        return {op.name: r.index for r in self.layers for op in r.ops}

    @contextlib.contextmanager
    def record(self, name: str):
        if not isinstance(name, str) or not name:
            raise LayerMarkerError(f"a layer name must be a non-empty string, got {name!r}")
        if self._open is not None:
            raise LayerMarkerError(
                f"layer {name!r} is opened inside layer {self._open!r}; dapple_tf.layer markers cannot nest"
            )
        if name in self.names:
            raise LayerMarkerError(f"layer {name!r} is marked twice; layer names must be unique")
        device = self.device_for_layer(name, len(self.layers)) if self.device_for_layer else None
        first = len(self.graph.get_operations())
        self._open = name
        try:
            with tf.name_scope(name), (tf.device(device) if device else contextlib.nullcontext()):
                yield
        finally:
            self._open = None
        ops = self.graph.get_operations()[first:]
        self.layers.append(LayerRecord(name=name, index=len(self.layers), ops=ops))

    # The graph keeps the active recorder; these manage that slot.
    @staticmethod
    def active(graph: tf.Graph) -> Optional["LayerRecorder"]:
        """The recorder dapple_tf.layer reports to in `graph`, if one is active."""
        existing = graph.get_collection(_RECORDER_COLLECTION)
        return existing[-1] if existing else None

    @contextlib.contextmanager
    def activate(self):
        """Makes this recorder the one dapple_tf.layer reports to, inside the block."""
        stack = self.graph.get_collection_ref(_RECORDER_COLLECTION)
        stack.append(self)
        try:
            yield self
        finally:
            stack.remove(self)


def layer(name: str):
    """Marks the operations created inside the block as the layer `name`.

        with dapple_tf.layer("conv1"):
            x = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))

    Layers are recorded in the order they are opened; they must not nest. Outside
    build_pipeline and the profiler (no active recorder), a marker is a plain name scope, so
    the same model_fn also builds evaluation or single-device graphs.
    """
    recorder = LayerRecorder.active(tf.compat.v1.get_default_graph())
    return recorder.record(name) if recorder is not None else tf.name_scope(name)
