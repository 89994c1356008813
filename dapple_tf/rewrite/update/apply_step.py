"""The user's optimizer applied to every variable copy, whatever the optimizer builds.

`apply` calls `optimizer.apply_gradients` once with the (gradient, copy) pairs of every device, so that
`global_step` advances once and shared optimizer state (Adam's beta powers) is updated once, then reads what the
call created:
- placement: a `tf.compat.v1.train.Optimizer` subclass may override `apply_gradients` and make its slots with
  `get_variable` there, outside any device or colocation scope (TF1 BERT's AdamWeightDecayOptimizer). The ops it
  created unplaced are grouped by their data edges; a group fed from one device only (its copy's handle, its
  gradient) is placed there, slots included, instead of on the default device.
- slots: each variable the call created for one copy alone (found through the copy's update) is a slot of that
  copy. A copy's slots are local variables (checkpoints keep the single-device set) paired, in creation order,
  with the user's variable's, for the broadcast after initialization and restores.
- one update for all: the operations computing each copy's update must be those computing the user's variable's
  (compared by op types and attributes, names aside). An optimizer that decides by variable name (weight-decay
  exclusions) and does not recognize the copy (named `<variable>/dapple_copy`) would train the replicas apart:
  build_pipeline refuses it, naming the variable.
"""

import contextlib
import dataclasses
from typing import Dict, List, Sequence, Set, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.rewrite.graphs import graph_walk
from dapple_tf.rewrite.update.replicas import VariableCopies

_GLOBAL = tf.compat.v1.GraphKeys.GLOBAL_VARIABLES
_LOCAL = tf.compat.v1.GraphKeys.LOCAL_VARIABLES
_VARIABLE_OPS = ("VarHandleOp", "VariableV2")
_IGNORED_ATTRS = {"_class", "shared_name", "container", "_output_shapes", "debug_name"}


@dataclasses.dataclass
class AppliedStep:
    apply_op: tf.Operation
    slot_pairs: List[Tuple[tf.Variable, tf.Variable]]  # (user's slot, copy's slot) of slots made outside get_slot


def _handle_op(variable: tf.Variable) -> tf.Operation:
    return variable.handle.op if hasattr(variable, "handle") else variable.op


def _writes(created: Sequence[tf.Operation]) -> Dict[tf.Operation, List[tf.Operation]]:
    """Variable-creating op -> the created ops that write it (resource updates take the handle first)."""
    out: Dict[tf.Operation, List[tf.Operation]] = {}
    for op in created:
        if op.inputs and op.inputs[0].dtype == tf.resource and op.type not in ("ReadVariableOp",
                                                                                 "VarIsInitializedOp"):
            out.setdefault(op.inputs[0].op, []).append(op)
    return out


def _fingerprint(ops: Sequence[tf.Operation]) -> List[tuple]:
    """What an update computes, names and reads aside (a variable with a caching device is read once, at its
    creation; its copy where it is used)."""
    def attrs(op):
        return tuple(sorted((k, str(v)) for k, v in op.node_def.attr.items() if k not in _IGNORED_ATTRS))

    return sorted((op.type, len(op.inputs), attrs(op)) for op in ops
                  if op.type != "ReadVariableOp" and op.type not in _VARIABLE_OPS)


def _place_unplaced(created: Sequence[tf.Operation]) -> None:
    """Groups of unplaced, uncolocated created ops joined by data edges, fed from one device: placed there."""
    free = [op for op in created if not op.device and op.colocation_groups() == [f"loc:@{op.name}".encode()]]
    parent = {op: op for op in free}

    def root(op):
        while parent[op] is not op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op

    for op in free:
        for t in op.inputs:
            if t.op in parent:
                parent[root(t.op)] = root(op)
    devices: Dict[tf.Operation, Set[str]] = {}
    for op in free:
        for t in op.inputs:
            if t.op not in parent and t.op.device:
                devices.setdefault(root(op), set()).add(t.op.device)
    for op in free:
        found = devices.get(root(op), set())
        if len(found) == 1:
            op._set_device(next(iter(found)))  # pylint: disable=protected-access


