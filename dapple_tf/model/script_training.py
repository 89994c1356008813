"""A script's own training step (minimize, compute/apply_gradients, tf.gradients + apply_gradients), proven to be
one the pipeline can run for it.

From the calls training_calls.py observed while model_fn built the template, `of` finds:
- the one `apply_gradients` call (from `minimize` or the script) and its optimizer and global step;
- the one tf.gradients call its gradients come from, which must differentiate the loss model_fn returns, or that
  loss times or divided by factors that do not read the batch (loss scaling: constants, a loss-scale variable):
  the pipeline differentiates each micro-batch's loss with those factors in its seed, as the script's tf.gradients
  does (gradient_replay.loss_seed), so a float16 backward rounds as the script's;
- what the script computes between those gradients and apply_gradients (clipping, unscaling, filtering variables,
  per-gradient transforms): a subgraph `T` that must read nothing of the batch but the gradients. The pipeline
  replays T once per step on its accumulated, all-reduced gradients (gradient_replay.py).
Gradients of gathered rows (IndexedSlices: embedding lookups) hold one row per lookup on one device, but one row per
distinct index in the pipeline (summed over micro-batches). T may scale their rows by a scalar, sum them into a
dense gradient, or take the sum of their squares (tf.clip_by_global_norm, tf.clip_by_norm), which the pipeline
counts per lookup as one device does; anything else T does with them depends on how the rows are grouped and is
refused. Where the proof fails the message names the call and points at dapple_tf.minimize.
"""

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.rewrite.graphs import graph_walk
from dapple_tf.model.optimizers import check_optimizer
from dapple_tf.model.training_calls import ApplyCall, GradientsCall, TrainingCalls

DENSE, VALUES, INDICES, DENSE_SHAPE = "dense", "values", "indices", "dense_shape"
L2_LOSS, SQUARE_SUM = "l2_loss", "square_sum"  # reductions of a gradient's gathered rows, counted per lookup
_LINEAR = {"Identity", "Neg", "Mul", "RealDiv", "Div"}  # on gathered rows, with a scalar other operand
_INSTEAD = "compute the train op with dapple_tf.minimize(loss, optimizer, ...) instead (docs/user_guide.md, " \
           "\"Porting a training script\")"


@dataclasses.dataclass
class Source:
    """A component of the gradient tf.gradients returned for `variable`."""

    variable: tf.Variable
    role: str  # DENSE, VALUES, INDICES or DENSE_SHAPE


@dataclasses.dataclass
class Substitute:
    """A reduction of `variable`'s gathered rows that the pipeline computes from its per-lookup squares."""

    variable: tf.Variable
    kind: str  # L2_LOSS (half the sum of squares) or SQUARE_SUM
    shape: tf.TensorShape
    factors: List[Tuple[str, tf.Tensor]] = dataclasses.field(default_factory=list)  # the rows were * or / these


@dataclasses.dataclass
class GradientFlow:
    """How the gradients apply_gradients gets are computed from the script's tf.gradients results."""

    ops: List[tf.Operation]  # T, in creation order
    sources: Dict[str, Source]  # tensor name -> the raw gradient component it is
    substitutes: Dict[str, Substitute]  # tensor name -> reduction of gathered rows
    externals: Dict[str, tf.Tensor]  # tensors T reads that do not depend on the batch
    finals: List[Tuple[object, tf.Variable]]  # (gradient as apply_gradients got it, variable), in its order
    loss_factors: List[Tuple[str, tf.Tensor]]  # ("mul" | "div", factor), the last applied first
    sparse_variables: Set[tf.Variable]  # variables whose raw gradient is IndexedSlices


@dataclasses.dataclass
class ScriptTraining:
    """The training step a script built itself; see the module docstring."""

    apply: ApplyCall
    gradients: GradientsCall
    flow: GradientFlow
    variables: List[tf.Variable]  # the variables whose gradients the pipeline computes
    replaced: Set[tf.Operation]  # what the pipeline's step stands for: the calls' ops and T
    where: str

    @property
    def optimizer(self):
        return self.apply.optimizer

    @property
    def global_step(self):
        return self.apply.global_step


