"""A stage as three TensorFlow functions, defined once and called once per micro-batch and replica.

Importing a stage's GraphDef once per micro-batch makes the graph grow as (the model's ops) x M, and
TensorFlow's graph optimization at the first step with it (issue 23). Here each stage is built once
in a scratch graph: its operations (fed by placeholders), then `tf.gradients` of the outputs that
later stages send gradients for (and of its weighted loss) with respect to its differentiable boundary
inputs and its trainable variables' handles. The scratch graph is cut into three parts:
- F, the forward: the stage's operations;
- B, the input gradients: the gradient operations the input gradients need (what the previous stage
  waits for);
- W, the weight gradients: the other gradient operations the weight gradients need (and a variant that
  also adds them to the running sums of earlier micro-batches, passed in: the accumulation in the call).
Each part becomes one `tf.function` whose inputs are the tensors it reads from outside the part (feeds,
output gradients, the loss weight, tensors another part made) and whose outputs are what later parts
and the caller read. A forward task is one F call; a backward task is a B call then a W call. B and W
are the zero-bubble B/W split, here two calls of one task (tasks.input_gradients_first orders them).

A call on a CPU device is a `RemoteCall` op aimed at its own device (an empty target: the caller's), measured on
CPU only; on other devices (GPU) it stays a PartitionedCall, whose body grappler optimizes (layouts, fusions, the
mixed precision a session config asks for). TensorFlow runs a RemoteCall's body
on that device's function runtime: instantiated once per device and function, not optimized by grappler per call
site (grappler's function optimizer only handles PartitionedCall and direct calls), and stepping without the
session's step-stats bookkeeping per operation. On BERT-24 at M=16 that steps in 0.56x the clones' time where a
PartitionedCall steps in 1.03x, and starts in 2x plain TF's time (docs/performance.md, "Calls"). What it costs: a
traced step (RunMetadata) records each call as one operation, not its body's. `traced=True` (PipelineOptions
traced_functions) makes PartitionedCall ops instead, whose bodies a trace records. Five more things keep the build
and the first step from growing with M again: the functions are marked `_noinline` (an inlined call puts every
micro-batch's body back into the graph the first step optimizes); no call argument is a constant (grappler
specializes, i.e. copies and optimizes, a PartitionedCall's function per call site with a constant argument); the
bodies hold no variable read (a stateful function is instantiated per call site): the stage takes variable values,
read once per step and device (variable_reads.py); a call op is created without shape inference through its body
(its outputs take the traced shapes); every call has a reference-typed control input, which spares it XLA's scan
for reference variables (StageFunctions._ref_scan_stop). With PartitionedCall calls, the session should also run
the outer graph without grappler's function optimizer (PipelineHandle.session_config), which builds every call
site's body.
A call runs on its caller's device, and so does each operation of its body.

A stage runs as functions unless `unsupported_reason` names what it holds that this path does not
cover; StageBuilder then imports that stage once per micro-batch and replica.
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Set, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from dapple_tf.rewrite.graphs import graph_defs as graph_defs_lib, variable_reads
from dapple_tf.rewrite.graphs.graph_walk import ancestors_within

NOINLINE_ATTRIBUTES = {"_noinline": True}
# build_pipeline's default builds functions when the forward clones (every stage's operations per replica and
# micro-batch) would be more than AUTO_COPIES copies of the stages and more than AUTO_CLONED_OPS operations. Below
# that the clones' first step is bearable and they step as fast or faster (BERT-24 at hidden 64, 4 stages, 2,329
# forward operations a copy, A/B in one process: M=4 clones 0.208 s, RemoteCall functions 0.223 s; M=16 0.490 s
# against 0.275 s, the clones' first step 14x plain TF's there; docs/performance.md, "Calls").
AUTO_CLONED_OPS = 10_000
AUTO_COPIES = 4
_V1_CONTROL_FLOW = {"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge", "NextIteration"}


# operations that call functions (their bodies in the graph's library), which grappler's function optimizer handles
CALL_OP_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall", "While", "StatelessWhile", "If", "StatelessIf",
                           "Case", "StatelessCase", "SymbolicGradient", "RemoteCall"})


def _types(tensors) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
        type=[t.dtype.as_datatype_enum for t in tensors]))


def needs_function_optimizer(graph: tf.Graph, stage_calls: Sequence[tf.Operation]) -> bool:
    """Whether the outer graph calls functions other than the stages' (`stage_calls`): grappler's function
    optimizer then stays on for it (PipelineHandle.session_config)."""
    ours = set(stage_calls)
    return any(op.type in CALL_OP_TYPES and op not in ours for op in graph.get_operations())


def use_functions(requested: Optional[bool], stages, num_micro_batches: int) -> bool:
    """Whether to build stages as functions: `requested` (build_pipeline's stage_functions) when given, else
    whether the forward clones would pass both AUTO_COPIES copies of the stages and AUTO_CLONED_OPS operations."""
    if requested is not None:
        return bool(requested)
    one_copy = sum(len(st.ops) for st in stages)
    cloned = sum(len(st.ops) * len(st.stage.devices) for st in stages) * num_micro_batches
    return cloned > AUTO_CLONED_OPS and cloned > AUTO_COPIES * one_copy


def call_op_type(device: str, traced: bool) -> str:
    """"RemoteCall" for a call on a CPU device, else "PartitionedCall" (GPUs, or traced: see the module docstring)."""
    return "RemoteCall" if not traced and tf.DeviceSpec.from_string(device).device_type == "CPU" else "PartitionedCall"


def unsupported_reason(stage: graph_defs_lib.StageGraphDef, recompute: bool, synced: bool) -> Optional[str]:
    """Why a stage cannot run as functions, or None when it can."""
    if recompute:
        return "re-computation imports the stage again in its backward task"
    if synced:
        return "sync batch norm feeds each clone its own collective instance keys"
    if stage.seeded:
        return "its seeded random ops would draw the same values in every call (one kernel per call site)"
    if stage.function_names:
        return "it calls functions (functional control flow), which its gradients rewrite"
    if any(node.op in _V1_CONTROL_FLOW for node in stage.graph_def.node):
        return "it holds TF1 control flow (frames cannot be cut into functions)"
    return None


@dataclasses.dataclass
class StageSignature:
    """What a stage reads, returns and differentiates; tensor names are the template's."""

    inputs: Sequence[tf.Tensor]  # the template tensors the stage consumes, in feed order
    outputs: Sequence[str]  # returned by the forward: later stages' inputs, the loss, extra outputs
    differentiable_outputs: Sequence[str]  # outputs whose gradient later stages send
    loss: Optional[str]  # the stage's loss (weighted by `loss_weight` in the backward)
    differentiable_inputs: Sequence[str]  # boundary inputs whose gradient the stage sends back
    weights: Sequence[str]  # handles of the trainable variables the stage reads


@dataclasses.dataclass
class _Part:
    function: object  # tf.function over `inputs`, returning `outputs`
    inputs: List[str]  # scratch tensor names read from outside the part
    outputs: List[str]  # scratch tensor names returned
    traced: Dict[tuple, object] = dataclasses.field(default_factory=dict)  # argument signature -> concrete function


def _not_constant(t: tf.Tensor) -> tf.Tensor:
    """`t` as a call argument that grappler cannot fold into a constant: a PartitionedCall with a constant argument is
    specialized (its function copied and optimized) per call site, which brings back a first step that grows with M
    (RemoteCall ops are not specialized; their arguments take the same path, one build for both)."""
    if t.dtype == tf.resource:
        return t
    return tf.compat.v1.placeholder_with_default(t, t.shape)


class StageFunctions:
    """The F, B and W functions of one stage (see the module docstring)."""

    def __init__(self, graph_def: tf.compat.v1.GraphDef, signature: StageSignature, name: str, traced: bool = False):
        self.signature = signature
        self._name = name
        self._traced = traced  # PartitionedCall ops, whose bodies a traced step records; else RemoteCall ops on CPUs
        self._reads: Dict[str, tf.Tensor] = {}  # handle tensor name -> its value, read once per step
        self._feed_of: Dict[str, str] = {}  # scratch placeholder name -> template tensor name
        self._value_of: Dict[str, Tuple[str, tf.DType]] = {}  # scratch placeholder -> (handle name, dtype)
        self._grad_of: Dict[str, str] = {}  # scratch placeholder name -> output whose gradient it is
        self._loss_weight: Optional[str] = None  # scratch placeholder of the loss weight
        self.input_grads: Dict[str, str] = {}  # template input name -> scratch tensor name
        self.weight_grads: Dict[str, object] = {}  # handle name -> scratch name, or (values, indices, shape) names
        self._sum_of: Dict[str, Tuple[str, str]] = {}  # handle name -> (running sum placeholder, new sum)
        self.call_ops: List[tf.Operation] = []  # every call this stage made
        self._ref_scan_stops: Dict[str, tf.Operation] = {}  # device -> its calls' reference-typed control input
        scratch = tf.Graph()
        with scratch.as_default():
            placeholder_of, forward_ops, out = self._forward_in(scratch, graph_def, name)
            grad_ops = self._gradients_in(scratch, placeholder_of, out, name)
            sum_ops = self._sums_in(scratch, name)
        self._cut(scratch, forward_ops, grad_ops, sum_ops, name)

    def _forward_in(self, scratch: tf.Graph, graph_def, name: str):
        """The stage's operations in `scratch`, fed by placeholders: ({template input name: placeholder},
        the forward's ops, {output name: scratch tensor})."""
        graph_def, reads = variable_reads.without_variable_reads(graph_def, self.signature.inputs)
        input_map, placeholder_of = {}, {}
        for i, t in enumerate(self.signature.inputs):
            if t.name in reads:  # the variable's value, read by the caller
                dtype, read_names = reads[t.name]
                placeholder = tf.compat.v1.placeholder(dtype, variable_reads.variable_shape(t), name=f"{name}_value{i}")
                input_map.update({read: placeholder for read in read_names})
                self._value_of[placeholder.name] = (t.name, dtype)
            else:
                placeholder = tf.compat.v1.placeholder(t.dtype, t.shape, name=f"{name}_input{i}")
                input_map[t.name] = placeholder
                self._feed_of[placeholder.name] = t.name
            placeholder_of[t.name] = placeholder
        first = len(scratch.get_operations())
        results = tf.compat.v1.import_graph_def(graph_def, input_map=input_map,
                                                return_elements=list(self.signature.outputs), name=f"{name}_forward")
        out = dict(zip(self.signature.outputs, results))
        self.forward_outputs = [out[n].name for n in self.signature.outputs]
        return placeholder_of, set(scratch.get_operations()[first:]), out

    def _gradients_in(self, scratch: tf.Graph, placeholder_of, out, name: str) -> Set[tf.Operation]:
        """`tf.gradients` of the differentiable outputs (fed their gradients) and of the weighted loss w.r.t. the
        differentiable inputs and the weights, in `scratch`; returns the gradient ops."""
        signature = self.signature
        ys, grad_ys = [], []
        for i, n in enumerate(signature.differentiable_outputs):
            g = tf.compat.v1.placeholder(out[n].dtype, out[n].shape, name=f"{name}_output_grad{i}")
            self._grad_of[g.name] = n
            ys.append(out[n])
            grad_ys.append(g)
        if signature.loss is not None:
            weight = tf.compat.v1.placeholder(out[signature.loss].dtype, [], name=f"{name}_loss_weight")
            self._loss_weight = weight.name
            ys.append(out[signature.loss])
            grad_ys.append(weight)
        xs = [placeholder_of[n] for n in list(signature.differentiable_inputs) + list(signature.weights)]
        first = len(scratch.get_operations())
        grads = tf.compat.v1.gradients(ys, xs, grad_ys=grad_ys, name=f"{name}_backward") if ys and xs else []
        n_in = len(signature.differentiable_inputs)
        for n, g in zip(signature.differentiable_inputs, grads[:n_in]):
            if g is not None:
                self.input_grads[n] = tf.convert_to_tensor(g).name
        for n, g in zip(signature.weights, grads[n_in:]):
            if isinstance(g, tf.IndexedSlices):
                self.weight_grads[n] = (g.values.name, g.indices.name, g.dense_shape.name)
            elif g is not None:
                self.weight_grads[n] = g.name
        return set(scratch.get_operations()[first:])

    def _sums_in(self, scratch: tf.Graph, name: str) -> Set[tf.Operation]:
        """Running sum + gradient for each dense weight gradient, in `scratch`; returns the add ops."""
        first = len(scratch.get_operations())
        for i, (n, g) in enumerate(self.weight_grads.items()):
            if isinstance(g, str):
                grad = scratch.get_tensor_by_name(g)
                running = tf.compat.v1.placeholder(grad.dtype, grad.shape, name=f"{name}_sum{i}")
                self._sum_of[n] = (running.name, tf.add(running, grad, name=f"{name}_accumulated{i}").name)
        return {op for op in scratch.get_operations()[first:] if op.type != "Placeholder"}

    def _cut(self, scratch: tf.Graph, forward_ops, grad_ops, sum_ops, name: str) -> None:
        """The parts F, B, W and W with sums, each a function (module docstring)."""
        weight_names = [x for v in self.weight_grads.values() for x in (v if isinstance(v, tuple) else (v,))]
        sparse_names = [x for v in self.weight_grads.values() if isinstance(v, tuple) for x in v]
        b_ops = ancestors_within([scratch.get_tensor_by_name(x).op for x in self.input_grads.values()], grad_ops)
        w_ops = ancestors_within([scratch.get_tensor_by_name(x).op for x in weight_names], grad_ops) - b_ops
        full = scratch.as_graph_def()
        # (ops, the parts that may read its outputs, what the caller reads of it, name)
        parts = [(forward_ops, [b_ops, w_ops, w_ops | sum_ops], self.forward_outputs, "F"),
                 (b_ops, [w_ops, w_ops | sum_ops], list(self.input_grads.values()), "B"),
                 (w_ops, [], weight_names, "W"),
                 (w_ops | sum_ops, [], [total for _, total in self._sum_of.values()] + sparse_names, "Wsum")]
        self._forward, self._inputs, self._weights, self._weights_summed = [
            self._make_part(full, ops, later, returned, f"{name}_{kind}") for ops, later, returned, kind in parts
        ]

    @staticmethod
    def _make_part(full: tf.compat.v1.GraphDef, ops: Set[tf.Operation], later: Sequence[Set[tf.Operation]],
                   returned: Sequence[str], name: str) -> Optional[_Part]:
        """The function of the part made of `ops`: its inputs are what it reads from outside, its outputs
        what it makes of `returned` (read by the caller) and what the `later` parts read."""
        if not ops:
            return None
        names = {op.name for op in ops}
        later_reads = {t.name for part in later for op in part for t in op.inputs if t.op.name in names}
        mine = [t for t in returned if t.split(":")[0] in names]
        outputs = list(dict.fromkeys(mine + sorted(later_reads)))
        part_def = tf.compat.v1.GraphDef()
        part_def.versions.CopyFrom(full.versions)
        part_def.library.CopyFrom(full.library)
        inputs = []
        for node in full.node:
            if node.name not in names:
                continue
            copy = part_def.node.add()
            copy.CopyFrom(node)
            if "_class" in copy.attr:  # colocation with a node of another part: the whole call runs on one device
                del copy.attr["_class"]
            del copy.input[:]
            for i in node.input:
                if i.startswith("^"):
                    if i[1:] in names:  # ordering across parts follows their data edges
                        copy.input.append(i)
                    continue
                copy.input.append(i)
                if i.split(":")[0] not in names:
                    inputs.append(graph_defs_lib.tensor_name(i))
        inputs = list(dict.fromkeys(inputs))

        def body(*args):
            return tf.compat.v1.import_graph_def(part_def, input_map=dict(zip(inputs, args)),
                                                 return_elements=outputs, name="")

        body.__name__ = name  # the function's name in the graph's library
        return _Part(tf.function(body, autograph=False, experimental_attributes=NOINLINE_ATTRIBUTES), inputs, outputs)

    def _call(self, part: _Part, env: Dict[str, tf.Tensor], device: str) -> None:
        """Calls `part` on `device` (the caller's device scope) with its inputs from `env` (scratch name -> tensor)
        and adds its outputs to `env`. The call
        op is made directly from the function traced for these argument shapes (tf.function's own dispatch costs
        ~19 ms of build per call, BERT-24 stages), without TF's shape inference through the body at each call
        (a PartitionedCall's `_disable_call_shape_inference`: ~40 ms per call there; a RemoteCall's outputs have
        unknown shapes): its outputs take the traced function's shapes."""
        args = [env[n] for n in part.inputs]
        signature = tuple((t.dtype, tuple(t.shape.as_list()) if t.shape.rank is not None else None) for t in args)
        if signature not in part.traced:
            part.traced[signature] = part.function.get_concrete_function(*args)
        concrete = part.traced[signature]
        graph = tf.compat.v1.get_default_graph()
        concrete.add_to_graph(graph)
        definition = concrete.function_def.signature
        attrs = {"f": attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(name=definition.name)),
                 "Tin": _types(args), "Tout": _types(concrete.outputs)}
        result_types = [t.dtype for t in concrete.outputs]
        if call_op_type(device, self._traced) == "PartitionedCall":
            attrs["_disable_call_shape_inference"] = attr_value_pb2.AttrValue(b=True)
            op = graph.create_op("StatefulPartitionedCall" if definition.is_stateful else "PartitionedCall", args,
                                 result_types, attrs=attrs)
        else:  # an empty target: the device the call runs on
            op = graph.create_op("RemoteCall", [tf.constant("", name=f"{self._name}_target")] + args, result_types,
                                 attrs=attrs)
        for result, traced in zip(op.outputs, concrete.outputs):
            result.set_shape(traced.shape)
        op._add_control_inputs([self._ref_scan_stop(graph, op.device)])  # pylint: disable=protected-access
        self.call_ops.append(op)
        env.update(zip(part.outputs, op.outputs))

    def _ref_scan_stop(self, graph: tf.Graph, device: str) -> tf.Operation:
        """An operation with a reference-typed output on `device`, made a control input of every call there.
        At the first run of a graph, XLA's EncapsulateSubgraphsPass (in every TF build, XLA used or not) marks
        the operations related to reference variables; it builds the body of every function call to look inside,
        unless the call follows such an operation (xla_cluster_util.cc, GetNodesRelatedToRefVariables). That
        was 43% of the first step at M=64 (BERT-24, 4 stages), growing with the call sites. The marking only
        matters to XLA clusters, which never include these calls. The operation is a never-initialized
        VariableV2 that only runs: a control edge reads no value."""
        if device not in self._ref_scan_stops:
            with graph.control_dependencies(None), tf.device(device):
                self._ref_scan_stops[device] = tf.raw_ops.VariableV2(
                    shape=[], dtype=tf.float32, name=f"{self._name}_ref_scan_stop").op
        return self._ref_scan_stops[device]

    def forward(self, feed: Dict[str, tf.Tensor], device: str) -> Dict[str, tf.Tensor]:
        """One F call on `device`. Returns env: every scratch tensor it produced (and the feeds), for `backward`.
        The variables it reads are read once per handle (per replica's copy) and step, by the first call."""
        env = {p: _not_constant(feed[t]) for p, t in self._feed_of.items()}
        for p, (t, dtype) in self._value_of.items():
            handle = feed[t]
            if handle.name not in self._reads:
                self._reads[handle.name] = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
            env[p] = self._reads[handle.name]
        self._call(self._forward, env, device)
        return env

    def outputs(self, env: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
        return {n: env[s] for n, s in zip(self.signature.outputs, self.forward_outputs)}

    def backward(self, env: Dict[str, tf.Tensor], output_grads: Dict[str, tf.Tensor], loss_weight, device: str,
                 running_sums: Dict[str, tf.Tensor] = None):
        """A B call then a W call on `device`. Returns ({input name: gradient}, {handle name: gradient or IndexedSlices},
        summed). Given `running_sums` for every dense weight gradient (handle name -> the sum so far), W adds its
        gradients to them (no add per variable and micro-batch in the graph), and the dense entries returned are
        the new sums (summed is True)."""
        env = dict(env)
        env.update({p: _not_constant(output_grads[n]) for p, n in self._grad_of.items()})
        if self._loss_weight is not None:
            env[self._loss_weight] = _not_constant(loss_weight)
        summed = bool(self._sum_of) and running_sums is not None and all(n in running_sums for n in self._sum_of)
        if summed:
            env.update({running: running_sums[n] for n, (running, _) in self._sum_of.items()})
        for part in (self._inputs, self._weights_summed if summed else self._weights):
            if part is not None:
                self._call(part, env, device)
        input_grads = {n: env[s] for n, s in self.input_grads.items()}
        weight_grads = {}
        for n, s in self.weight_grads.items():
            if isinstance(s, tuple):
                weight_grads[n] = tf.IndexedSlices(*[env[x] for x in s])
            else:
                weight_grads[n] = env[self._sum_of[n][1]] if summed else env[s]
        return input_grads, weight_grads, summed
