"""TF1 control flow in cloned stages: while loops and conds built with control flow v1 (`tf.compat.v1.nn.dynamic_rnn`
or `tf.while_loop` after `tf.compat.v1.disable_v2_behavior()` / `disable_control_flow_v2()`).

Their graph (Enter, Merge, Switch, NextIteration, Exit) imports like any other, but `tf.gradients` through such a
loop needs the Python-side context TF keeps beside it (a WhileContext naming its pivot, enters, exits and the
values it uses), which `import_graph_def` does not make; and every loop runs in the frame its Enter ops name, so
two clones of one loop would share a frame. So:
- `export` records the contexts of a stage's operations as protos (WhileContextDef / CondContextDef, as a
  MetaGraphDef carries them);
- `rename_frames` gives each clone's Enter nodes a frame of the clone's own (`<clone scope>/<frame>`);
- `restore` makes the clone's contexts from the protos, with every name the clone's: its own ops under the
  clone's scope, tensors fed to it (input_map) by their own names, names of ops the stage does not run dropped.
"""

from typing import Dict, List, Set

import tensorflow as tf
from tensorflow.core.protobuf import control_flow_pb2
from tensorflow.python.ops import control_flow_ops

_KINDS = {control_flow_pb2.WhileContextDef: control_flow_ops.WhileContext,
          control_flow_pb2.CondContextDef: control_flow_ops.CondContext}


def _context(op: tf.Operation):
    return op._get_control_flow_context()  # pylint: disable=protected-access


def export(ops) -> List[object]:
    """The outermost control flow v1 contexts of `ops`, as protos, in the order their ops were created."""
    found = {}
    for op in ops:
        context = _context(op)
        while context is not None and context.outer_context is not None:
            context = context.outer_context
        if context is not None and isinstance(context, tuple(_KINDS.values())) and context.name not in found:
            found[context.name] = context.to_proto()
    return list(found.values())


def in_control_flow(op: tf.Operation) -> bool:
    """Whether `op` runs inside a TF1 while loop or tf.cond (or is one of their Switch, Merge, Enter, Exit ops)."""
    return _context(op) is not None or op.type in ("Switch", "Merge", "Enter", "Exit", "NextIteration",
                                                   "RefSwitch", "RefMerge", "RefEnter", "RefExit", "RefNextIteration")


def frame_of(op: tf.Operation):
    """The control flow v1 context whose frame runs `op` (None: the step's own frame); an Exit hands its value
    to the frame around its loop."""
    context = _context(op)
    return context.outer_context if context is not None and op.type in ("Exit", "RefExit") else context


def may_wait_outside(op: tf.Operation) -> bool:
    """Whether `op` may take a control input from an op of the step's own frame: its ops do, and so do the Enter
    ops of a loop in that frame (they take their inputs from it); nothing inside a loop may."""
    frame = frame_of(op)
    return frame is None or op.type in ("Enter", "RefEnter") and frame.outer_context is None


def loop_exits(op: tf.Operation) -> List[tf.Operation]:
    """The Exit ops of every TF1 while loop `op` runs in: a stage that runs part of a loop runs all of it (the
    gradient of a loop needs each of its loop variables' exits)."""
    exits, context = [], _context(op)
    while context is not None:
        if isinstance(context, control_flow_ops.WhileContext):
            exits.extend(t.op for t in context.loop_exits)
        context = context.outer_context
    return exits


def rename_frames(graph_def: tf.compat.v1.GraphDef, scope: str) -> None:
    """Each Enter node's frame becomes `<scope>/<frame>` (the frame of the clone imported under `scope`)."""
    for node in graph_def.node:
        if node.op in ("Enter", "RefEnter"):
            node.attr["frame_name"].s = f"{scope}/{node.attr['frame_name'].s.decode()}".encode()


class _Names:
    """A template name as the clone has it: its own ops under `scope`, fed tensors by their own names."""

    def __init__(self, scope: str, feed: Dict[str, tf.Tensor], present: Set[str]):
        self.scope, self.feed, self.present = scope, feed, present

    def tensor(self, name: str):
        if name in self.feed:
            return self.feed[name].name
        return f"{self.scope}/{name}" if name.split(":")[0] in self.present else None

    def scoped(self, name: str) -> str:
        return f"{self.scope}/{name}"


def _rewrite_values(values_def, names: _Names) -> None:
    external = {}
    for key, value in values_def.external_values.items():
        k, v = names.tensor(key), names.tensor(value)
        if k is not None and v is not None:
            external[k] = v
    values = [n for n in (names.tensor(v) for v in values_def.values) if n is not None]
    values_def.ClearField("values")
    values_def.values.extend(sorted(set(values)))
    values_def.ClearField("external_values")
    for k, v in external.items():
        values_def.external_values[k] = v


def _rewrite(proto, names: _Names) -> None:
    proto.context_name = names.scoped(proto.context_name)
    if isinstance(proto, control_flow_pb2.WhileContextDef):
        for field in ("pivot_name", "pivot_for_pred_name", "pivot_for_body_name"):
            setattr(proto, field, names.tensor(getattr(proto, field)))
        if proto.maximum_iterations_name:
            proto.maximum_iterations_name = names.tensor(proto.maximum_iterations_name) or ""
        for field in ("loop_exit_names", "loop_enter_names"):
            kept = [n for n in (names.tensor(t) for t in getattr(proto, field)) if n is not None]
            proto.ClearField(field)
            getattr(proto, field).extend(kept)
    else:
        proto.pred_name = names.tensor(proto.pred_name)
        proto.pivot_name = names.tensor(proto.pivot_name)
    _rewrite_values(proto.values_def, names)
    for nested in proto.nested_contexts:
        _rewrite(nested.while_ctxt if nested.HasField("while_ctxt") else nested.cond_ctxt, names)


def restore(protos: List[object], scope: str, feed: Dict[str, tf.Tensor], present: Set[str]) -> None:
    """The contexts of the clone imported under `scope`, fed `feed` (template tensor name -> tensor), holding the
    template ops named in `present`."""
    names = _Names(scope, feed, present)
    for proto in protos:
        copy = type(proto)()
        copy.CopyFrom(proto)
        _rewrite(copy, names)
        _KINDS[type(copy)].from_proto(copy)


def import_clone(graph_def: tf.compat.v1.GraphDef, contexts: List[object], input_map: Dict[str, tf.Tensor],
                 return_elements: List[str], name: str) -> List[tf.Tensor]:
    """tf.compat.v1.import_graph_def of a clone under `name`; with control flow v1 `contexts`, its Enter frames
    renamed and its contexts restored."""
    if not contexts:
        return tf.compat.v1.import_graph_def(graph_def, input_map=input_map, return_elements=return_elements,
                                             name=name)
    scope = tf.compat.v1.get_default_graph().unique_name(name, mark_as_used=False)
    renamed = tf.compat.v1.GraphDef()
    renamed.CopyFrom(graph_def)
    rename_frames(renamed, scope)
    results = tf.compat.v1.import_graph_def(renamed, input_map=input_map, return_elements=return_elements, name=name)
    restore(contexts, scope, input_map, {node.name for node in graph_def.node})
    return results
