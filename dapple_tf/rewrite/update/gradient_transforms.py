"""What happens to the full-batch gradients between the AllReduce and the apply step: global-norm clipping and
the user's gradient function (PipelineOptions.clip_global_norm, .gradient_fn).

Clipping equals `tf.clip_by_global_norm(tf.gradients(loss, tvars), c)` on one device: the norm spans every
stage's variables, each counted once. Each device sums the squares of the gradients it holds (its variables'
reduced gradients; for a gradient of gathered rows, as TF's IndexedSlices count them, the squares of every
micro-batch's gathered rows, which the accumulator keeps per device), one scalar per device goes to the loss's
device, and the scale (c / max(norm, c)) comes back: one scalar each way per device and step. Every apply then
waits for every stage's gradients, as it does on one device.

The gradient function sees (gradient, variable) of the user's variables, after clipping, in the order of
tf.compat.v1.trainable_variables(); it runs once per step, where the variables' gradients are, and each copy on
another device applies what it returned (a transfer per extra replica: clipping alone costs none).
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.rewrite.update.collectives import ordered_sum

Pairs = List[Tuple[object, tf.Variable]]


def _scaled(grad, scale: tf.Tensor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(scale, grad.dtype)


def global_norm(square_sums: Dict[str, List[tf.Tensor]], device: str,
                summed: Callable[[Dict[str, tf.Tensor], str], Optional[tf.Tensor]]) -> Optional[tf.Tensor]:
    """sqrt of the sum of squares, on `device`: summed on each device holding some, then `summed` per task and over
    the plan's tasks (the lowering's: hosts/task_sums.py). None in a per-host graph where `device` is another
    task's."""
    by_device = {}
    for d in sorted(square_sums):
        with tf.device(d):
            by_device[d] = ordered_sum([tf.cast(t, tf.float32) for t in square_sums[d]])
    total = summed(by_device, device)
    if total is None:
        return None
    with tf.device(device):
        return tf.sqrt(total, name="dapple_global_norm")


def clip_scale(norm: tf.Tensor, clip_norm: float) -> tf.Tensor:
    """tf.clip_by_global_norm's scale: clip / max(norm, clip); NaN when the norm is not finite."""
    with tf.device(norm.device):
        clip = tf.constant(clip_norm, norm.dtype)
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip)
        return scale + (norm - norm)


def square_sums(grads_and_vars: Pairs, sparse_squares: Dict[tf.Variable, Dict[str, tf.Tensor]],
                order: Sequence[tf.Variable], counted: Callable[[tf.Variable, str], bool]
                ) -> Dict[str, List[tf.Tensor]]:
    """Device -> the sums of squares it holds, in `order` of the variables: a dense gradient's where it is (if
    `counted(variable, device)`: each variable once over the per-host graphs), a sparse one's per device from the
    accumulator (`sparse_squares`: variable -> device -> the sum of its gathered rows' squares)."""
    out: Dict[str, List[tf.Tensor]] = {}
    for grad, variable in _in_order(grads_and_vars, order):
        if variable in sparse_squares:
            for d, squares in sparse_squares[variable].items():
                out.setdefault(d, []).append(squares)
            continue
        dense = tf.convert_to_tensor(grad)
        if not counted(variable, dense.device):
            continue
        with tf.device(dense.device):
            out.setdefault(dense.device, []).append(tf.reduce_sum(tf.square(dense)))
    return out


def _in_order(grads_and_vars: Pairs, order: Sequence[tf.Variable]) -> Pairs:
    """The pairs in `order` of their variables, those it lacks last."""
    by_variable = {id(v): (g, v) for g, v in grads_and_vars}
    ordered = [by_variable[id(v)] for v in order if id(v) in by_variable]
    return ordered + [p for p in grads_and_vars if p not in ordered]


def clip_pairs(apply_pairs: Pairs, scale: tf.Tensor) -> Pairs:
    """Every (gradient, copy) scaled, on the copy's gradient's device."""
    clipped = []
    for grad, copy in apply_pairs:
        device = grad.values.device if isinstance(grad, tf.IndexedSlices) else grad.device
        with tf.device(device):
            clipped.append((_scaled(grad, tf.identity(scale)), copy))
    return clipped


