"""`dapple_tf.layers_by_scope(...)`: layers from a model's own name scopes, with no markers in it.

    handle = dapple_tf.build_pipeline(model_fn, x, y, optimizer, plan,
                                      layers=dapple_tf.layers_by_scope(depth=2))        # vgg_a/conv1, ...
    layers=dapple_tf.layers_by_scope(patterns=["InceptionV3/Mixed_*", "InceptionV3/Logits"])

While model_fn runs, a device function (`tf.compat.v1.device(fn)`, which TF calls for every op it
creates) records the name scope and the variable scope that are current when each op is created:
the scopes, not the op's name, are the op's identity. An op's layer is the prefix of its name scope
at `depth` components, or the shortest prefix matching one of `patterns` (fnmatch); failing that,
the same of its variable scope (tf.compat.v1 code re-entering a variable scope gets a different
name scope: slim's InceptionV3 computes "InceptionV3/Mixed_5b" in the name scope
"InceptionV3/InceptionV3/Mixed_5b", so patterns=["InceptionV3/Mixed_*", ...] finds it). An op
function's own scope (a scope named like an op: tf.reshape opens "Reshape" for its shape constant
and its op) counts as the scope it was called in.
The ops creating a variable take the scopes its creation started in (a variable creator scope records
them), not the scopes named after the variable ("w/IsInitialized"). tf.compat.v1.get_variable leaves
the name scope first: its variables belong to their variable scope, and one created under a plain
tf.name_scope belongs to no layer (it joins the layer reading it but is not placed: every stage
reading it gets a copy, the user's variable stays where TF puts it). Layers
are numbered in the order their first op was created. The same function places each layer's ops (so
its variables) on the device `device_for_layer` gives, as marked layers are.

Ops outside every layer (a squeeze at the model's top scope, the loss, regularization sums) join
the nearest layer: the latest layer among the layers producing their inputs; failing that (input
preprocessing), the earliest layer consuming their outputs. Ops related to no layer stay outside.
"""

import contextlib
import fnmatch
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from dapple_tf.errors import LayerMarkerError
from dapple_tf.layers import LayerRecord


class ScopeLayers:
    """How to cut a model into layers by its name scopes; see the module docstring."""

    def __init__(self, depth: Optional[int] = None, patterns: Optional[Sequence[str]] = None):
        if (depth is None) == (patterns is None):
            raise LayerMarkerError("layers_by_scope takes exactly one of depth= or patterns=")
        if depth is not None and (not isinstance(depth, int) or depth < 1):
            raise LayerMarkerError(f"layers_by_scope(depth=...) must be an integer >= 1, got {depth!r}")
        if patterns is not None:
            patterns = [patterns] if isinstance(patterns, str) else list(patterns)
            if not patterns or not all(isinstance(p, str) and p for p in patterns):
                raise LayerMarkerError(f"layers_by_scope(patterns=...) must be non-empty strings, got {patterns!r}")
        self.depth = depth
        self.patterns = patterns

    def layer_of_scope(self, scope: str) -> Optional[str]:
        """The layer a name scope belongs to, or None (outside every layer)."""
        parts = scope.split("/") if scope else []
        if self.depth is not None:
            return "/".join(parts[: self.depth]) if len(parts) >= self.depth else None
        for end in range(1, len(parts) + 1):
            prefix = "/".join(parts[:end])
            if any(fnmatch.fnmatchcase(prefix, p) for p in self.patterns):
                return prefix
        return None

    def recorder(self, graph: tf.Graph, device_for_layer: Optional[Callable[[str, int], Optional[str]]] = None):
        return ScopeRecorder(graph, self, device_for_layer)

    def __repr__(self):
        return f"layers_by_scope(depth={self.depth})" if self.depth else f"layers_by_scope(patterns={self.patterns})"


def layers_by_scope(depth: Optional[int] = None, patterns: Optional[Sequence[str]] = None) -> ScopeLayers:
    """Layers = the model's name scopes at `depth`, or the scopes matching `patterns`; see scopes.py."""
    return ScopeLayers(depth, patterns)