def components(grad) -> List[Tuple[str, tf.Tensor]]:
    """(role, tensor) of each tensor a gradient (Tensor or IndexedSlices) is made of."""
    if isinstance(grad, tf.IndexedSlices):
        parts = [(VALUES, grad.values), (INDICES, grad.indices)]
        return parts + ([(DENSE_SHAPE, grad.dense_shape)] if grad.dense_shape is not None else [])
    return [(DENSE, tf.convert_to_tensor(grad))]


def _sources(call: GradientsCall, variable_of_handle: Dict[str, tf.Variable]) -> Dict[str, Source]:
    sources = {}
    for x, grad in zip(call.xs, call.results()):
        variable = variable_of_handle.get(getattr(x, "name", None))
        if variable is None or grad is None:
            continue
        for role, tensor in components(grad):
            sources[tensor.name] = Source(variable, role)
    return sources


def _strip_identity(t: tf.Tensor) -> tf.Tensor:
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    return t


def _is_scalar(t: tf.Tensor) -> bool:
    return t.shape.is_fully_defined() and t.shape.num_elements() == 1


def loss_factors(differentiated: tf.Tensor, loss: tf.Tensor, batch_dependent: Set[tf.Operation],
                 where: str) -> List[Tuple[str, tf.Tensor]]:
    """The factors with which `differentiated` = `loss` * or / factors (each independent of the batch), the last
    applied first."""
    target, t, factors = _strip_identity(loss), _strip_identity(differentiated), []
    while t is not target:
        op = t.op
        inputs = list(op.inputs)
        batched = [i for i in inputs if i.op in batch_dependent]
        other = [i for i in inputs if i.op not in batch_dependent]
        if op.type in ("Mul", "RealDiv", "Div") and len(batched) == 1 and len(other) == 1 and _is_scalar(other[0]) \
                and (op.type == "Mul" or inputs[0] is batched[0]):
            factors.append(("mul" if op.type == "Mul" else "div", other[0]))
            t = _strip_identity(batched[0])
            continue
        raise DappleError(
            f"the gradients at {where} are taken of {differentiated.name}, which is not the loss model_fn returns "
            f"({loss.name}) nor that loss times or divided by a constant: the pipeline computes the gradients of the "
            f"loss it returns. Return the loss you differentiate, or {_INSTEAD}")
    return factors


class _FlowWalk:
    """The walk back from the gradients apply_gradients got to the tf.gradients results (the module docstring)."""

    def __init__(self, apply: ApplyCall, sources: Dict[str, Source], gradient_ops: Set[tf.Operation],
                 batch_dependent: Set[tf.Operation], forward: Set[tf.Operation]):
        self.apply, self.sources, self.gradient_ops = apply, sources, gradient_ops
        self.batch_dependent, self.forward = batch_dependent, forward
        self.ops: Set[tf.Operation] = set()
        self.externals: Dict[str, tf.Tensor] = {}
        self.substitutes: Dict[str, Substitute] = {}
        self.used: Set[str] = set()

    def walk(self, tensors: List[tf.Tensor]) -> None:
        stack = [(t, None) for t in tensors]
        seen = set()
        while stack:
            t, reader = stack.pop()
            if t.name in seen:
                continue
            seen.add(t.name)
            if t.name in self.sources:
                self.used.add(t.name)
                continue
            substitute = self._substitute(t)
            if substitute is not None:
                self.substitutes[t.name] = substitute
                continue
            op = t.op
            if op not in self.batch_dependent:
                self.externals[t.name] = t
                continue
            if op in self.gradient_ops:
                raise DappleError(
                    f"the gradients given to apply_gradients at {self.apply.where} are computed from {t.name}, an "
                    "intermediate of tf.gradients rather than its result; " + _INSTEAD)
            if op in self.forward or op.type == "Placeholder":
                through = f"{reader.name} reads {t.name}" if reader is not None else t.name
                raise DappleError(
                    f"the gradients given to apply_gradients at {self.apply.where} are computed from the batch "
                    f"besides the gradients of the loss ({through}, of the model's inputs or the loss's computation): "
                    "the pipeline applies the gradients it accumulates over micro-batches and cannot replay that; "
                    + _INSTEAD)
            self.ops.add(op)
            stack.extend((i, t) for i in op.inputs)

    def _substitute(self, t: tf.Tensor) -> Optional[Substitute]:
        """A sum of squares of a gathered-rows gradient, maybe scaled by constants first (tf.clip_by_global_norm's
        L2Loss, tf.clip_by_norm's sum), recorded with what it reads."""
        op = t.op
        if op.type == "L2Loss":
            kind, rows = L2_LOSS, self._scaled_rows(op.inputs[0])
        elif op.type == "Sum" and op.inputs[0].op.type in ("Square", "Mul") and \
                len({x.name for x in op.inputs[0].op.inputs}) == 1 and _reduces_all_axes(op):
            kind, rows = SQUARE_SUM, self._scaled_rows(op.inputs[0].op.inputs[0])
        else:
            return None
        if rows is None:
            return None
        source, factors = rows
        self.used.add(source)
        self.externals.update({factor.name: factor for _, factor in factors})
        return Substitute(self.sources[source].variable, kind, t.shape, factors)

    def _scaled_rows(self, t: tf.Tensor) -> Optional[Tuple[str, List[Tuple[str, tf.Tensor]]]]:
        """(source tensor name, factors) when `t` is a gathered-rows gradient times or divided by constants."""
        factors = []
        while t.name not in self.sources:
            op = t.op
            batched = [x for x in op.inputs if x.op in self.batch_dependent]
            other = [x for x in op.inputs if x.op not in self.batch_dependent]
            if op.type in ("Identity", "Neg") and batched:
                t = batched[0]
                continue
            if op.type not in _LINEAR or len(batched) != 1 or len(other) != 1 or not _is_scalar(other[0]) or \
                    (op.type != "Mul" and op.inputs[0] is not batched[0]):
                return None
            factors.append(("mul" if op.type == "Mul" else "div", other[0]))
            t = batched[0]
        return (t.name, factors) if self.sources[t.name].role == VALUES else None


