"""A per-host graph holds only what its task reads: built in a scratch copy of the graph, imported in part.

Every task traces the whole model as its template: its own variables' initial values depend on every random
operation the model makes before them (with a graph seed, TF gives each random operation made without a seed of
its own the count of such operations made in its graph before it). So the template cannot be traced in part; but
once traced, each random operation carries its seeds as attributes. `build_in_scratch` therefore builds the
pipeline in a scratch graph that starts as a copy of the task's graph (its operations, collections and seed count),
then imports into the task's graph, under the same names, only the operations the task's part reads: everything
the passes made after the template, what those read of the template (the task's own variables and their
initializers, the handles of other tasks' variables it copies, externals), and the graph's collections restricted
to them. Other tasks' layers, whose template grows with the model, stay in the scratch graph.
"""

import dataclasses
import weakref
from typing import Callable, Dict, List, Sequence, Set, Tuple

import tensorflow as tf
from tensorflow.python.framework import importer, meta_graph, ops, random_seed

from dapple_tf.rewrite.graphs import graph_walk
from dapple_tf.rewrite.hosts import host_part

# Collections not carried over: control flow contexts name every operation of a loop or branch (the template's
# are partly left behind), and no pass builds on them after the build.
_SKIPPED_COLLECTIONS = {tf.compat.v1.GraphKeys.WHILE_CONTEXT, tf.compat.v1.GraphKeys.COND_CONTEXT}

# A scratch graph whose operations call Python functions (tf.py_function) stays alive with the graph its part went
# into: the functions are registered for as long as the graph that made them lives.
_SCRATCH_OF = weakref.WeakKeyDictionary()
_PYTHON_FUNCTION_OPS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


class CrossGraphError(ValueError):
    """model_fn, the inputs or the optimizer use a tensor of the task's graph made outside build_pipeline's
    arguments, which the scratch graph cannot read."""


def build_graph(graph: tf.Graph, build: Callable, arguments, fields: Sequence[str], options):
    """`build(graph, arguments)`'s handle (build returns (handle, first_part_op)): in `graph` itself for one graph
    (options.own_task None) or with options.whole_template; else built in a scratch copy of `graph`, of which `graph`
    receives only what the task's part reads (`build_in_scratch`; the handle's `fields` as `graph`'s). A model_fn
    reading a tensor made outside it falls back to `graph`. A task's handle names the tasks its graph places
    operations on (`tasks_used`)."""
    if options.own_task is None:
        return build(graph, arguments)[0]
    values = {}
    if options.whole_template:
        handle = build(graph, arguments)[0]
    else:
        try:
            handle, values = build_in_scratch(graph, lambda scratch_arguments: build(
                tf.compat.v1.get_default_graph(), scratch_arguments), arguments, fields)
        except CrossGraphError as e:
            tf.compat.v1.logging.warning(
                f"this task's graph keeps every task's layers (PipelineOptions.whole_template): building in a scratch "
                f"graph failed on a tensor made outside model_fn ({e})")
            handle = build(graph, arguments)[0]
    return dataclasses.replace(handle, tasks=tasks_used(options.own_task, graph), **values)


def tasks_used(own_task: str, graph: tf.Graph) -> Tuple[str, ...]:
    """The own task, then the other tasks the graph places operations on. Not only those a step runs
    operations on: a session places every operation of its graph (with PipelineOptions.whole_template, the
    template's on every stage's first device), and one on a task outside its device filters is an error even if it
    never runs."""
    own = host_part.task_of(own_task)
    devices = {op.device for op in graph.get_operations()}
    used = {host_part.task_of(d) for d in devices if tf.DeviceSpec.from_string(d).job is not None} - {own}
    return (own,) + tuple(sorted(used))


