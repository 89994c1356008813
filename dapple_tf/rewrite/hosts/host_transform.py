"""Gradient transforms that see every variable's gradient at once, in a per-host graph: run on the loss's task.

A script's own transform T (gradient_replay.py) and PipelineOptions.gradient_fn may need every gradient at once (a
global norm), and each task holds only its own. So every task sends the loss's device the gradients it counts (each
variable's from the task where the one graph has its reduced gradient: counted_once), as their
components (a gradient of gathered rows as values, indices and shape: gradient_kinds.py tells every task which), and,
for T, its sums of squares of the gathered rows T reads (summed per task, then over the tasks, as the one graph sums
them: task_sums.py). The loss's task runs the transform on them, the same operations on the same values (the same
bits on CPUs), and sends each final gradient to every other task that applies a copy of its variable, once per task,
to its first device holding one. So every gradient crosses to the loss's task and back in every step, where the one
graph moves only a norm's scalars between devices. `TaskGradients` is what a per-host graph's reduction and transforms
get (lowered_gradients.GraphGradients, as a per-host graph has it): each variable's devices and kind from the plan,
and these transforms.
"""

import functools
from typing import Callable, Dict, List, Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError, PerHostError
from dapple_tf.model import script_training as st
from dapple_tf.rewrite.hosts import host_part, lowered_gradients, queue_names, task_sums
from dapple_tf.rewrite.update import gradient_replay

Pairs = List[Tuple[object, tf.Variable]]
Spec = List[Tuple[str, tf.DType, tf.TensorShape]]  # a gradient's components: (role, dtype, shape)


class TaskGradients(lowered_gradients.GraphGradients):
    """A per-host graph's gradients (lowering.py's TaskGraph.cluster_gradients): each variable's devices and kind from
    the plan, the same for every task (StageBuilder.variable_devices, gradient_kinds), and the transforms that see
    every gradient on the loss's task (this module's `replay` and `gradient_fn_finals`)."""

    def __init__(self, part, builder, copies_of: Callable, plan_devices: Sequence[str]):
        super().__init__(part, builder.accumulator, plan_devices)
        self.devices_of = builder.variable_devices()
        # the variables with gradients: gathered rows or not (StageBuilder.gradient_kinds)
        self.kinds: Dict[tf.Variable, bool] = builder.gradient_kinds()
        self.gathered = {v for v, rows in self.kinds.items() if rows}
        self._builder = builder
        # whether this task sends the variable's gradient on that device
        self.counted: Callable[[tf.Variable, str], bool] = counted_once(copies_of, self.devices_of)

    @property
    def copy_devices(self) -> Dict[tf.Variable, Tuple[str, ...]]:
        """Every device holding a copy of each variable."""
        return self._builder.copy_devices()

    def shared(self, make: Callable[[], tf.Tensor], device: str) -> tf.Tensor:
        """Built on the norm's task and sent to every other task, which receives it on its first device."""
        return task_sums.shared_from(make, device, self.plan_devices, self.part, queue_names.scale_key)

    def replay(self, flow, grads_and_vars, sparse_squares, norm_device: str) -> Dict[int, object]:
        """Replayed on the loss's task from every task's gradients, the finals sent back (`replay` below)."""
        return replay(flow, grads_and_vars, sparse_squares, norm_device, self)

    def gradient_fn_finals(self, call: Callable, grads_and_vars, order, norm_device: str) -> Dict[int, object]:
        return gradient_fn_finals(call, grads_and_vars, order, norm_device, self)


def _key(kind: str, name: str, task: str = "") -> str:
    """A queue's name, the same on every task: kind is source, squares, gradient or final."""
    return f"dapple/transform/{kind}/{name.replace(':', '_')}{task}"


def _device(grad) -> str:
    return grad.values.device if isinstance(grad, tf.IndexedSlices) else grad.device


def replay(flow: st.GradientFlow, grads_and_vars: Pairs, sparse_squares, norm_device: str,
           cluster: TaskGradients) -> Dict[int, object]:
    """id(user variable) -> its final gradient, for the variables the script applies and this task holds copies of
    (module docstring). grads_and_vars, sparse_squares: this task's."""
    host = cluster.part
    graph = tf.compat.v1.get_default_graph()
    here = host.is_local(norm_device)
    grad_of = {id(v): g for g, v in grads_and_vars}
    input_map: Dict[str, tf.Tensor] = {}
    for name, source in sorted(flow.sources.items()):
        variable, grad = source.variable, grad_of.get(id(source.variable))
        dtype = gradient_replay.source_dtype(name)
        if grad is not None and cluster.counted(variable, _device(grad)):
            value = gradient_replay.component(grad, source.role, dtype)
            if here:
                input_map[name] = value
            else:
                host.send(_key("source", name), value, norm_device)
        elif here:
            if variable not in cluster.kinds:
                raise DappleError(f"the pipeline computed no gradient for {variable.op.name}, which the script "
                                  "applies")
            input_map[name] = host.receive(_key("source", name), dtype, graph.get_tensor_by_name(name).shape,
                                           norm_device)
    for name, sub in sorted(flow.substitutes.items()):
        squares = sparse_squares.get(sub.variable, {})
        if id(sub.variable) in grad_of:
            gradient_replay.check_squares(sub, squares)
        value = gradient_replay.substitute(sub, squares, norm_device, functools.partial(
            task_sums.summed_over_tasks, plan_devices=cluster.plan_devices, host=host,
            key=lambda task, n=name: _key("squares", n, task)))
        if here:
            input_map[name] = value
    if here:
        finals = gradient_replay.transformed(flow, input_map, norm_device,
                                             lambda device: device if host.is_local(device) else norm_device)
        out = _send_finals(finals, cluster)
    else:
        out = _receive_finals([(v, _spec(g)) for g, v in flow.finals], cluster)
    _check_received(out, [v for _, v in flow.finals], grad_of, host)
    return out


