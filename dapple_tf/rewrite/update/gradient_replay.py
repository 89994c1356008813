"""A script's own gradient transform, replayed once per step on the pipeline's full-batch gradients.

script_training.GradientFlow says what the script computes between its tf.gradients results and apply_gradients
(T: clipping, unscaling, filtering, ...). The factors the script scaled its loss by before differentiating (loss
scaling) are in each clone's loss gradient already: `loss_seed` is the seed the pipeline differentiates each clone's
loss with, so its backward computes on values as large as the script's (in float16 the small ones would round or
underflow otherwise). `replay` imports T once, its inputs mapped:
- each raw gradient component -> the pipeline's gradient of the same variable (accumulated over micro-batches,
  all-reduced);
- each sum of squares of a gathered-rows gradient -> the pipeline's per-lookup sum of squares (the accumulator
  keeps it: gradients.GradientAccumulator(square_sparse=True)), times the factors T scaled the rows by first;
- everything else T reads (constants, variables, the loss scale, the global step, the learning rate) -> itself.
Each imported operation runs on the device of its largest input (a gradient's device for per-gradient work; the
few scalars of a global norm gather where the first of them is), so T moves no gradient between devices.
A per-host graph replays T on the loss's task from every task's gradients (host_transform.py).
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.model import script_training as st
from dapple_tf.rewrite.graphs import graph_defs

Pairs = List[Tuple[object, tf.Variable]]
# (device -> scalar, device) -> their sum on that device, per task then over the tasks, or None where this graph
# does not hold it (the lowering's: hosts/task_sums.py)
SummedOverTasks = Callable[[Dict[str, tf.Tensor], str], Optional[tf.Tensor]]


def loss_seed(factors: Sequence[Tuple[str, tf.Tensor]], loss_weight: float, dtype: tf.DType) -> tf.Tensor:
    """The gradient a clone's loss is differentiated with: its share n_mj / N of the batch times the gradient of what
    the script differentiated with respect to its loss (script_training.loss_factors: loss * s -> s, loss / s ->
    1 / s), computed as the script's tf.gradients computes it, from 1 through the outermost factor first, in the
    loss's dtype (a factor of one element: a scalar)."""
    if not factors:
        return tf.constant(loss_weight, dtype=dtype)
    seed = tf.ones([], dtype)
    for kind, factor in factors:
        factor = tf.reshape(tf.cast(factor, dtype), [])
        seed = seed * factor if kind == "mul" else seed / factor
    return seed if loss_weight == 1 else seed * tf.constant(loss_weight, dtype=dtype)


def component(grad, role: str, dtype: tf.DType) -> tf.Tensor:
    """The pipeline's counterpart of one component of a raw gradient."""
    sparse = isinstance(grad, tf.IndexedSlices)
    if role == st.DENSE:
        return tf.convert_to_tensor(grad) if sparse else grad
    device = grad.values.device if sparse else grad.device
    with tf.device(device):
        if role == st.VALUES:
            return grad.values if sparse else grad
        if role == st.INDICES:
            return tf.cast(grad.indices, dtype) if sparse else tf.range(tf.shape(grad)[0], dtype=dtype)
        return tf.cast(grad.dense_shape, dtype) if sparse else tf.shape(grad, out_type=dtype)


def substitute(sub: st.Substitute, squares: Dict[str, tf.Tensor], device: str, summed: SummedOverTasks
               ) -> Optional[tf.Tensor]:
    """The value of a Substitute on `device`, from the per-lookup squares of its variable's gathered rows (device ->
    sum of squares), `summed` per task, then over the plan's tasks (hosts/task_sums.py). In a per-host graph another
    task's sums come through queues: None but on `device`'s task."""
    total = summed(squares, device)
    if total is None:
        return None
    with tf.device(device):
        total = tf.cast(total, sub.variable.dtype.base_dtype)
        for kind, factor in sub.factors:
            factor = tf.cast(factor, total.dtype)
            total = total * factor * factor if kind == "mul" else total / factor / factor
        if sub.kind == st.L2_LOSS:
            total = total / 2
        return tf.reshape(total, sub.shape)


