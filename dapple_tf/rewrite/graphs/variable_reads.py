"""A stage's GraphDef with the variables it only reads taken as values, for stage functions.

A function holding a stateful operation (a variable read) is instantiated once per call site, each call
keeping its own state, which makes the first step grow with the number of micro-batches again. So the
stage functions (stage_function.py) take variable values: `without_variable_reads` takes a stage's reads
(ReadVariableOp of an input handle) out and turns its row lookups (ResourceGather) into GatherV2 of the
value, for every variable the stage only reads; the caller reads each variable once per step and device.
"""

from typing import Dict, List, Sequence

import tensorflow as tf

from dapple_tf.rewrite.graphs.graph_defs import tensor_name


def variable_shape(handle: tf.Tensor):
    return handle.op.get_attr("shape") if handle.op.type == "VarHandleOp" else None


def without_variable_reads(graph_def: tf.compat.v1.GraphDef, inputs: Sequence[tf.Tensor]):
    """The stage with the variables it only reads taken as values (module docstring), and {handle name: (dtype,
    [names of the tensors to map to the value])}."""
    handles = {t.name: t for t in inputs if t.dtype == tf.resource}
    consumers: Dict[str, List] = {}
    data_read = set()  # nodes whose output some node of the stage reads
    for node in graph_def.node:
        for i in node.input:
            if not i.startswith("^") and tensor_name(i) in handles:
                consumers.setdefault(tensor_name(i), []).append(node)
            if not i.startswith("^"):
                data_read.add(i.split(":")[0])
    reads, gathers = {}, {}
    for handle, nodes in consumers.items():
        if not all(n.op == "ResourceGather" or (n.op == "ReadVariableOp" and n.name in data_read) for n in nodes):
            continue  # written, or read for another stage (a tied weight's value leaving as a stage output): a handle
        dtypes = {n.attr["dtype"].type for n in nodes}
        if len(dtypes) == 1:
            value = f"dapple_value/{handle.split(':')[0]}:0"  # a name no node has: import_graph_def maps it
            looked_up = {n.name: value for n in nodes if n.op == "ResourceGather"}
            reads[handle] = (tf.as_dtype(dtypes.pop()), [n.name + ":0" for n in nodes if n.op == "ReadVariableOp"]
                             + ([value] if looked_up else []))
            gathers.update(looked_up)
    if not reads:
        return graph_def, reads
    dropped = {name.split(":")[0] for _, names in reads.values() for name in names} - set(gathers)
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name in dropped:
            continue
        copy = out.node.add()
        if node.name in gathers:
            _as_gather_v2(node, gathers[node.name], copy, out.node.add())
        else:
            copy.CopyFrom(node)
        if any(i.startswith("^") and i[1:] in dropped for i in copy.input):  # control edges on a read: gone
            kept = [i for i in copy.input if not (i.startswith("^") and i[1:] in dropped)]
            del copy.input[:]
            copy.input.extend(kept)
    return out, reads


def _as_gather_v2(node, value: str, gather, axis) -> None:
    """Fills `gather` (and its `axis` constant) with the GatherV2 of `value` that computes ResourceGather `node`."""
    batch_dims = node.attr["batch_dims"].i if "batch_dims" in node.attr else 0
    axis.name = f"{node.name}/dapple_axis"
    axis.op = "Const"
    axis.attr["dtype"].type = tf.int32.as_datatype_enum
    axis.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(batch_dims, tf.int32))
    gather.name = node.name
    gather.op = "GatherV2"
    gather.input.extend([value, node.input[1], axis.name] + [i for i in node.input[2:] if i.startswith("^")])
    gather.attr["Tparams"].type = node.attr["dtype"].type
    gather.attr["Tindices"].type = node.attr["Tindices"].type
    gather.attr["Taxis"].type = tf.int32.as_datatype_enum
    gather.attr["batch_dims"].i = batch_dims
