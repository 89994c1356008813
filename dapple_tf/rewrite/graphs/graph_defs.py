"""GraphDefs of one stage's operations, to import once per micro-batch and replica.

`stage_graph_defs` cuts the template into one GraphDef per stage: device fields and colocation
attributes cleared (the replica's device scope places the clone), control inputs from outside the
stage dropped, and the functions its control flow calls (tf.cond/tf.while_loop bodies, nested
calls) attached. `private_copy` makes one clone's copy: the functions renamed (TF's gradients
of functional control flow rewrite the forward functions under names derived from the
originals, so clones sharing them would collide), and random ops with a fixed seed given a
seed of the clone's own (else every micro-batch and replica would draw the same dropout mask).
A stage's control flow v1 contexts go with its GraphDef, for its clones (v1_control_flow.py).
"""

import dataclasses
from typing import Dict, List, Sequence, Set

import tensorflow as tf
from tensorflow.core.framework import function_pb2

from dapple_tf.rewrite.graphs import v1_control_flow


@dataclasses.dataclass
class StageGraphDef:
    graph_def: tf.compat.v1.GraphDef
    function_names: Set[str]  # functions the stage calls, directly or not
    seeded: bool  # some random op has a fixed (non-zero) seed
    contexts: List[object] = dataclasses.field(default_factory=list)  # control flow v1 (v1_control_flow.py)


def tensor_name(graph_def_input: str) -> str:
    """The tensor a NodeDef input names ("op" -> "op:0"; "op:1" as it is)."""
    return graph_def_input if ":" in graph_def_input else graph_def_input + ":0"


def _seeded(node) -> bool:
    return "seed2" in node.attr and (node.attr["seed"].i != 0 or node.attr["seed2"].i != 0)


def _reseed(node, salt: int) -> None:
    if _seeded(node):
        node.attr["seed2"].i = (node.attr["seed2"].i * 1000003 + salt) % (2**31 - 1)


def _referenced(attr_value) -> List[str]:
    names = [attr_value.func.name] if attr_value.HasField("func") else []
    return names + [f.name for f in attr_value.list.func]


def _calls(node, library: Dict[str, function_pb2.FunctionDef]) -> List[str]:
    names = [name for value in node.attr.values() for name in _referenced(value)]
    if node.op in library:
        names.append(node.op)
    return names


def _function_closure(nodes, library) -> Set[str]:
    found, stack = set(), [name for node in nodes for name in _calls(node, library)]
    while stack:
        name = stack.pop()
        if name in found or name not in library:
            continue
        found.add(name)
        stack.extend(n for node in library[name].node_def for n in _calls(node, library))
    return found


def stage_graph_defs(graph: tf.Graph, stage_ops: Sequence[Sequence[tf.Operation]]) -> List[StageGraphDef]:
    """One StageGraphDef per list of operations (a stage's, in creation order)."""
    full = graph.as_graph_def()
    nodes = {node.name: node for node in full.node}
    library = {f.signature.name: f for f in full.library.function}
    result = []
    for ops in stage_ops:
        names = {op.name for op in ops}
        out = tf.compat.v1.GraphDef()
        out.versions.CopyFrom(full.versions)
        for op in ops:
            node = out.node.add()
            node.CopyFrom(nodes[op.name])
            node.device = ""
            if "_class" in node.attr:
                del node.attr["_class"]
            kept = [i for i in node.input if not i.startswith("^") or i[1:] in names]
            del node.input[:]
            node.input.extend(kept)
        functions = _function_closure(out.node, library)
        for name in sorted(functions):
            out.library.function.add().CopyFrom(library[name])
        nodes_everywhere = list(out.node) + [n for f in out.library.function for n in f.node_def]
        result.append(StageGraphDef(out, functions, any(_seeded(n) for n in nodes_everywhere),
                                    v1_control_flow.export(ops)))
    return result


def _rename_calls(node, mapping: Dict[str, str]) -> None:
    if node.op in mapping:
        node.op = mapping[node.op]
    for value in node.attr.values():
        if value.HasField("func") and value.func.name in mapping:
            value.func.name = mapping[value.func.name]
        for f in value.list.func:
            if f.name in mapping:
                f.name = mapping[f.name]


def private_copy(stage: StageGraphDef, suffix: str, salt: int) -> tf.compat.v1.GraphDef:
    """The stage's GraphDef with every function it calls renamed `<name><suffix>`, and every
    fixed-seed random op's seed2 mixed with `salt` (distinct per clone)."""
    if not stage.function_names and not stage.seeded:
        return stage.graph_def
    mapping = {name: name + suffix for name in stage.function_names}
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(stage.graph_def)
    for node in out.node:
        _rename_calls(node, mapping)
        _reseed(node, salt)
    for function in out.library.function:
        function.signature.name = mapping[function.signature.name]
        for node in function.node_def:
            _rename_calls(node, mapping)
            _reseed(node, salt)
    return out
