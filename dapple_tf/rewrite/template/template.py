"""The template: the user's model built once, on inputs of unknown batch size, cut into stages.

model_fn is called on placeholders shaped like the global batch but with an unknown leading
dimension (`template_inputs`), so that nothing in the template (shapes inside tf.cond/while
bodies included) is specialised to one batch size: its clones run on any slice.

`analyze` finds, from the loss backwards, the operations each stage must run per micro-batch,
and classifies every tensor a stage consumes from outside itself:
- INPUT: a global-batch input (features/labels), sliced per micro-batch and replica;
- BOUNDARY: produced by an earlier stage (computed from the inputs: split/concat along its batch axis,
  batch_axis.py; otherwise broadcast); one computed from the inputs alone (a mask, a position encoding made
  before the first layer) is not sent: each stage reading it computes it again from its own slice of the
  inputs (`_recomputable_ops`): a few elementwise ops instead of a transfer per micro-batch, and no gradient
  to send back;
- VARIABLE: a resource variable handle, mapped to the variable copy on the replica's device;
- SHAPE: the output of `tf.shape` (`tf.size`, `tf.rank`) of an earlier stage's batched tensor: the stage
  computes it for its own slice size (shape_values.py), and copies into itself the operations of other
  stages that compute from such shapes alone (`batch_size = tf.shape(x)[0]` read once and used everywhere);
- EXTERNAL: anything else that does not depend on the inputs (a constant built outside the
  layers), used as it is.
Shapes are read as TF1 and TF2 TensorShapes alike (`tf.compat.dimension_value`). Nothing here runs the graph.
"""

import dataclasses
from typing import Dict, List, Mapping, Sequence, Set

import tensorflow as tf

from dapple_tf.rewrite.batch import batch_axis, normalization, sample_rows
from dapple_tf.rewrite.graphs import graph_walk, shape_values, v1_control_flow
from dapple_tf.rewrite.template import outputs as outputs_lib
from dapple_tf.errors import DappleError, LayerMarkerError
from dapple_tf.model.layers import LayerRecord
from dapple_tf.plan import ResolvedStage

INPUT, BOUNDARY, VARIABLE, SHAPE, EXTERNAL = "input", "boundary", "variable", "shape", "external"
_VARIABLE_OPS = ("VarHandleOp",)
_REF_VARIABLE_OPS = ("VariableV2", "Variable")


@dataclasses.dataclass
class ExternalTensor:
    """A tensor a stage consumes from outside its own operations."""

    tensor: tf.Tensor
    kind: str
    producer_stage: int = -1  # BOUNDARY: the stage that computes it (SHAPE: the stage of the shape's source)
    batch_major: bool = True  # BOUNDARY/INPUT: split by samples (computed from the inputs)
    batch_axis: int = 0  # BOUNDARY/INPUT, batch_major: the axis that carries the samples


@dataclasses.dataclass
class StageTemplate:
    """What one stage runs per micro-batch, in the template graph."""

    stage: ResolvedStage
    ops: List[tf.Operation]  # in creation order
    externals: List[ExternalTensor]
    outputs: List[tf.Tensor]  # tensors later stages consume
    loss: tf.Tensor = None  # set on the stage that computes the loss
    extra_outputs: List[tf.Tensor] = dataclasses.field(default_factory=list)  # model_fn's extra outputs here


@dataclasses.dataclass
class Template:
    stages: List[StageTemplate]
    inputs: Dict[str, tf.Tensor]  # template placeholder name -> the global-batch tensor it stands for
    global_batch_size: int
    variable_of_handle: Dict[str, tf.Variable]  # handle tensor name -> variable
    extras: List[outputs_lib.ExtraOutput] = dataclasses.field(default_factory=list)
    shapes: shape_values.ShapeValues = None  # the SHAPE externals' values per slice size
    rows: sample_rows.SampleRows = None  # rows per sample of batch-major tensors, where proven


def _is_shared_resource(op: tf.Operation, batch_dependent) -> bool:
    """An op creating a resource (a lookup table, ...) the stages share rather than clone; not one passing a
    resource on (a TF1 while loop's Enter of a variable's handle, which each clone needs of its own copy)."""
    return (op not in batch_dependent and any(t.dtype == tf.resource for t in op.outputs)
            and not any(t.dtype == tf.resource for t in op.inputs))


def leading_dimension(t: tf.Tensor):
    """The static first dimension of `t` as an int, None where unknown (TF1 and TF2 TensorShapes alike)."""
    return tf.compat.dimension_value(t.shape[0]) if t.shape.rank else None


