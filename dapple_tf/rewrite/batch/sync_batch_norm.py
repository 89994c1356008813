"""Synchronized batch norm (PipelineOptions(batch_norm="sync")): statistics over a stage's replicas.

A replicated stage's clones each see a slice of the micro-batch. `rewrite` changes the stage's
GraphDef (before it is cloned) so that every batch statistic (normalization.SampleAxes.batch_statistics,
decided on the template graph by the axes the statistics reduce over: per-sample normalizations such as
Keras 2's LayerNormalization, which also runs FusedBatchNormV3, are left alone) is the whole micro-batch's.
A non-fused statistic (a Mean keeping dims over the batch axis: tf.nn.moments, so Keras 2 non-fused and
Keras 3 BatchNormalization) becomes the all-reduced local sum over the all-reduced element count.
A training-mode FusedBatchNorm* node is replaced by plain ops that
1. all-reduce (sum across the stage's replicas) the per-channel sum of x and the element count,
   giving the micro-batch mean; then all-reduce the per-channel sum of (x - mean)^2, giving the
   biased variance (two passes, as the CPU kernel computes it);
2. normalize: (x - mean) * (rsqrt(variance + epsilon) * scale) + offset;
3. produce the op's statistics outputs as the op does: batch mean and Bessel-corrected variance
   (or, with exponential_avg_factor f != 1, (1 - f) * the running value + f * that).
A node of the op's name (IdentityN of those results) keeps every consumer and output name intact.

The all-reduces are CollectiveReduceV2 ops whose gradient (registered here under a name of our own,
set on the nodes' `_gradient_op_type`) is the all-reduce sum of the upstream gradients, so each
replica's backward pass also sums across replicas: gradients are exact, as for one device with the
whole micro-batch. Instance keys come from one int32 input mapped per clone (`INSTANCE_BASE`): clones of
the same micro-batch (the stage's replicas) share it, others get their own; batch-norm node k uses
base + 4k and base + 4k + 1 forward, and those plus GRADIENT_KEY_SHIFT backward. In per-host graphs of CPU
tasks each all-reduce is a marker instead (hint QUEUES), summed through queues per clone (hosts/host_sync_batch_norm.py).
"""

import dataclasses
from typing import Dict, Mapping, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import collective_ops

from dapple_tf.rewrite.graphs import graph_defs as graph_defs_lib
from dapple_tf.errors import DappleError
from dapple_tf.rewrite.batch.normalization import TRAINING_NORMS, is_training_fused_norm as is_training_norm  # noqa: F401

INSTANCE_BASE = "dapple_sync_batch_norm/instance_base"  # no node: every clone maps it (input_map) to its key
KEYS_PER_NORM = 4
GRADIENT_KEY_SHIFT = 2
_GRADIENT = "DappleCrossReplicaSum"
QUEUES = "dapple_queues"  # the hint for markers instead of collectives (per-host graphs of CPU tasks)
MARKER = "_dapple_replicas_sum"
_CHANNEL_AXIS = {"NHWC": -1, "NDHWC": -1, "NCHW": 1, "NCDHW": 1}


@tf.RegisterGradient(_GRADIENT)
def _cross_replica_sum_gradient(op, grad):
    """d(sum over replicas)/d(this replica's input) applied to every replica's upstream gradient: their sum."""
    group_size, group_key, instance_key = op.inputs[1:4]
    summed = collective_ops.all_reduce_v2(
        grad, group_size, group_key, instance_key + GRADIENT_KEY_SHIFT, merge_op="Add", final_op="Id",
        communication_hint=op.get_attr("communication_hint").decode(),
    )
    return [summed] + [None] * (len(op.inputs) - 1)


@dataclasses.dataclass
class SyncedStage:
    stage: graph_defs_lib.StageGraphDef  # the rewritten stage
    num_keys: int  # instance keys each clone group (the replicas of one micro-batch) uses from its base
    synchronized: Tuple[str, ...] = ()  # the nodes whose statistics are all-reduced, in the order of their keys


