"""A script's own gradient transform (gradient_replay.py) in a per-host graph: replayed on the loss's task.

T may need every variable's gradient at once (a global norm), and each task holds only its own. So every task sends
the loss's device the components of the gradients it counts (each variable's on the task where the one graph has its
reduced gradient: gradient_transforms._counted_once) and its sums of squares of the gathered rows T reads (summed per
task, then over the tasks, as the one graph sums them: task_sums.py). The loss's task replays T on them, the same
operations on the same values (the same bits on CPUs), and sends each final gradient to every other task that
applies a copy of its variable, once per task, to its first device holding one. So every gradient crosses to the
loss's task and back in every step, where the one graph moves only T's scalars between devices.
"""

from typing import Callable, Dict, List, Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.model import script_training as st
from dapple_tf.rewrite import gradient_replay, host_part

Pairs = List[Tuple[object, tf.Variable]]


def _key(kind: str, name: str, task: str = "") -> str:
    """A queue's name, the same on every task: kind is source, squares or final."""
    return f"dapple/transform/{kind}/{name.replace(':', '_')}{task}"


def _device(grad) -> str:
    return grad.values.device if isinstance(grad, tf.IndexedSlices) else grad.device


def replay(flow: st.GradientFlow, grads_and_vars: Pairs, sparse_squares, norm_device: str, host,
           counted: Callable[[tf.Variable, str], bool], copy_devices: Dict[tf.Variable, Sequence[str]],
           plan_devices: Sequence[str]) -> Dict[int, object]:
    """id(user variable) -> its final gradient, for the variables the script applies and this task holds copies of
    (module docstring). grads_and_vars, sparse_squares: this task's; counted(variable, device): whether this task
    sends that gradient; copy_devices: every device of the cluster holding a copy of each variable."""
    graph = tf.compat.v1.get_default_graph()
    here = host.is_local(norm_device)
    grad_of = {id(v): g for g, v in grads_and_vars}
    input_map: Dict[str, tf.Tensor] = {}
    for name, source in sorted(flow.sources.items()):
        variable, grad = source.variable, grad_of.get(id(source.variable))
        dtype = gradient_replay.source_dtype(name)
        if grad is not None and counted(variable, _device(grad)):
            value = gradient_replay.component(grad, source.role, dtype, flow)
            if here:
                input_map[name] = value
            else:
                host.send(_key("source", name), value, norm_device)
        elif here:
            if variable not in copy_devices:
                raise DappleError(f"the pipeline computed no gradient for {variable.op.name}, which the script "
                                  "applies")
            input_map[name] = host.receive(_key("source", name), dtype, graph.get_tensor_by_name(name).shape,
                                           norm_device)
    for name, sub in sorted(flow.substitutes.items()):
        squares = sparse_squares.get(sub.variable, {})
        if id(sub.variable) in grad_of:
            gradient_replay.check_squares(sub, squares)
        value = gradient_replay.substitute(sub, squares, flow, norm_device, plan_devices, host,
                                           key=lambda task, n=name: _key("squares", n, task))
        if here:
            input_map[name] = value
    if here:
        finals = gradient_replay.transformed(flow, input_map, norm_device, host.is_local)
        out = _send_finals(finals, host, copy_devices)
    else:
        out = _receive_finals(flow.finals, host, copy_devices)
    missing = [v.op.name for _, v in flow.finals if id(v) in grad_of and id(v) not in out]
    if missing:
        raise DappleError(f"per-host graph of {host.task}: no final gradient for its copies of {missing}")
    return out


def _firsts(devices: Sequence[str]) -> Dict[str, str]:
    """Task -> its first device among `devices` (placed ones)."""
    out: Dict[str, str] = {}
    for d in sorted(d for d in devices if d):
        out.setdefault(host_part.task_of(d), d)
    return out


def _send_finals(finals: Pairs, host, copy_devices) -> Dict[int, object]:
    out = {}
    for grad, variable in finals:
        out[id(variable)] = grad
        for task, first in _firsts(copy_devices.get(variable, ())).items():
            if task == host.task:
                continue
            for role, part in st.components(grad):
                host.send(_key("final", f"{variable.op.name}/{role}", task), part, first)
    return out


def _receive_finals(template_finals: Pairs, host, copy_devices) -> Dict[int, object]:
    """The final gradients of this task's copies, shaped as the script's own (its template's) are."""
    out = {}
    for grad, variable in template_finals:
        first = _firsts(copy_devices.get(variable, ())).get(host.task)
        if first is None:
            continue
        parts = {role: host.receive(_key("final", f"{variable.op.name}/{role}", host.task), t.dtype, t.shape, first)
                 for role, t in st.components(grad)}
        if isinstance(grad, tf.IndexedSlices):
            out[id(variable)] = tf.IndexedSlices(parts[st.VALUES], parts[st.INDICES], parts.get(st.DENSE_SHAPE))
        else:
            out[id(variable)] = parts[st.DENSE]
    return out