def gradient_fn_finals(call: Callable[[Pairs], Pairs], grads_and_vars: Pairs, order: Sequence[tf.Variable],
                       norm_device: str, cluster: TaskGradients) -> Dict[int, object]:
    """id(user variable) -> what `call` (gradient_transforms.apply_gradient_fn) returned for it from every task's
    gradients, for the variables this task holds copies of (module docstring)."""
    host = cluster.part
    here = host.is_local(norm_device)
    grad_of = {id(v): g for g, v in grads_and_vars}
    pairs = []
    for variable in order:
        if variable not in cluster.kinds:
            continue  # no stage gives it a gradient: in the one graph's pairs neither
        grad, spec = grad_of.get(id(variable)), _variable_spec(variable, cluster.kinds[variable])
        if grad is not None and cluster.counted(variable, _device(grad)):
            parts = st.components(grad)
            if [role for role, _ in parts] != [role for role, _, _ in spec]:
                raise PerHostError(f"per-host graph of {host.task}: the gradient of {variable.op.name} is not of the "
                                   "kind the other tasks expect")
            if not here:
                for role, part in parts:
                    host.send(_key("gradient", f"{variable.op.name}/{role}"), part, norm_device)
        elif here:
            grad = _assembled({role: host.receive(_key("gradient", f"{variable.op.name}/{role}"), dtype, shape,
                                                  norm_device) for role, dtype, shape in spec})
        if here:
            pairs.append((grad, variable))
    if here:
        finals = call(pairs)
        for (given, variable), (returned, _) in zip(pairs, finals):
            if isinstance(given, tf.IndexedSlices) != isinstance(returned, tf.IndexedSlices):
                raise PerHostError(f"per-host graphs (PipelineOptions.own_task): gradient_fn returned the gradient of "
                                   f"{variable.op.name} as {_kind(returned)}, which it got as {_kind(given)}: the "
                                   "other tasks apply it as they sent it")
        out = _send_finals(finals, cluster)
    else:
        out = _receive_finals([(v, _variable_spec(v, cluster.kinds[v])) for v in order if v in cluster.kinds],
                              cluster)
    _check_received(out, [v for v in order if v in cluster.kinds], grad_of, host)
    return out


def counted_once(copies_of, variable_devices) -> Callable[[tf.Variable, str], bool]:
    """Whether a per-host graph counts a variable's gradient (its square, or as a source of a transform) where it
    is: on the device where the one graph has it (gradients.reduce_and_pair: the variable's own if it accumulates
    there, else the first that does)."""
    def counted(variable, device):
        home = next((d for d, c in copies_of(variable).items() if c is variable), None)
        devices = variable_devices[variable]
        return device == (home if home in devices else devices[0])
    return counted


def _kind(grad) -> str:
    return "gathered rows (IndexedSlices)" if isinstance(grad, tf.IndexedSlices) else "a dense tensor"


def _spec(grad) -> Spec:
    """The components of a gradient like `grad` (a template's tensor or IndexedSlices)."""
    return [(role, t.dtype, t.shape) for role, t in st.components(grad)]


def _variable_spec(variable: tf.Variable, gathered: bool) -> Spec:
    """The components of the pipeline's reduced gradient of `variable` (gradients._as_slices for gathered rows)."""
    dtype, shape = variable.dtype.base_dtype, variable.shape
    if not gathered:
        return [(st.DENSE, dtype, shape)]
    return [(st.VALUES, dtype, tf.TensorShape([None]).concatenate(shape[1:])),
            (st.INDICES, tf.int64, tf.TensorShape([None])), (st.DENSE_SHAPE, tf.int64, tf.TensorShape([shape.rank]))]


def _assembled(parts: Dict[str, tf.Tensor]):
    if st.DENSE in parts:
        return parts[st.DENSE]
    return tf.IndexedSlices(parts[st.VALUES], parts[st.INDICES], parts.get(st.DENSE_SHAPE))


def _check_received(out: Dict[int, object], variables: Sequence[tf.Variable], grad_of, host) -> None:
    missing = [v.op.name for v in variables if id(v) in grad_of and id(v) not in out]
    if missing:
        raise DappleError(f"per-host graph of {host.task}: no final gradient for its copies of {missing}")


def _firsts(devices: Sequence[str]) -> Dict[str, str]:
    """Task -> its first device among `devices` (placed ones)."""
    out: Dict[str, str] = {}
    for d in sorted(d for d in devices if d):
        out.setdefault(host_part.task_of(d), d)
    return out


def _send_finals(finals: Pairs, cluster: TaskGradients) -> Dict[int, object]:
    out = {}
    for grad, variable in finals:
        out[id(variable)] = grad
        for task, first in _firsts(cluster.copy_devices.get(variable, ())).items():
            if task == cluster.part.task:
                continue
            for role, part in st.components(grad):
                cluster.part.send(_key("final", f"{variable.op.name}/{role}", task), part, first)
    return out


def _receive_finals(specs: List[Tuple[tf.Variable, Spec]], cluster: TaskGradients) -> Dict[int, object]:
    """The final gradients of this task's copies, of the components `specs` gives per variable."""
    out = {}
    host = cluster.part
    for variable, spec in specs:
        first = _firsts(cluster.copy_devices.get(variable, ())).get(host.task)
        if first is not None:
            out[id(variable)] = _assembled({role: host.receive(_key("final", f"{variable.op.name}/{role}", host.task),
                                                               dtype, shape, first) for role, dtype, shape in spec})
    return out