def build_in_scratch(graph: tf.Graph, build: Callable, arguments, fields: Sequence[str]) -> Tuple[object, dict]:
    """Runs `build(scratch_arguments)` in a scratch copy of `graph` and imports what it needs into `graph`.

    `arguments`: a nest of `graph`'s tensors and variables, given to `build` as the scratch graph's.
    `build` returns (result, first_part_op): its result and the number of the scratch graph's operations made
    before the part of the task (the end of the template). `fields`: the result's attributes that hold nests of
    tensors, operations and variables (the template's too: a train_op model_fn returned), kept with what they read.
    Returns (result, {field: its value in `graph`})."""
    scratch = _copy_of(graph)
    with scratch.as_default():
        try:
            copied = {v.op.name: v for v in _variables(scratch)}
            result, first_part_op = build(tf.nest.map_structure(lambda x: _in(scratch, x, copied), arguments))
        except ValueError as e:
            if "must be from the same graph" in str(e) or "is not an element of this graph" in str(e):
                raise CrossGraphError(str(e)) from e
            raise
    values = {field: getattr(result, field) for field in fields}
    kept = _kept_operations(scratch, len(graph.get_operations()), first_part_op, _operations_of(values))
    _import(scratch, graph, kept)
    variables = _restore_collections(scratch, graph, kept)
    random_seed._graph_to_seed_dict[graph] = random_seed._graph_to_seed_dict.get(scratch, 0)  # pylint: disable=protected-access
    if any(op.type in _PYTHON_FUNCTION_OPS for op in kept):
        _SCRATCH_OF[graph] = scratch
    return result, tf.nest.map_structure(lambda x: _in(graph, x, variables), values)


def _copy_of(graph: tf.Graph) -> tf.Graph:
    """A new graph with `graph`'s operations, collections, graph seed and count of seeded random operations."""
    scratch = tf.Graph()
    scratch.seed = graph.seed
    with scratch.as_default():
        meta_graph.import_scoped_meta_graph(tf.compat.v1.train.export_meta_graph(
            graph=graph, collection_list=[key for key in graph.get_all_collection_keys() if _serializable(graph, key)]))
    random_seed._graph_to_seed_dict[scratch] = random_seed._graph_to_seed_dict.get(graph, 0)  # pylint: disable=protected-access
    copied = [op.name for op in scratch.get_operations()]
    if copied != [op.name for op in graph.get_operations()]:
        raise AssertionError("the scratch copy of the graph does not have the graph's operations in its order")
    return scratch


def _serializable(graph: tf.Graph, key: str) -> bool:
    """Whether a meta graph can hold the collection: operations, tensors, strings and numbers, or items with proto
    functions (TF warns of the others, Python objects some library keeps in the graph, and leaves them out)."""
    return bool(ops.get_to_proto_function(key)) or all(
        isinstance(item, (tf.Tensor, tf.Operation, str, bytes, int, float)) for item in graph.get_collection(key))


def _operations_of(values) -> List[tf.Operation]:
    """The operations of the tensors, operations, variables and IndexedSlices in a nest."""
    found = []
    for x in tf.nest.flatten(values, expand_composites=True):
        if isinstance(x, (tf.Tensor, tf.Variable)):
            found.append(x.op)
        elif isinstance(x, tf.Operation):
            found.append(x)
    return found


def _kept_operations(scratch: tf.Graph, copied: int, first_part_op: int, roots: List[tf.Operation]
                     ) -> Set[tf.Operation]:
    """The scratch graph's new operations the task's part reads: the part itself and `roots`, what they depend on,
    what they are colocated with (the importer needs them; the one graph places them so), and what the variables
    among them name (their initializers and reads, which the variables' Python objects are made of)."""
    operations = scratch.get_operations()
    new = set(operations[copied:])
    variables = _variables(scratch)
    kept, wanted = set(), operations[first_part_op:] + roots
    while wanted:
        added = graph_walk.ancestors_within(wanted, new) - kept
        kept |= added
        named = [scratch.get_operation_by_name(group[len(b"loc:@"):].decode())
                 for op in added for group in op.colocation_groups()]
        named += [scratch.as_graph_element(name) for v in variables if v.op in added
                  for name in _names_in(v.to_proto())]
        wanted = [x for x in (getattr(x, "op", x) for x in named) if x not in kept]
    return kept