def check_squares(sub: st.Substitute, squares: Dict[str, tf.Tensor]) -> None:
    if not squares:
        raise DappleError(f"the script's gradient transform sums the squares of the gathered rows of "
                          f"{sub.variable.op.name}, but the pipeline's gradient of it is not gathered rows alone")


def _device_of(op: tf.Operation, default: str) -> str:
    """The device of `op`'s largest placed input."""
    best, size = default, -1.0
    for t in op.inputs:
        if not t.device:
            continue
        elements = t.shape.num_elements() if t.shape.is_fully_defined() else float("inf")
        if elements > size:
            best, size = t.device, elements
    return best


def replay(flow: st.GradientFlow, grads_and_vars: Pairs, sparse_squares, default_device: str,
           summed: SummedOverTasks) -> Pairs:
    """The (gradient, variable) pairs the script would give apply_gradients, computed from the pipeline's
    `grads_and_vars` (its user variables' full-batch gradients) by T, in a graph of every device (the one graph; a
    per-host graph: hosts/host_transform.py); `summed`: substitute's. See the module docstring."""
    grad_of = {id(v): g for g, v in grads_and_vars}
    input_map: Dict[str, tf.Tensor] = {}
    for name, source in flow.sources.items():
        if id(source.variable) not in grad_of:
            raise DappleError(f"the pipeline computed no gradient for {source.variable.op.name}, which the script "
                              "applies")
        input_map[name] = component(grad_of[id(source.variable)], source.role, source_dtype(name))
    for name, sub in flow.substitutes.items():
        squares = sparse_squares.get(sub.variable, {})
        check_squares(sub, squares)
        input_map[name] = substitute(sub, squares, default_device, summed)
    return transformed(flow, input_map, default_device)


def source_dtype(name: str) -> tf.DType:
    """The dtype of the script's tensor `name` (a raw gradient component)."""
    return tf.compat.v1.get_default_graph().get_tensor_by_name(name).dtype


def transformed(flow: st.GradientFlow, input_map: Dict[str, tf.Tensor], default_device: str,
                place: Callable[[str], str] = lambda device: device) -> Pairs:
    """T imported with its inputs mapped by `input_map` (every source and substitute, by name): the script's final
    (gradient, variable) pairs. An operation runs on `place(the device of its largest input)` (a per-host graph's
    lowering places one on another task's device on `default_device` instead)."""
    graph = tf.compat.v1.get_default_graph()
    input_map = dict(flow.externals, **input_map)
    outputs = sorted({t.name for g, _ in flow.finals for _, t in st.components(g)} - set(input_map))
    imported: Dict[str, tf.Tensor] = {}
    if flow.ops and outputs:
        graph_def = graph_defs.stage_graph_defs(graph, [flow.ops])[0].graph_def
        first = len(graph.get_operations())
        read = {i for node in graph_def.node for i in node.input}
        fed = {name: t for name, t in input_map.items() if name in read or name.endswith(":0") and name[:-2] in read}
        results = tf.compat.v1.import_graph_def(graph_def, input_map=fed, return_elements=outputs,
                                                name="dapple/gradient_transform")
        for op in graph.get_operations()[first:]:
            device = _device_of(op, default_device)
            op._set_device(place(device))  # pylint: disable=protected-access
        imported = dict(zip(outputs, results))

    def mapped(t: tf.Tensor) -> tf.Tensor:
        return input_map[t.name] if t.name in input_map else imported[t.name]

    pairs = []
    for grad, variable in flow.finals:
        if isinstance(grad, tf.IndexedSlices):
            shape = mapped(grad.dense_shape) if grad.dense_shape is not None else None
            pairs.append((tf.IndexedSlices(mapped(grad.values), mapped(grad.indices), shape), variable))
        else:
            pairs.append((mapped(tf.convert_to_tensor(grad)), variable))
    return pairs