def _global_batch_size(inputs: Sequence[tf.Tensor]) -> int:
    sizes = set()
    for t in inputs:
        if t.shape.rank is None or leading_dimension(t) is None:
            raise DappleError(
                f"input {t.name} has shape {t.shape}; features and labels need a static leading batch dimension"
            )
        sizes.add(leading_dimension(t))
    if len(sizes) != 1:
        raise DappleError(f"features and labels disagree on the global batch size: {sorted(sizes)}")
    return sizes.pop()


def template_inputs(real_inputs: Sequence[tf.Tensor]) -> Dict[str, tf.Tensor]:
    """Placeholders like the batched `real_inputs` (rank >= 1) with an unknown batch dimension.

    Returns placeholder name -> real tensor; scalars are not batched and get no placeholder.
    """
    batched = [t for t in real_inputs if t.shape.rank != 0]
    if not batched:
        raise DappleError("features and labels hold no batched tensor (all are scalars)")
    _global_batch_size(batched)
    placeholders = {}
    with tf.name_scope("dapple/template_inputs"):
        for t in batched:
            p = tf.compat.v1.placeholder(t.dtype, [None] + t.shape.as_list()[1:], name=t.op.name.replace("/", "_"))
            placeholders[p.name] = t
    return placeholders


@dataclasses.dataclass
class _Graph:
    """What the cut looks up about the template graph."""

    stage_of_layer: Dict[int, int]  # layer index -> stage index
    layer_of_op: Dict[tf.Operation, int]
    input_ops: Set[tf.Operation]
    input_names: Set[str]
    batch_dependent: Set[tf.Operation]  # ops computed from the inputs
    shape_only: Set[tf.Operation]  # of those, the ones computed from the inputs' shapes alone (shape_values.py)
    recomputable: Set[tf.Operation]  # ops computed from the inputs and constants alone (_recomputable_ops)
    sample_axes: normalization.SampleAxes  # the axes of each tensor that index the samples
    handle_names: Dict[str, tf.Variable]  # variable handle tensor name -> variable


def _lookups(graph: tf.Graph, inputs: Dict[str, tf.Tensor], layers: Sequence[LayerRecord],
             stages: Sequence[ResolvedStage], variables: Sequence[tf.Variable]) -> _Graph:
    stage_of_layer = {}
    for stage in stages:
        for index in range(stage.first_layer, stage.last_layer + 1):
            stage_of_layer[index] = stage.index
    input_ops = {graph.get_tensor_by_name(name).op for name in inputs}
    batch_dependent = graph_walk.descendants(list(input_ops))
    handles = [op for op in graph.get_operations() if op.type in _VARIABLE_OPS]
    return _Graph(
        stage_of_layer=stage_of_layer,
        layer_of_op={op: record.index for record in layers for op in record.ops},
        input_ops=input_ops,
        input_names=set(inputs),
        batch_dependent=batch_dependent,
        shape_only=shape_values.shape_only_ops(input_ops, batch_dependent),
        recomputable=_recomputable_ops(graph, input_ops, handles),
        sample_axes=normalization.SampleAxes(graph, list(input_ops)),
        handle_names={v.handle.name: v for v in variables if hasattr(v, "handle")},
    )


def _recomputable_ops(graph: tf.Graph, input_ops: Set[tf.Operation],
                      handles: Sequence[tf.Operation]) -> Set[tf.Operation]:
    """The ops computed from the inputs and constants alone, the same in every stage that runs them: no variable,
    state (random ops), control flow or control input among their ancestors."""
    barriers = [op for op in graph.get_operations() if op not in input_ops and (
        op.control_inputs or shape_values.is_stateful(op) or v1_control_flow.in_control_flow(op))]
    return set(graph.get_operations()) - graph_walk.descendants(barriers + list(handles)) - input_ops


def _check_loss(loss: tf.Tensor, layers: Sequence[LayerRecord], g: _Graph) -> None:
    if loss.op not in g.layer_of_op:
        raise LayerMarkerError(f"the loss {loss.name} is computed outside any dapple_tf.layer; compute it in the last layer")
    if g.layer_of_op[loss.op] != len(layers) - 1:
        raise LayerMarkerError(
            f"the loss must be computed in the last layer {layers[-1].name!r}; it comes from layer "
            f"{layers[g.layer_of_op[loss.op]].name!r}"
        )


