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

Two rules keep one layer per model layer, both decided from the graph, not from names:
- A scope whose ops only create variables (made under the variable creator: the variable, its
  initialization and reads) is part of the layer that computes with those variables, found through
  the graph (the first op of another scope consuming them, through unscoped ops such as the
  `ReadVariableOp`s colocated with a variable). Keras 3 builds a layer in one name scope and calls
  it in another (`dense` then `dense_1`; `sequential/dense` then `sequential_1/dense_1`): the layer
  is ordered by the scope it computes in. It is named by the Keras layer's own name when one
  Keras 3 object opened both scopes as its own name scope (recorded while the model is built:
  `_keras_scopes_recorded`), the variables' scope is the only one joining it and the computing scope
  creates no variable: TF names a scope entered again, or a name already taken, `<name>_<k>`, so the
  second unnamed Dense ("dense_1") builds in "dense_1_1" and computes in "dense_1_2", and is "dense_1"
  (as in Keras 2). Every other layer is named by its scope with each component Keras 3 opened
  replaced by the Keras name it opened it for: a model's call scope "bert_backbone_1_2" and its
  layer's "token_embedding_1" make "bert_backbone/token_embedding", whatever TF made unique in
  this graph before (a name two layers would share keeps its scope's name). While ops
  are created (placement), a computing scope takes the layer of a variables-only scope when its
  first op reads those variables or when the same Keras 3 layer opened both. Keras 2's functional
  models, which also apply their layers to the `keras.Input` placeholders, count only the ops the
  loss needs as computation. While a model is recorded, Keras 3 numbers unnamed layers per graph,
  from the names it gave outside recordings (`_keras_names_per_graph`): a profile and a training
  graph built later in the same process name the same layers, and no new layer takes the name of
  one made at a module's top level.
- After unused layers are dropped, a last layer that creates no variables and computes the loss
  (the loss's own scope, e.g. `SparseSoftmaxCrossEntropyWithLogits` at depth 1) joins the layer
  before it.
"""

import collections
import contextlib
import fnmatch
import sys
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from dapple_tf.errors import LayerMarkerError
from dapple_tf.model.layers import LayerRecord


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
        self._variables_only: Dict[str, None] = {}  # provisional names with only variable-creating ops so far
        self._scopes_of: Dict[tf.Operation, tuple] = {}  # op -> (name scope, variable scope, made by a variable)
        self._created: List[tf.Operation] = []
        self._requested_in: List[tuple] = []  # while a variable is created: the scopes it was asked for in
        self._placed_in: Dict[tf.Operation, str] = {}  # op -> its layer as known while ops are created
        self._last_before = -1
        self._provisional_names: List[str] = []  # provisional index -> the name device_for_layer is given
        # Keras 3: TF name scope -> (the object that opened it as its Keras name scope, that Keras name), recorded
        # while the model is built (_keras_scopes_recorded); empty for Keras 2.
        self._keras_scopes: Dict[str, tuple] = {}

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
        if name is None:
            return op.device
        index = self._provisional_index(name, scopes[2], op)
        self._placed_in[op] = name
        if op.device or self.device_for_layer is None:
            return op.device
        return self.device_for_layer(self._provisional_names[index], index) or ""

    def _provisional_index(self, name: str, made_by_variable: bool, op: tf.Operation) -> int:
        """The layer index of a scope as known while ops are created. A computing scope seen for the first time
        shares the index of a variables-only scope (so that variables are placed with their layer's stage;
        _finish decides) when its first op reads that scope's variables, or when Keras 3 opened both as the
        name scope of one layer (its build scope "d0" and its call scope "d0_1")."""
        if name not in self._provisional:
            shared = None if made_by_variable else self._variables_read_by(op) or self._built_by_same_keras_layer(name)
            if shared is not None:
                self._provisional[name] = self._provisional[shared]
                self._variables_only.pop(shared)
                if not self._same_keras_layer(shared, name):  # as _finish names it: after the computing scope
                    self._provisional_names[self._provisional[name]] = self._keras_name(name)
            else:
                self._provisional[name] = len(self._provisional_names)
                self._provisional_names.append(self._keras_name(name))
                if made_by_variable:
                    self._variables_only[name] = None
        elif not made_by_variable:
            self._variables_only.pop(name, None)
        return self._provisional[name]

    def _variables_read_by(self, op: tf.Operation) -> Optional[str]:
        """The variables-only scope whose variables `op` reads, through ops of no scope (the `ReadVariableOp`s
        colocated with a variable), or None."""
        stack, seen = [t.op for t in op.inputs], set()
        while stack:
            producer = stack.pop()
            if producer in seen:
                continue
            seen.add(producer)
            if producer in self._placed_in:
                if self._placed_in[producer] in self._variables_only:
                    return self._placed_in[producer]
            elif producer not in self._scopes_of and producer._id > self._last_before:
                stack.extend(t.op for t in producer.inputs)
        return None

    def _built_by_same_keras_layer(self, name: str) -> Optional[str]:
        return next((v for v in self._variables_only if self._same_keras_layer(v, name)), None)

    def _same_keras_layer(self, first: str, again: str) -> bool:
        """Did one Keras 3 object open both name scopes as its own (a layer's build scope and its call scope)?"""
        a, b = self._keras_scopes.get(first), self._keras_scopes.get(again)
        return a is not None and b is not None and a[0] is not None and a[0] is b[0]

    def _keras_name(self, scope: str) -> str:
        """A scope named by Keras 3's own name scopes where Keras opened them: TF names a name scope entered
        again `<name>_<k>` ("dense_1_1" for the Keras layer "dense_1" when "dense_1" was taken). A name Keras
        made up while recording counts from the names of this graph's models (`_GraphNames`), not from those
        of models built before in the process."""
        counters = _KERAS_NAMES.get(self.graph)
        made_up = counters.made_up if counters is not None else {}
        parts = scope.split("/")
        keras = [self._keras_scopes.get("/".join(parts[:i + 1]), (None, None))[1] for i in range(len(parts))]
        return "/".join(part if name is None else made_up.get(name, name) for part, name in zip(parts, keras))

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
        existing = self.graph.get_operations()
        first = len(existing)
        self._last_before = existing[-1]._id if existing else -1  # ops up to this id were made before recording
        with tf.compat.v1.device(self._place), tf.variable_creator_scope(self._variable_creator), \
                tf.compat.v1.variable_creator_scope(self._variable_creator), _keras_names_per_graph(self.graph), \
                _keras_scopes_recorded(self.graph, self._keras_scopes):
            yield self
        # Every op made meanwhile (ops colocated with a variable skip device functions: no scope of their own).
        self._created = self.graph.get_operations()[first:]
        self.layers = self._finish()

    def drop_layers_unused_by(self, loss: tf.Tensor) -> None:
        """Keeps the layers the loss depends on (a model's unused heads, e.g. slim's `predictions`, go).

        Layers are found again with only the ops the loss needs counting as computation: Keras 2's
        functional models also apply each layer to their `keras.Input` (ops nothing uses) in the scope
        that creates the layer's variables, which is then a variables-only scope like Keras 3's.
        """
        needed, stack = set(), [loss.op]
        while stack:
            op = stack.pop()
            if op not in needed:
                needed.add(op)
                stack.extend(t.op for t in op.inputs)
                stack.extend(op.control_inputs)
        kept = [r for r in self._finish(needed) if any(op in needed for op in r.ops)]
        if len(kept) > 1 and loss.op in kept[-1].ops and not _creates_variables(kept[-1].ops):
            # The loss's own scope (`SparseSoftmaxCrossEntropyWithLogits` at depth 1, a "loss" name scope):
            # no weights, nothing to pipeline; it joins the layer before it.
            order = {op: i for i, op in enumerate(self._created)}
            ops = sorted(kept[-2].ops + kept[-1].ops, key=order.__getitem__)
            kept[-2:] = [LayerRecord(name=kept[-2].name, index=kept[-2].index, ops=ops)]
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

    def _variable_scope_hosts(self, scope_of: Dict[tf.Operation, str], needed=None) -> Dict[str, str]:
        """Scopes that only create variables -> the scope of the first layer computing with them.

        Keras 3 builds a layer (creates its variables) in one name scope and calls it in another
        ("dense" then "dense_1", "sequential/dense" then "sequential_1/dense_1"): the scope holding
        nothing but the creation of variables (ops made under the variable creator) is not a layer of
        its own but part of the layer whose ops read those variables. The readers are found through the
        graph: consumers of the variables' ops, through ops of no scope (the `ReadVariableOp`s
        colocated with a variable), up to the first op of another scope; the earliest such op's scope
        hosts it. A scope whose variables no other scope reads stays a layer. `needed`: when given, only
        these ops count as computation.
        """
        computing = {name for op, name in scope_of.items()
                     if not self._scopes_of[op][2] and (needed is None or op in needed)}
        created = set(self._created)
        order = {op: i for i, op in enumerate(self._created)}
        host: Dict[str, str] = {}
        ops_of: Dict[str, List[tf.Operation]] = {}
        for op, name in scope_of.items():
            if name not in computing:
                ops_of.setdefault(name, []).append(op)
        for name, ops in ops_of.items():
            stack = list(ops)
            seen, readers = set(stack), []
            while stack:
                for out in stack.pop().outputs:
                    for consumer in out.consumers():
                        if consumer in seen or consumer not in created:
                            continue
                        seen.add(consumer)
                        other = scope_of.get(consumer)
                        if other is None:
                            stack.append(consumer)
                        elif other != name:
                            readers.append(consumer)
            reading = [scope_of[op] for op in sorted(readers, key=order.__getitem__) if scope_of[op] in computing]
            if reading:
                host[name] = reading[0]
        return host

    def _finish(self, needed=None) -> List[LayerRecord]:
        op_names = {op.name for op in self._created}
        scope_of: Dict[tf.Operation, str] = {}
        for op in self._created:
            name = self._layer_name(op, op_names)
            if name is not None:
                scope_of[op] = name
        if not scope_of:
            raise LayerMarkerError(
                f"{self.spec!r}: no op was created inside a matching name scope; print the model's op names "
                "(tf.compat.v1.get_default_graph().get_operations()) to choose a depth or patterns"
            )
        host = self._variable_scope_hosts(scope_of, needed)
        index: Dict[str, int] = {}
        for op in self._created:  # numbered by their first computing op: a variables-only scope takes its reader's
            if op in scope_of and scope_of[op] not in host:
                index.setdefault(scope_of[op], len(index))
        layer_of = {op: index[host.get(name, name)] for op, name in scope_of.items()}
        names = {name: name for name in index}
        creating = {name for op, name in scope_of.items() if self._scopes_of[op][2]}
        guests: Dict[str, List[str]] = {}
        for name, computing in host.items():
            guests.setdefault(computing, []).append(name)
        renamed = {computing: self._keras_name(created_in[0]) for computing, created_in in guests.items()
                   if len(created_in) == 1 and computing not in creating
                   and self._same_keras_layer(created_in[0], computing)}
        taken = set()
        for scope in index:  # Keras 3: each scope by the Keras names of the scopes Keras opened, in layer order
            for name in (renamed.get(scope), self._keras_name(scope), scope):
                if name is not None and name not in taken:
                    break
            else:
                name = next(f"{scope}_{k}" for k in range(1, len(index) + 2) if f"{scope}_{k}" not in taken)
            names[scope] = name
            taken.add(name)
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
        return [LayerRecord(name=names[n], index=i, ops=ops[i]) for n, i in index.items()]


_VARIABLE_OP_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable"})


def _creates_variables(ops) -> bool:
    return any(op.type in _VARIABLE_OP_TYPES for op in ops)


def _keras_state():
    """Keras 3's global state module (thread-local state: name counters, name scopes), None for Keras 2."""
    state = sys.modules.get("keras.src.backend.common.global_state")
    return state if state is not None and hasattr(state, "get_global_attribute") else None


class _GraphNames(collections.defaultdict):
    """Keras 3's name counters while building in one graph (name -> names given), starting from the names taken
    outside recordings. `made_up`: each name Keras gave while recording -> the name it would have had had no
    model been built before in the process ("bert_backbone_3" -> "bert_backbone" for this graph's first)."""

    def __init__(self):
        super().__init__(int)
        self.start: Dict[str, int] = {}
        self.made_up: Dict[str, str] = {}

    def __setitem__(self, name, count):  # keras.src.utils.naming.uniquify: counters[name] += 1
        given = count - 1
        if given >= 0 and count > self.get(name, 0):
            ours = given - self.start.get(name, 0)
            self.made_up[name if given == 0 else f"{name}_{given}"] = name if ours <= 0 else f"{name}_{ours}"
        super().__setitem__(name, count)


_KERAS_NAMES = weakref.WeakKeyDictionary()  # graph -> Keras 3's name counters while building in it
_OUTSIDE = threading.local()  # .taken: counts of the names Keras 3 gave outside recordings; .left; .depth


@contextlib.contextmanager
def _keras_names_per_graph(graph: tf.Graph):
    """Keras 3 numbers unnamed layers across the whole process ("dense", then "dense_1" in the next
    graph), Keras 2 per graph. Scope layers are named after them, so a profile and the training graph
    built later in the same process would disagree. While a model is recorded, Keras 3 counts in the
    graph's own counters, which start from the names Keras gave outside recordings (layers made at a
    module's top level, before or between recordings): both graphs name the same layers, and no new
    layer takes the name of one made outside. On leaving (also on an exception), the counters that were
    current (the process's, or an enclosing recording's) continue past every name given inside."""
    state = _keras_state()
    if state is None:  # Keras 2, or Keras 3 not imported yet
        yield
        return
    before = state.get_global_attribute("object_name_uids")
    if not getattr(_OUTSIDE, "depth", 0):  # names given since the last recording ended were given outside
        taken, left = getattr(_OUTSIDE, "taken", {}), getattr(_OUTSIDE, "left", {})
        if before is not getattr(_OUTSIDE, "left_counters", None):  # new counters (keras clear_session): from 0
            taken, left = {}, {}
        for name, count in (before or {}).items():
            if count != left.get(name, 0):
                taken[name] = max(taken.get(name, 0), count)
        _OUTSIDE.taken = taken
    own = _KERAS_NAMES.setdefault(graph, _GraphNames())
    for name, count in _OUTSIDE.taken.items():
        if count > own.get(name, 0):
            dict.__setitem__(own, name, count)  # taken outside: not made up here
            own.start[name] = max(own.start.get(name, 0), count)
    state.set_global_attribute("object_name_uids", own)
    _OUTSIDE.depth = getattr(_OUTSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _OUTSIDE.depth -= 1
        if before is None:
            before = collections.defaultdict(int)
        for name, count in own.items():
            before[name] = max(before.get(name, 0), count)
        state.set_global_attribute("object_name_uids", before)
        if not _OUTSIDE.depth:
            _OUTSIDE.left, _OUTSIDE.left_counters = dict(before), before


@contextlib.contextmanager
def _keras_scopes_recorded(graph: tf.Graph, opened: Dict[str, tuple]):
    """Records, for Keras 3, the TF name scope each Keras name scope opens in `graph`: TF scope -> (the
    object opening it, its Keras name). A Keras 3 layer opens its own name scope (caller=the layer) to
    build and again to be called; TF names the second entry, or a name already taken, `<name>_<k>`."""
    state = _keras_state()
    if state is None:
        yield
        return
    before = state.get_global_attribute("name_scope_stack")
    state.set_global_attribute("name_scope_stack", _RecordingScopeStack(before or [], graph, opened))
    try:
        yield
    finally:
        state.set_global_attribute("name_scope_stack", before)


class _RecordingScopeStack(list):
    """Keras 3's stack of open name scopes; each pushed scope's TF name scope reports the name TF gave it."""

    def __init__(self, items, graph, opened):
        super().__init__(items)
        self._graph, self._opened = graph, opened

    def append(self, entry):
        tf_scope = getattr(entry, "_tf_name_scope", None)
        if tf_scope is not None and not isinstance(tf_scope, _OpenedScope):
            entry._tf_name_scope = _OpenedScope(tf_scope, entry, self._graph, self._opened)
        super().append(entry)


class _OpenedScope:
    def __init__(self, scope, entry, graph, opened):
        self._scope, self._entry, self._graph, self._opened = scope, entry, graph, opened

    def __enter__(self):
        scope_name = self._scope.__enter__()
        if isinstance(scope_name, str) and scope_name and tf.compat.v1.get_default_graph() is self._graph:
            self._opened[scope_name.rstrip("/")] = (getattr(self._entry, "caller", None), self._entry.name)
        return scope_name

    def __exit__(self, *args):
        return self._scope.__exit__(*args)