def apply(optimizer, apply_pairs, global_step, copies: VariableCopies, after: tf.Operation,
          applied_before: bool = False, remote_users: Sequence[tf.Variable] = (), elsewhere=None) -> AppliedStep:
    """optimizer.apply_gradients(apply_pairs) after `after`; see the module docstring. `applied_before`: the
    script's own apply_gradients already ran on the user's variables in the template (script_training.py), so
    their slots exist: an optimizer making them with get_variable gets them again (AUTO_REUSE), as slot_creator's
    do by itself. `remote_users` (per-host graphs): other tasks' variables whose copies this graph applies; a second
    call, never run, makes their slots here under the names their own task gives them, so that the copies' slots
    pair with them (and are set from them after a restore) as in the one graph. `elsewhere` (the lowering's:
    variables -> those of them on other tasks' devices, none in one graph): a non-slot variable the script's own
    apply made on another task's device (Adam's beta powers, advanced once per step by each task's apply) gets a
    local copy here, set from it like a slot."""
    graph = after.graph
    copy_grads = {id(copy): grad for grad, copy in apply_pairs}
    with tf.control_dependencies(None):
        remote_pairs = []
        for user in remote_users:
            like = next(copy_grads[id(c)] for c in copies.copies_of(user).values() if id(c) in copy_grads)
            with tf.device(user.device):
                remote_pairs.append((_zero_gradient(user, like), user))
    first = len(graph.get_operations())
    reuse = tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=tf.compat.v1.AUTO_REUSE) \
        if applied_before else contextlib.nullcontext()
    non_slot = _remote_non_slot_variables(optimizer, graph, elsewhere) if applied_before and elsewhere else {}
    with tf.control_dependencies([after]), reuse, _swapped(optimizer, non_slot, apply_pairs):
        apply_op = optimizer.apply_gradients(apply_pairs, global_step=global_step)
        if remote_pairs:
            with tf.name_scope("dapple_remote_slots"):
                optimizer.apply_gradients(remote_pairs)
    created_list = graph.get_operations()[first:]
    created = set(created_list)
    _place_unplaced(created_list)
    writes = _writes(created_list)
    cones = {copy: sorted(graph_walk.ancestors_within(writes.get(_handle_op(copy), []), created, control=False),
                          key=lambda op: op._id)  # creation order  # pylint: disable=protected-access
             for _, copy in list(apply_pairs) + remote_pairs}
    slot_pairs = _check_and_pair(cones, copies, graph, type(optimizer).__name__)
    return AppliedStep(apply_op, slot_pairs + [(v, c) for v, c in non_slot.values() if c is not None])


def _remote_non_slot_variables(optimizer, graph: tf.Graph, elsewhere) -> Dict[tuple, list]:
    """Key -> [variable, None] of a tf.compat.v1.train.Optimizer's non-slot variables of `graph` that `elsewhere`
    finds on other tasks."""
    table = getattr(optimizer, "_non_slot_dict", {})
    own_graph = {key: v for key, v in table.items() if key[1] is graph}
    remote = {id(v) for v in elsewhere(list(own_graph.values()))}
    return {key: [v, None] for key, v in own_graph.items() if id(v) in remote}


@contextlib.contextmanager
def _swapped(optimizer, non_slot: Dict[tuple, list], apply_pairs):
    """Within: the optimizer's remote non-slot variables replaced by local copies (local variables, on the device of
    the first variable it applies, as it places its own), recorded in `non_slot`."""
    if not non_slot:
        yield
        return
    table = optimizer._non_slot_dict  # pylint: disable=protected-access
    device = min((copy for _, copy in apply_pairs), key=lambda v: v.op.name).device
    for key, pair in non_slot.items():
        variable = pair[0]
        with tf.device(device), tf.control_dependencies(None):
            pair[1] = table[key] = tf.compat.v1.Variable(
                tf.zeros(variable.shape, variable.dtype.base_dtype), trainable=False, collections=[_LOCAL],
                name=f"{variable.op.name}/dapple_copy", use_resource=True)
    try:
        yield
    finally:
        for key, (variable, _) in non_slot.items():
            table[key] = variable