def _statistics_graph(node, group_size: int, group_key: int, hint: str, first_key: int) -> tf.compat.v1.GraphDef:
    """The replacement of `node`, built on placeholders x, scale, offset, mean, variance and INSTANCE_BASE."""
    t = tf.dtypes.as_dtype(node.attr["T"].type)
    u = tf.dtypes.as_dtype(node.attr["U"].type) if "U" in node.attr else t
    data_format = node.attr["data_format"].s.decode() or "NHWC"
    if data_format not in _CHANNEL_AXIS:
        raise DappleError(f"batch_norm='sync': {node.name} has data_format {data_format}, which is not supported")
    rank = len(data_format)
    channel = _CHANNEL_AXIS[data_format] % rank
    axes = [a for a in range(rank) if a != channel]
    epsilon = node.attr["epsilon"].f
    factor = node.attr["exponential_avg_factor"].f if "exponential_avg_factor" in node.attr else 1.0
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(t, [None] * rank, name="x")
        scale, offset, mean_in, var_in = (tf.compat.v1.placeholder(u, [None], name=n)
                                          for n in ("scale", "offset", "mean", "variance"))
        base = tf.compat.v1.placeholder(tf.int32, [], name="instance_base")
        broadcast = [1] * rank
        broadcast[channel] = -1

        def replicas_sum(value, key):
            return _replicas_sum(graph, value, group_size, group_key, base, key, hint)

        xu = tf.cast(x, u)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), u)
        sums = replicas_sum(tf.concat([tf.reduce_sum(xu, axes), tf.reshape(count, [1])], 0), first_key)
        n = sums[-1]
        mean = sums[:-1] / n
        centered = xu - tf.reshape(mean, broadcast)
        variance = replicas_sum(tf.reduce_sum(tf.square(centered), axes), first_key + 1) / n
        factor_scale = tf.math.rsqrt(variance + epsilon) * scale
        y = tf.cast(centered * tf.reshape(factor_scale, broadcast) + tf.reshape(offset, broadcast), t)
        unbiased = variance * (n / tf.maximum(n - 1, 1))
        if factor != 1.0:
            mean_out = (1 - factor) * mean_in + factor * mean
            var_out = (1 - factor) * var_in + factor * unbiased
        else:
            mean_out, var_out = mean, unbiased
        tf.identity(y, name="y")
        tf.identity(mean_out, name="batch_mean")
        tf.identity(var_out, name="batch_variance")
        tf.identity(mean, name="saved_mean")
        tf.identity(variance, name="saved_variance")
    return graph.as_graph_def()


def _reduction_graph(node, rank: int, axes: Tuple[int, ...], group_size: int, group_key: int, hint: str,
                     first_key: int) -> tf.compat.v1.GraphDef:
    """The replacement of a Mean keeping dims over `axes` (which include the batch axis): the sum and the
    element count all-reduced over the replicas, divided; built on placeholders x, axes and INSTANCE_BASE."""
    t = tf.dtypes.as_dtype(node.attr["T"].type)
    u = tf.float32 if t in (tf.float16, tf.bfloat16) else t
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(t, [None] * rank, name="x")
        tf.compat.v1.placeholder(tf.dtypes.as_dtype(node.attr["Tidx"].type), [None], name="axes")  # unused
        base = tf.compat.v1.placeholder(tf.int32, [], name="instance_base")
        local = tf.reduce_sum(tf.cast(x, u), list(axes), keepdims=True)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), list(axes))), u)
        flat = tf.concat([tf.reshape(local, [-1]), tf.reshape(count, [1])], 0)
        summed = _replicas_sum(graph, flat, group_size, group_key, base, first_key, hint)
        mean = summed[:-1] / summed[-1]
        tf.identity(tf.cast(tf.reshape(mean, tf.shape(local)), t), name="y")
    return graph.as_graph_def()


def _replicas_sum(graph: tf.Graph, value, group_size: int, group_key: int, base, offset: int, hint: str):
    """The sum of `value` over the replicas: a collective with instance key base + offset, or with hint QUEUES an
    identity marked with `offset` that hosts/host_sync_batch_norm.py replaces in each imported clone."""
    if hint == QUEUES:
        return marker(value, offset)
    with graph.gradient_override_map({"CollectiveReduceV2": _GRADIENT}):
        return collective_ops.all_reduce_v2(value, group_size, group_key, base + offset, merge_op="Add",
                                            final_op="Id", communication_hint=hint)


def marker(value: tf.Tensor, offset: int) -> tf.Tensor:
    """The stand-in for the sum of `value` over the replicas, `offset` naming it within the stage (hint QUEUES)."""
    marked = tf.identity(value, name="replicas_sum")
    marked.op._set_attr(MARKER, attr_value_pb2.AttrValue(i=offset))  # pylint: disable=protected-access
    return marked


def _splice(out: tf.compat.v1.GraphDef, node, replacement: tf.compat.v1.GraphDef, fed_names: Sequence[str],
            results: Sequence[str], types: Sequence[int]) -> None:
    """Adds `replacement`'s nodes (named under node.name/dapple_sync/), its placeholders `fed_names` fed by
    node's data inputs in order, and turns `node` into an IdentityN of the replacement's `results`."""
    prefix = node.name + "/dapple_sync/"
    data_inputs = [i for i in node.input if not i.startswith("^")]
    control_inputs = [i for i in node.input if i.startswith("^")]
    fed = dict(zip(fed_names, data_inputs))
    fed["instance_base"] = INSTANCE_BASE

    def renamed(reference: str) -> str:
        control = reference.startswith("^")
        name, _, port = reference.lstrip("^").partition(":")
        if name in fed:
            return ("^" + fed[name].partition(":")[0]) if control else fed[name]
        return ("^" if control else "") + prefix + name + (":" + port if port else "")

    for new in replacement.node:
        if new.name in fed:
            continue
        added = out.node.add()
        added.CopyFrom(new)
        added.name = prefix + new.name
        del added.input[:]
        added.input.extend(renamed(i) for i in new.input)
    node.op = "IdentityN"
    node.attr.clear()
    node.attr["T"].list.type.extend(types)
    del node.input[:]
    node.input.extend([prefix + r for r in results] + control_inputs)


