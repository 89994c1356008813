"""The names of the queues between tasks' graphs (per-host graphs): one per boundary tensor, replica pair and
micro-batch, per extra output's clone, and per task for the scalars summed over the tasks. Both sides of a queue
derive its name from the plan alone (the pairs: planner/formats/program.py's row pairing), without the other task's
graph.
"""

from typing import Tuple


def _pair(name: str, producer: Tuple[int, int], consumer: Tuple[int, int], m: int) -> str:
    return f"{name}/s{producer[0]}r{producer[1]}-s{consumer[0]}r{consumer[1]}/mb{m}"


def activation_key(name: str, producer: Tuple[int, int], consumer: Tuple[int, int], m: int) -> str:
    """The queue of boundary tensor `name` from (stage, replica) `producer` to `consumer`, micro-batch m."""
    return "dapple/activation/" + _pair(name, producer, consumer, m)


def gradient_key(name: str, producer: Tuple[int, int], consumer: Tuple[int, int], m: int) -> str:
    """The queue of the gradient piece of `name` that `consumer` sends back to `producer`, micro-batch m."""
    return "dapple/gradient/" + _pair(name, producer, consumer, m)


def loss_key(task: str) -> str:
    """The queue of task `task`'s sum of its weighted losses, to the loss's device."""
    return f"dapple/loss/{task}"


def extra_key(name: str, stage: int, replica: int, m: int) -> str:
    """The queue of clone (stage, micro-batch m, replica)'s value of template tensor `name` (an extra output, a
    batch statistic, a tensor a summary reads), to the device that combines the clones' values once per step."""
    return f"dapple/extra/{name}/s{stage}r{replica}/mb{m}"


def norm_key(task: str) -> str:
    """The queue of task `task`'s sum of squares of its gradients, to the global norm's device (clipping)."""
    return f"dapple/norm/{task}"


def scale_key(task: str) -> str:
    """The queue of the clipping scale, from the global norm's device to task `task`."""
    return f"dapple/clip_scale/{task}"