def _stage_ops(loss: tf.Tensor, pulled: Sequence[outputs_lib.ExtraOutput], num_stages: int,
               g: _Graph, sending: Set[int] = frozenset()) -> List[Set[tf.Operation]]:
    """Walks back from the loss (data and control inputs): every op the loss needs, stopping at
    inputs, variables, shared resources (lookup tables) and input-independent ops outside the
    layers. Ops outside the layers that read variables are cloned into each stage using them,
    so that every replica reads its own variable copy. The `pulled` extra outputs' ops join the
    stage that pulls them. A later stage using what an earlier stage computes from shapes alone gets its
    own copy of those ops, down to the shape-reading ops (SHAPE externals), and so does one using what an earlier
    stage (not one of `sending`) computes from the inputs alone (`_recomputed_from_inputs`)."""
    reads_variables = graph_walk.descendants([op for op in loss.graph.get_operations() if op.type in _VARIABLE_OPS])
    stage_ops: List[Set[tf.Operation]] = [set() for _ in range(num_stages)]
    # The loss's walk comes first (on top of the stack): ops outside the layers on its path are errors.
    stack = [(e.tensor.op, e.stage, True) for e in pulled] + [(loss.op, num_stages - 1, False)]
    while stack:
        op, pulling_stage, for_extra = stack.pop()
        if op.type in _REF_VARIABLE_OPS:
            raise DappleError(
                f"{op.name} is a reference variable; dapple_tf needs resource variables "
                "(call tf.compat.v1.enable_resource_variables() before building the model)"
            )
        if op in g.input_ops or op.type in _VARIABLE_OPS or _is_shared_resource(op, g.batch_dependent):
            continue
        if op in g.layer_of_op:
            s = g.stage_of_layer[g.layer_of_op[op]]
            if op in g.shape_only and s < pulling_stage:
                if op.type in shape_values.SHAPE_READING_OPS:
                    continue  # SHAPE: the pulling stage reads the shape at its own slice size
                s = pulling_stage
            elif s < pulling_stage and s not in sending and _recomputed_from_inputs(op, g):
                s = pulling_stage
        elif op in g.batch_dependent and for_extra:
            s = pulling_stage
        elif op in g.batch_dependent:
            raise LayerMarkerError(
                f"operation {op.name} ({op.type}) computes from the model inputs outside any dapple_tf.layer "
                "marker; put it inside a layer"
            )
        elif op in reads_variables:
            s = pulling_stage
        else:
            continue  # EXTERNAL: depends on neither the inputs nor a variable
        if op in stage_ops[s]:
            continue
        stage_ops[s].add(op)
        stack.extend((t.op, s, for_extra) for t in op.inputs)
        stack.extend((c, s, for_extra) for c in op.control_inputs)
        stack.extend((e, s, for_extra) for e in v1_control_flow.loop_exits(op))
    return stage_ops


def _recomputed_from_inputs(op: tf.Operation, g: _Graph) -> bool:
    """Whether a later stage computes `op` again from its own slice of the inputs rather than receive its outputs: it
    is computed from the inputs and constants alone, and none of its outputs is a statistic over the batch (which
    cannot cross a boundary: batch_axis.py)."""
    if op not in g.recomputable:
        return False
    for t in op.outputs:
        if t.op in g.batch_dependent and t.shape.rank is not None:
            try:
                batch_axis.find(t, g.sample_axes, -1, -1)
            except DappleError:
                return False
    return True


def _check_control_edges(stage_ops: Sequence[Set[tf.Operation]], stage_of_op: Dict[tf.Operation, int]) -> None:
    for s, ops in enumerate(stage_ops):
        for op in ops:
            for c in op.control_inputs:
                if c not in ops and c in stage_of_op:
                    raise DappleError(
                        f"{op.name} (stage {s}) has a control dependency on {c.name} (stage {stage_of_op[c]}); "
                        "control dependencies cannot cross stage boundaries"
                    )


def _boundary(op: tf.Operation, t: tf.Tensor, s: int, producer: int, g: _Graph) -> ExternalTensor:
    """`t`, produced by stage `producer`, consumed by `op` of stage `s`."""
    if producer > s:
        raise LayerMarkerError(
            f"{op.name} in stage {s} consumes {t.name} from the later stage {producer}; "
            "layers must be marked in the order they compute"
        )
    if t.op not in g.batch_dependent:
        return ExternalTensor(t, BOUNDARY, producer_stage=producer, batch_major=False)
    return ExternalTensor(t, BOUNDARY, producer_stage=producer,
                          batch_axis=batch_axis.find(t, g.sample_axes, producer, s))


def _externals(s: int, ordered: Sequence[tf.Operation], ops: Set[tf.Operation], stage_of_op: Dict[tf.Operation, int],
               g: _Graph, outputs_of_stage: List[Dict[str, tf.Tensor]]) -> List[ExternalTensor]:
    """What stage `s` (its `ops`, `ordered` by creation) consumes from outside; each BOUNDARY tensor is
    added to its producer's `outputs_of_stage`."""
    externals: Dict[str, ExternalTensor] = {}
    for op in ordered:
        for t in op.inputs:
            if t.op in ops or t.name in externals:
                continue
            if t.name in g.input_names:
                externals[t.name] = ExternalTensor(t, INPUT)
            elif t.op.type in _VARIABLE_OPS:
                if t.name not in g.handle_names:
                    raise DappleError(f"{op.name} reads {t.op.name}, which is not a variable of this graph")
                externals[t.name] = ExternalTensor(t, VARIABLE)
            elif t.op in g.shape_only and t.op.type in shape_values.SHAPE_READING_OPS and t.op in stage_of_op:
                externals[t.name] = ExternalTensor(t, SHAPE, producer_stage=stage_of_op[t.op], batch_major=False)
            elif t.op in stage_of_op:
                externals[t.name] = _boundary(op, t, s, stage_of_op[t.op], g)
                outputs_of_stage[stage_of_op[t.op]][t.name] = t
            else:
                externals[t.name] = ExternalTensor(t, EXTERNAL, batch_major=False)
    return list(externals.values())