def _zero_gradient(variable: tf.Variable, like):
    """A gradient of `variable` that changes nothing, of the kind of `like` (the copy's): gathered rows
    (IndexedSlices) make the optimizer build its sparse update, as for the copy."""
    dtype = variable.dtype.base_dtype
    if not isinstance(like, tf.IndexedSlices):
        return tf.zeros(variable.shape, dtype)
    values = tf.zeros(tf.TensorShape([0]).concatenate(variable.shape[1:]), dtype)
    shape = tf.constant(variable.shape.as_list(), like.indices.dtype)  # variables' shapes are known
    return tf.IndexedSlices(values, tf.zeros([0], like.indices.dtype), shape)


def _check_and_pair(cones: Dict[tf.Variable, List[tf.Operation]], copies: VariableCopies, graph: tf.Graph,
                    optimizer_name: str):
    """The one-update check and the (user slot, copy slot) pairs of slots the optimizer made itself."""
    touched = {variable: _variables_touched(cone, variable) for variable, cone in cones.items()}
    owners: Dict[tf.Operation, List[tf.Variable]] = {}
    for variable, ops in touched.items():
        for op in ops:
            owners.setdefault(op, []).append(variable)
    variables_by_op = {_handle_op(v): v for v in graph.get_collection(_GLOBAL) + graph.get_collection(_LOCAL)}
    pairs, made_local = [], []
    for user, copy in copies.extra_copies():
        if user not in cones or copy not in cones:
            continue
        if _fingerprint(cones[user]) != _fingerprint(cones[copy]):
            raise DappleError(
                f"the optimizer ({optimizer_name}) builds a different update for {copy.op.name}, the copy of "
                f"{user.op.name} on another device, than for the variable itself: copies must train exactly like it. "
                "Does it decide by variable name (which variables get weight decay)? Match names with re.search (a "
                "copy's name contains its variable's) rather than whole names or an end anchor")
        own = [[op for op in touched[v] if owners[op] == [v]] for v in (user, copy)]
        for user_slot_op, copy_slot_op in zip(*own):
            user_slot, copy_slot = variables_by_op.get(user_slot_op), variables_by_op.get(copy_slot_op)
            if user_slot is None or copy_slot is None:
                continue
            made_local.append(copy_slot)
            pairs.append((user_slot, copy_slot))
    _make_local(graph, made_local)
    return pairs


def _variables_touched(cone: Sequence[tf.Operation], variable: tf.Variable) -> List[tf.Operation]:
    """The variable-creating ops an update's ops create or read a handle of (slots made before this call too),
    in creation order, the variable itself left out."""
    found = {op for op in cone if op.type in _VARIABLE_OPS}
    found.update(t.op for op in cone for t in op.inputs if t.op.type in _VARIABLE_OPS)
    found.discard(_handle_op(variable))
    return sorted(found, key=lambda op: op._id)  # pylint: disable=protected-access


def _make_local(graph: tf.Graph, variables: List[tf.Variable]) -> None:
    """Moves `variables` from the global variables to the local ones, in their order (by identity: comparing
    variables costs a call into TF each, and the collection holds every variable of the graph)."""
    global_vars = graph.get_collection_ref(_GLOBAL)
    moved = {id(v) for v in global_vars} & {id(v) for v in variables}
    global_vars[:] = [v for v in global_vars if id(v) not in moved]
    added = set()
    for variable in variables:
        if id(variable) in moved and id(variable) not in added:
            added.add(id(variable))
            graph.add_to_collection(_LOCAL, variable)
