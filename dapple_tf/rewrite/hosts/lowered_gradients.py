"""The cluster's gradients as one lowered graph reduces and transforms them (lowering.py makes them).

update/gradients.reduce_and_pair and update/gradient_transforms.transform take one of these instead of asking which
devices are this task's: which devices of the cluster accumulate each variable's gradient and which are gathered
rows (`devices_of`, `gathered`: None where the graph holds them all, as the accumulator has them), where each
variable's square is counted for clipping (`counted`), sums over the tasks (`summed_norm`), the clipping scale where
this graph reads it (`shared`), and the transforms that see every gradient at once (`replay`: a script's own,
`gradient_fn_finals`: PipelineOptions.gradient_fn). `GraphGradients` is the one graph's: everything here.
A per-host graph's, host_transform.TaskGradients, extends it: from the plan, with scalars and gradients crossing
to and from the loss's task.
"""

from typing import Callable, Dict, Optional, Sequence

import tensorflow as tf

from dapple_tf.rewrite.hosts import queue_names, task_sums
from dapple_tf.rewrite.update import gradient_replay


class GraphGradients:
    """The one graph's gradients: every device's accumulated, reduced and transformed in this graph."""

    devices_of = None  # the accumulator's (GradientAccumulator.devices_of)
    gathered = None  # as the accumulator has them (GradientAccumulator.is_sparse)

    def __init__(self, part, accumulator, plan_devices: Sequence[str]):
        """part: the lowering (lowering.OneGraph or TaskGraph); plan_devices: every stage's devices."""
        del accumulator
        self.part, self.plan_devices = part, plan_devices

    def counted(self, variable: tf.Variable, device: str) -> bool:
        """Whether this graph counts the square of `variable`'s gradient on `device`: wherever it holds one."""
        del variable, device
        return True

    def summed_norm(self, by_device: Dict[str, tf.Tensor], device: str) -> Optional[tf.Tensor]:
        """The sums of squares `by_device` summed on `device` per task, then over the plan's tasks (task_sums.py)."""
        return task_sums.summed_over_tasks(by_device, device, self.plan_devices, self.part, queue_names.norm_key)

    def shared(self, make: Callable[[], tf.Tensor], device: str) -> tf.Tensor:
        """The clipping scale `make()` builds on `device`, where this graph reads it."""
        del device
        return make()

    def replay(self, flow, grads_and_vars, sparse_squares, norm_device: str) -> Dict[int, object]:
        """id(user variable) -> its final gradient from a script's own transform (gradient_replay.py)."""
        pairs = gradient_replay.replay(flow, grads_and_vars, sparse_squares, norm_device, self._summed_squares)
        return {id(v): g for g, v in pairs}

    def _summed_squares(self, by_device: Dict[str, tf.Tensor], device: str) -> Optional[tf.Tensor]:
        return task_sums.summed_over_tasks(by_device, device, list(by_device), self.part, str)

    def gradient_fn_finals(self, call: Callable, grads_and_vars, order, norm_device: str) -> Dict[int, object]:
        """id(user variable) -> what `call` (gradient_transforms.apply_gradient_fn) returned for it."""
        del order, norm_device
        return {id(v): g for g, v in call(grads_and_vars)}