def _variables(graph: tf.Graph) -> List[tf.Variable]:
    """Every variable in the graph's collections, once."""
    found = {}
    for key in graph.get_all_collection_keys():
        for item in graph.get_collection(key):
            if isinstance(item, tf.Variable):
                found.setdefault(item.op.name, item)
    return list(found.values())


def _names_in(variable_def) -> List[str]:
    return [name for name in (variable_def.variable_name, variable_def.initializer_name, variable_def.snapshot_name,
                              variable_def.initial_value_name) if name]


def _import(scratch: tf.Graph, graph: tf.Graph, kept: Set[tf.Operation]) -> None:
    """Imports `kept` into `graph` under their names: inputs from operations `graph` already has are mapped to
    them (data inputs by the importer, control inputs added after, which it maps only under a name prefix), and
    colocations with them kept as they are; functions `graph` defines are not defined again."""
    source = scratch.as_graph_def()
    names = {op.name for op in kept}
    existing = {op.name for op in graph.get_operations()}
    part = tf.compat.v1.GraphDef()
    part.versions.CopyFrom(source.versions)
    present = graph.as_graph_def().library
    defined = {f.signature.name for f in present.function}
    part.library.function.extend(f for f in source.library.function if f.signature.name not in defined)
    with_gradients = {g.function_name for g in present.gradient}
    part.library.gradient.extend(g for g in source.library.gradient if g.function_name not in with_gradients)
    input_map, control_inputs = {}, []
    for node in source.node:
        if node.name not in names:
            continue
        copy = part.node.add()
        copy.CopyFrom(node)
        del copy.input[:]
        for name in node.input:
            if name.startswith("^") and name[1:] in existing:
                control_inputs.append((node.name, name[1:]))
                continue
            copy.input.append(name)
            if name.split(":")[0] in existing:
                input_map[name] = graph.get_tensor_by_name(name if ":" in name else name + ":0")
    with graph.as_default():  # colocations with `graph`'s operations are valid: the importer sees only `part`
        importer._import_graph_def_internal(part, input_map=input_map, name="",  # pylint: disable=protected-access
                                            validate_colocation_constraints=False)
    for name, control in control_inputs:
        graph.get_operation_by_name(name)._add_control_input(graph.get_operation_by_name(control))  # pylint: disable=protected-access


def _restore_collections(scratch: tf.Graph, graph: tf.Graph, kept: Set[tf.Operation]) -> Dict[str, tf.Variable]:
    """Adds to `graph`'s collections what the scratch graph's hold of `kept` or of `graph`'s own operations
    (variables, tensors and operations; other Python objects are the build's own). Returns every variable of
    `graph` by its operation's name, one object each."""
    variables = {v.op.name: v for v in _variables(graph)}
    existing = {op.name for op in graph.get_operations()}
    from_proto = ops.get_from_proto_function(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    for key in scratch.get_all_collection_keys():
        if key in _SKIPPED_COLLECTIONS:
            continue
        present = {_operation_name(x) for x in graph.get_collection(key)}
        for item in scratch.get_collection(key):
            name = _operation_name(item)
            if name is None or name in present or (name not in existing
                                                   and scratch.get_operation_by_name(name) not in kept):
                continue
            if isinstance(item, tf.Variable):
                if name not in variables:
                    with graph.as_default():
                        variables[name] = from_proto(item.to_proto())
                graph.add_to_collection(key, variables[name])
            else:
                graph.add_to_collection(key, graph.as_graph_element(item.name))
    return variables


def _operation_name(item):
    """The name of the operation of a variable, tensor or operation; None for anything else."""
    if isinstance(item, (tf.Variable, tf.Tensor)):
        return item.op.name
    return item.name if isinstance(item, tf.Operation) else None


def _in(graph: tf.Graph, value, variables: Dict[str, tf.Variable]):
    """`value` (a tensor, operation, variable, IndexedSlices or anything else) as `graph`'s."""
    if isinstance(value, tf.Variable):
        return variables[value.op.name]
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(*(None if t is None else _in(graph, t, variables)
                                  for t in (value.values, value.indices, value.dense_shape)))
    if isinstance(value, (tf.Tensor, tf.Operation)):
        return graph.as_graph_element(value.name)
    return value