def _reduces_all_axes(op: tf.Operation) -> bool:
    axes = tf.get_static_value(op.inputs[1])
    rank = op.inputs[0].shape.rank
    return axes is not None and rank is not None and \
        sorted({int(a) % rank for a in tf.nest.flatten(axes.tolist())}) == list(range(rank))


def _check_gathered_rows(ops: List[tf.Operation], sources: Dict[str, Source], where: str) -> None:
    """T may only scale gathered rows by scalars, sum them into a dense gradient or pass them on (the docstring)."""
    rows = {name: s.variable for name, s in sources.items() if s.role == VALUES}
    indices = {name: s.variable for name, s in sources.items() if s.role == INDICES}
    for op in ops:
        row_inputs = [i for i, t in enumerate(op.inputs) if t.name in rows]
        index_inputs = [i for i, t in enumerate(op.inputs) if t.name in indices]
        if not row_inputs and not index_inputs:
            continue
        variable = (rows.get(op.inputs[row_inputs[0]].name) if row_inputs else
                    indices.get(op.inputs[index_inputs[0]].name))
        others = [t for i, t in enumerate(op.inputs) if i not in row_inputs]
        if op.type in _LINEAR and len(row_inputs) == 1 and not index_inputs and all(_is_scalar(t) for t in others) \
                and (op.type not in ("RealDiv", "Div") or row_inputs == [0]):
            rows.update({t.name: variable for t in op.outputs})
            continue
        if op.type == "Identity" and index_inputs:
            indices.update({t.name: variable for t in op.outputs})
            continue
        if op.type == "UnsortedSegmentSum" and row_inputs == [0] and index_inputs == [1]:
            continue
        raise DappleError(
            f"between tf.gradients and apply_gradients at {where}, {op.name} ({op.type}) computes from the gradient "
            f"rows of {variable.op.name} (IndexedSlices: one row per lookup on one device, one per distinct index in "
            "the pipeline) in a way that depends on how the rows are grouped; only scaling them by a scalar, summing "
            "them into a dense gradient and their sum of squares (clipping by norm) can be replayed. " + _INSTEAD)


def _the_apply(calls: TrainingCalls) -> ApplyCall:
    if len(calls.applies) > 1:
        places = ", ".join(a.where for a in calls.applies)
        raise DappleError(f"model_fn applies gradients {len(calls.applies)} times (apply_gradients or minimize at "
                          f"{places}): the pipeline runs one training step; apply the gradients of the loss once")
    apply = calls.applies[0]
    try:
        check_optimizer(apply.optimizer)
    except DappleError as e:
        raise DappleError(f"apply_gradients at {apply.where}: {e}") from None
    if apply.grads_and_vars is None:
        raise DappleError(
            f"apply_gradients at {apply.where} was given its (gradient, variable) pairs as an iterator that cannot be "
            "read without using it up (a generator): pass a list, or zip(gradients, variables) of lists")
    return apply