class ScopeRecorder:
    """Records, while active, the layer of every op created from its name scope; then the layers.

    Same interface as dapple_tf.LayerRecorder: `activate()`, then `layers`, `names`, `layer_of_op()`.
    """

    def __init__(self, graph: tf.Graph, spec: ScopeLayers, device_for_layer=None):
        self.graph = graph
        self.spec = spec
        self.device_for_layer = device_for_layer
        self.layers: List[LayerRecord] = []
        self._provisional: Dict[str, int] = {}  # layer name -> index, as seen while ops are created
        self._scopes_of: Dict[tf.Operation, tuple] = {}  # op -> (name scope, variable scope, made by a variable)
        self._created: List[tf.Operation] = []
        self._requested_in: List[tuple] = []  # while a variable is created: the scopes it was asked for in

    @property
    def names(self) -> List[str]:
        return [r.name for r in self.layers]

    def layer_of_op(self):
        return {op.name: r.index for r in self.layers for op in r.ops}

    def _place(self, op):
        if op.graph is not self.graph:  # a tf.cond / while body: the op calling it has the layer
            return op.device
        if self._requested_in:
            scopes = self._requested_in[-1] + (True,)
        else:
            scopes = self._scopes() + (False,)
        self._scopes_of[op] = scopes
        # Placement (of variables, mostly) cannot wait for _finish: it uses the layer as known so far.
        scope = scopes[0] if scopes[2] or op.name != scopes[0] else scopes[0].rpartition("/")[0]
        name = self.spec.layer_of_scope(scope) or self.spec.layer_of_scope(scopes[1])
        if name is None or op.device or self.device_for_layer is None:
            return op.device
        index = self._provisional.setdefault(name, len(self._provisional))
        return self.device_for_layer(name, index) or ""

    def _scopes(self):
        return self.graph.get_name_scope(), tf.compat.v1.get_variable_scope().name

    def _variable_creator(self, next_creator, **kwargs):
        """A variable's own ops (named after the variable, e.g. "w/IsInitialized") take the scopes the
        variable was asked for in."""
        self._requested_in.append(self._requested_in[-1] if self._requested_in else self._scopes())
        try:
            return next_creator(**kwargs)
        finally:
            self._requested_in.pop()

    @contextlib.contextmanager
    def activate(self):
        first = len(self.graph.get_operations())
        with tf.compat.v1.device(self._place), tf.variable_creator_scope(self._variable_creator), \
                tf.compat.v1.variable_creator_scope(self._variable_creator):
            yield self
        # Every op made meanwhile (ops colocated with a variable skip device functions: no scope of their own).
        self._created = self.graph.get_operations()[first:]
        self.layers = self._finish()

    def drop_layers_unused_by(self, loss: tf.Tensor) -> None:
        """Keeps the layers the loss depends on (a model's unused heads, e.g. slim's `predictions`, go)."""
        needed, stack = set(), [loss.op]
        while stack:
            op = stack.pop()
            if op not in needed:
                needed.add(op)
                stack.extend(t.op for t in op.inputs)
                stack.extend(op.control_inputs)
        kept = [r for r in self.layers if any(op in needed for op in r.ops)]
        self.layers = [LayerRecord(name=r.name, index=i, ops=r.ops) for i, r in enumerate(kept)]

    def _layer_name(self, op, op_names) -> Optional[str]:
        if op not in self._scopes_of:
            return None
        scope, variable_scope, made_by_variable = self._scopes_of[op]
        while not made_by_variable and scope in op_names:
            # An op function's own scope (tf.reshape opens "Reshape" for its shape constant and its op):
            # the scope the function was called in.
            scope = scope.rpartition("/")[0]
        return self.spec.layer_of_scope(scope) or self.spec.layer_of_scope(variable_scope)

    def _finish(self) -> List[LayerRecord]:
        op_names = {op.name for op in self._created}
        index: Dict[str, int] = {}
        layer_of: Dict[tf.Operation, int] = {}
        for op in self._created:
            name = self._layer_name(op, op_names)
            if name is not None:
                layer_of[op] = index.setdefault(name, len(index))
        if not index:
            raise LayerMarkerError(
                f"{self.spec!r}: no op was created inside a matching name scope; print the model's op names "
                "(tf.compat.v1.get_default_graph().get_operations()) to choose a depth or patterns"
            )
        created = set(self._created)
        for op in self._created:  # creation order: producers first
            if op not in layer_of:
                producers = [layer_of[t.op] for t in op.inputs if t.op in layer_of]
                if producers:
                    layer_of[op] = max(producers)
        for op in reversed(self._created):
            if op not in layer_of:
                consumers = [layer_of[c] for t in op.outputs for c in t.consumers() if c in created and c in layer_of]
                if consumers:
                    layer_of[op] = min(consumers)
        ops: List[List[tf.Operation]] = [[] for _ in index]
        for op in self._created:
            if op in layer_of:
                ops[layer_of[op]].append(op)
        return [LayerRecord(name=n, index=i, ops=ops[i]) for n, i in index.items()]