def _splice_norm(out: tf.compat.v1.GraphDef, node, replacement: tf.compat.v1.GraphDef) -> None:
    num_outputs = 6 if node.op == "FusedBatchNormV3" else 5
    results = ["y", "batch_mean", "batch_variance", "saved_mean", "saved_variance", "saved_variance"][:num_outputs]
    t, u = node.attr["T"].type, node.attr["U"].type if "U" in node.attr else node.attr["T"].type
    _splice(out, node, replacement, ("x", "scale", "offset", "mean", "variance"), results,
            [t] + [u] * (num_outputs - 1))


def rewrite(stage: graph_defs_lib.StageGraphDef, index: int, devices: Sequence[str], group_key: int, hint: str,
            statistics: Optional[Mapping[str, Optional[Tuple[int, Tuple[int, ...]]]]] = None) -> SyncedStage:
    """The stage with its batch statistics synchronized across `devices`; see the module docstring.

    statistics: the nodes to synchronize (batch_norm.prepare, from the template graph): a fused norm's name ->
    None, a Mean's name -> (rank of its input, its reduction axes). None: every training-mode fused norm
    (the behaviour before statistics were told apart by their axes). A name that is not a node of the
    stage's graph (missing, or inside a function body) is a DappleError."""
    for function in stage.graph_def.library.function:
        inner = [n.name for n in function.node_def if is_training_norm(n)]
        if inner:
            raise DappleError(
                f"batch_norm='sync': stage {index} runs batch norm {inner[0]} inside function "
                f"{function.signature.name} (a tf.cond or loop body), which cannot be synchronized; call it "
                "outside control flow (e.g. a Python bool for `training`), or use batch_norm='per_slice'"
            )
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(stage.graph_def)
    names = {n.name for n in out.node}
    if statistics is None:
        statistics = {n.name: None for n in out.node if is_training_norm(n)}
    nodes = [n for n in out.node if n.name in statistics]
    missing = sorted(set(statistics) - {n.name for n in nodes})
    if missing:
        inner = {n.name: f.signature.name for f in stage.graph_def.library.function for n in f.node_def}
        if missing[0] in inner:
            where = (f"inside function {inner[missing[0]]} (a tf.cond or loop body), which cannot be synchronized; "
                     "compute it outside control flow")
        else:
            where = "not in the stage's graph, so it cannot be synchronized"
        raise DappleError(
            f"batch_norm='sync': stage {index} should synchronize the batch statistic {missing[0]}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, but it is {where}; or use "
            "batch_norm='per_slice'"
        )
    if not nodes:
        return SyncedStage(stage, 0)
    if INSTANCE_BASE in names:
        raise DappleError(f"stage {index} already has an operation named {INSTANCE_BASE}")
    _check_reserve_spaces_unused(out, {n.name for n in nodes if is_training_norm(n)}, index)
    for k, node in enumerate(nodes):
        reduction = statistics[node.name]
        if reduction is None:
            _splice_norm(out, node, _statistics_graph(node, len(devices), group_key, hint, KEYS_PER_NORM * k))
        else:
            rank, axes = reduction
            replacement = _reduction_graph(node, rank, axes, len(devices), group_key, hint, KEYS_PER_NORM * k)
            _splice(out, node, replacement, ("x", "axes"), ["y"], [node.attr["T"].type])
    result = dataclasses.replace(stage, graph_def=out)
    return SyncedStage(result, KEYS_PER_NORM * len(nodes), tuple(n.name for n in nodes))


def _check_reserve_spaces_unused(graph_def, norm_names, index: int) -> None:
    for node in graph_def.node:
        for reference in node.input:
            name, _, port = reference.lstrip("^").partition(":")
            if name in norm_names and port and int(port) >= 3:
                raise DappleError(
                    f"batch_norm='sync': {node.name} in stage {index} reads {reference}, a reserve-space output of "
                    "a fused batch norm (only its gradient should); use batch_norm='per_slice'"
                )


def instance_base_feed(base: int) -> Dict[str, tf.Tensor]:
    """The input_map entry feeding a clone's INSTANCE_BASE (call under the clone's device scope)."""
    return {INSTANCE_BASE + ":0": tf.constant(base, tf.int32)}