def apply_gradient_fn(gradient_fn: Callable, grads_and_vars: Pairs, order: Sequence[tf.Variable]) -> Pairs:
    """gradient_fn on the user's (gradient, variable) pairs in `order`; its result checked to hold each
    variable once, with a gradient."""
    by_variable = {id(v): (g, v) for g, v in grads_and_vars}
    ordered = _in_order(grads_and_vars, order)
    result = gradient_fn(list(ordered))
    try:
        result = list(result)
    except TypeError:
        raise DappleError(f"gradient_fn must return a list of (gradient, variable) pairs, got {type(result).__name__}"
                          ) from None
    seen = {}
    for pair in result:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise DappleError(f"gradient_fn must return (gradient, variable) pairs, got {pair!r}")
        grad, variable = pair
        if id(variable) not in by_variable:
            name = getattr(variable, "name", repr(variable))
            raise DappleError(f"gradient_fn returned a gradient for {name}, which is not one of the variables it was "
                              "given: it must return the variables it got, each once")
        if id(variable) in seen:
            raise DappleError(f"gradient_fn returned {variable.name} twice")
        if grad is None:
            raise DappleError(f"gradient_fn returned no gradient (None) for {variable.name}: return every variable "
                              "it was given with a gradient (zeros to leave it unchanged)")
        seen[id(variable)] = (grad, variable)
    missing = [v.name for g, v in ordered if id(v) not in seen]
    if missing:
        raise DappleError(f"gradient_fn dropped the gradients of {missing}: it must return every variable it was given")
    return [seen[id(v)] for _, v in ordered]


def transform(grads_and_vars: Pairs, apply_pairs: Pairs, copies_of: Callable[[tf.Variable], Dict[str, tf.Variable]],
              clip_global_norm: Optional[float], gradient_fn: Optional[Callable], norm_device: str,
              sparse_squares, order: Sequence[tf.Variable], script_flow=None, *, cluster
              ) -> Tuple[Pairs, Optional[tf.Tensor]]:
    """The (gradient, copy) pairs to apply after clipping and gradient_fn, and the global norm (None without
    clipping, and in a per-host graph but on the norm's task). With `script_flow` (script_training.GradientFlow),
    the script's own transform replaces both (gradient_replay.py), and only the variables it applies are applied.
    cluster: the lowering's view of the cluster's gradients (hosts/lowering.py, one graph's or a task's): which
    device counts each variable's square (`counted`), sums of squares over the tasks (`summed_norm`), the clipping
    scale where this graph reads it (`shared`), and the transforms of every gradient at once (`replay`,
    `gradient_fn_finals`: id(user variable) -> its final gradient)."""
    if script_flow is not None:
        transformed = cluster.replay(script_flow, grads_and_vars, sparse_squares, norm_device)
        return _to_copies(transformed, grads_and_vars, apply_pairs, copies_of), None
    norm = None
    if clip_global_norm is not None:
        norm = global_norm(square_sums(grads_and_vars, sparse_squares, order, cluster.counted), norm_device,
                           cluster.summed_norm)
        scale = cluster.shared(lambda: clip_scale(norm, clip_global_norm), norm_device)
        if gradient_fn is None:
            return clip_pairs(apply_pairs, scale), norm
        grads_and_vars = clip_pairs(grads_and_vars, scale)
    if gradient_fn is None:
        return apply_pairs, norm
    transformed = cluster.gradient_fn_finals(lambda pairs: apply_gradient_fn(gradient_fn, pairs, order),
                                             grads_and_vars, order, norm_device)
    return _to_copies(transformed, grads_and_vars, apply_pairs, copies_of), norm


def _to_copies(transformed: Dict[int, object], grads_and_vars: Pairs, apply_pairs: Pairs, copies_of) -> Pairs:
    """Each copy's pair with its user variable's transformed gradient (copies of variables left out are left out)."""
    user_of = {id(c): v for _, v in grads_and_vars for c in copies_of(v).values()}
    return [(transformed[id(user_of[id(copy)])], copy) for _, copy in apply_pairs
            if id(user_of[id(copy)]) in transformed]