def _stage_templates(stages: Sequence[ResolvedStage], stage_ops: List[Set[tf.Operation]],
                     g: _Graph) -> List[StageTemplate]:
    # an op's stage is its layer's (ops computed from shapes alone may also be copied into later stages)
    stage_of_op = {op: g.stage_of_layer[g.layer_of_op[op]] for ops in stage_ops for op in ops if op in g.layer_of_op}
    for op, layer in g.layer_of_op.items():  # a shape-reading op only later stages need
        if op in g.shape_only and op.type in shape_values.SHAPE_READING_OPS:
            stage_of_op.setdefault(op, g.stage_of_layer[layer])
    _check_control_edges(stage_ops, stage_of_op)
    templates = []
    outputs_of_stage: List[Dict[str, tf.Tensor]] = [dict() for _ in stages]
    for s, stage in enumerate(stages):
        if not stage_ops[s]:
            raise DappleError(
                f"stage {s} (layers {stage.layer_names[0]!r}..{stage.layer_names[-1]!r}) computes nothing the loss "
                "depends on"
            )
        ordered = sorted(stage_ops[s], key=lambda op: op._id)  # creation order
        externals = _externals(s, ordered, stage_ops[s], stage_of_op, g, outputs_of_stage)
        templates.append(StageTemplate(stage=stage, ops=ordered, externals=externals, outputs=[]))
    for s, template in enumerate(templates):
        template.outputs = list(outputs_of_stage[s].values())
    return templates


def analyze(
    loss: tf.Tensor,
    inputs: Dict[str, tf.Tensor],
    layers: Sequence[LayerRecord],
    stages: Sequence[ResolvedStage],
    variables: Sequence[tf.Variable],
    extras: Mapping[str, tf.Tensor] = None,
) -> Template:
    """Cuts the template graph that computes `loss` (and the `extras` outputs) from the placeholders
    into `stages`.

    `inputs` maps each template placeholder's name to the global-batch tensor it stands for.
    Operations only the extra outputs need may lie outside the layers: they join the stage that
    pulls them (the stage of the output's layer, else the last stage).
    """
    if loss.shape.rank != 0:
        raise DappleError(f"the model must return a scalar loss (a mean over the batch), got {loss.name} {loss.shape}")
    batch = _global_batch_size(list(inputs.values()))
    g = _lookups(loss.graph, inputs, layers, stages, variables)
    _check_loss(loss, layers, g)
    extra_outputs = [
        outputs_lib.classify(name, t, g.input_names, g.batch_dependent,
                             lambda x: batch_axis.find(x, g.sample_axes, -1, -1))
        for name, t in (extras or {}).items()
    ]
    pulled = [e for e in extra_outputs if e.kind in (outputs_lib.BATCH, outputs_lib.MEAN)]
    for extra in pulled:
        layer = g.layer_of_op.get(extra.tensor.op)
        extra.stage = g.stage_of_layer[layer] if layer is not None else len(stages) - 1
    stage_ops = _stage_ops(loss, pulled, len(stages), g)
    emptied = {s for s, ops in enumerate(stage_ops) if not ops}
    if emptied:  # a stage computing nothing but what later stages compute again: it sends it instead
        stage_ops = _stage_ops(loss, pulled, len(stages), g, sending=emptied)
    templates = _stage_templates(stages, stage_ops, g)
    templates[-1].loss = loss
    for extra in pulled:
        templates[extra.stage].extra_outputs.append(extra.tensor)
    crossing = {e.tensor.name: (e.producer_stage, t.stage.index) for t in templates for e in t.externals
                if e.kind == SHAPE}
    shapes = [e.tensor for t in templates for e in t.externals if e.kind == SHAPE]
    placeholders = [loss.graph.get_tensor_by_name(name) for name in inputs]
    return Template(
        stages=templates,
        inputs=dict(inputs),
        global_batch_size=batch,
        variable_of_handle=g.handle_names,
        extras=extra_outputs,
        shapes=shape_values.ShapeValues(loss.graph, placeholders, shapes, crossing),
        rows=sample_rows.SampleRows(g.input_ops, g.batch_dependent),
    )