def of(calls: TrainingCalls, loss: tf.Tensor, variable_of_handle: Dict[str, tf.Variable], batch_dependent: Set[tf.Operation]) -> Optional[ScriptTraining]:
    """The script's own training step, or None when model_fn applied no gradients itself."""
    if not calls.applies:
        return None
    apply = _the_apply(calls)
    finals = [(g, v) for g, v in apply.grads_and_vars if g is not None and v is not None]
    if not finals:
        raise DappleError(f"apply_gradients at {apply.where} got no gradient (every gradient is None)")
    all_sources = {}
    owner: Dict[str, GradientsCall] = {}
    for call in calls.gradients:
        found = _sources(call, variable_of_handle)
        all_sources.update(found)
        owner.update({name: call for name in found})
    gradient_ops = set().union(*(c.ops for c in calls.gradients)) if calls.gradients else set()
    forward = graph_walk.ancestors(loss.op)
    walk = _FlowWalk(apply, all_sources, gradient_ops, batch_dependent, forward)
    walk.walk([t for g, _ in finals for _, t in components(g)])
    used_calls = {id(owner[name]): owner[name] for name in walk.used}
    used_calls.update({id(owner[n]): owner[n] for n, s in all_sources.items()
                       if any(sub.variable is s.variable for sub in walk.substitutes.values())})
    if len(used_calls) != 1:
        places = ", ".join(c.where for c in used_calls.values()) or "none"
        raise DappleError(f"the gradients given to apply_gradients at {apply.where} should come from one tf.gradients "
                          f"(or compute_gradients) call of the loss; they come from {len(used_calls)} ({places}): "
                          + _INSTEAD)
    gradients = next(iter(used_calls.values()))
    if len(gradients.ys) != 1 or gradients.grad_ys_given:
        raise DappleError(f"the gradients at {gradients.where} are taken of {len(gradients.ys)} tensor(s)"
                          f"{' with grad_ys' if gradients.grad_ys_given else ''}: the pipeline computes the gradients of "
                          f"the one loss model_fn returns; " + _INSTEAD)
    factors = loss_factors(gradients.ys[0], loss, batch_dependent, gradients.where)
    sources = {n: s for n, s in all_sources.items() if owner[n] is gradients}
    ops = sorted(walk.ops, key=lambda op: op._id)  # pylint: disable=protected-access
    _check_gathered_rows(ops, sources, apply.where)
    _check_final_rows(finals, sources, apply.where)
    variables = _variables(sources, walk)
    for _, variable in finals:
        if variable not in variables:
            raise DappleError(f"apply_gradients at {apply.where} gets a gradient for {variable.op.name} that is not "
                              f"computed from the gradients of the loss at {gradients.where}; " + _INSTEAD)
    used_sources = {n: s for n, s in sources.items() if n in walk.used}  # in the script's order (walk.used: a set)
    flow = GradientFlow(ops=ops, sources=used_sources, substitutes=walk.substitutes,
                        externals=walk.externals, finals=finals, loss_factors=factors,
                        sparse_variables={s.variable for s in sources.values() if s.role == VALUES})
    replaced = set(gradients.ops) | set(apply.ops) | walk.ops
    return ScriptTraining(apply, gradients, flow, variables, replaced, apply.where)


def _check_final_rows(finals, sources: Dict[str, Source], where: str) -> None:
    """A dense gradient given to apply_gradients must not be a gathered-rows tensor passed on bare."""
    for grad, variable in finals:
        if isinstance(grad, tf.IndexedSlices):
            continue
        source = sources.get(tf.convert_to_tensor(grad).name)
        if source is not None and source.role != DENSE:
            raise DappleError(f"apply_gradients at {where} gets a component of an IndexedSlices gradient as the "
                              f"dense gradient of {variable.op.name}; " + _INSTEAD)


def _variables(sources: Dict[str, Source], walk: _FlowWalk) -> List[tf.Variable]:
    seen: List[tf.Variable] = []
    for name in sorted(walk.used) + sorted(walk.substitutes):
        variable = sources[name].variable if name in sources else walk.substitutes[name].variable
        if variable not in seen:
            seen.append(variable)
    return seen
