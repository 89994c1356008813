"""Stage boundaries in per-host graphs: who reads whose activations, and the names of the queues between tasks.

A consumer replica reads, for each boundary tensor, the producer replicas `producers_read` lists (the same choice
StageBuilder makes in one graph: the first replica's whole tensor when it is not split by samples, the replica of
exactly its slice, else every replica its rows overlap). The producer's task computes the same list to know whom
to send its activations to, and `gradient_pieces` lists the gradient pieces each consumer replica sends back, so
both sides of every queue are built from the plan alone, without the other task's graph.
"""

from typing import List, Sequence, Tuple

from dapple_tf.rewrite.batch import microbatch


def producers_read(batch_major: bool, producer_sizes: Sequence[int], start: int, size: int) -> List[int]:
    """The producer replicas whose tensor a consumer replica of rows [start, start + size) reads."""
    if not batch_major:
        return [0]
    offsets = microbatch.offsets(producer_sizes)
    same = [i for i, (first, n) in enumerate(zip(offsets, producer_sizes)) if (first, n) == (start, size)]
    if same:
        return same[:1]
    return [i for i, _, _ in microbatch.overlapping_blocks(producer_sizes, start, size)]


def gradient_pieces(batch_major: bool, producer_sizes: Sequence[int], start: int, size: int
                    ) -> List[Tuple[int, int, int]]:
    """(producer replica, first row in the consumer's slice, rows) of each piece of a consumer replica's input
    gradient (rows [start, start + size)): what StageBuilder._send_input_grad cuts."""
    if not batch_major:
        return [(0, 0, size)]
    return microbatch.overlapping_blocks(producer_sizes, start, size)


def consumers_reading(batch_major: bool, producer_sizes: Sequence[int], consumer_sizes: Sequence[int], i: int
                      ) -> List[int]:
    """The consumer replicas whose `producers_read` includes producer replica i (its inverse, in one pass)."""
    if not batch_major:
        return list(range(len(consumer_sizes))) if i == 0 else []
    producer_starts, consumer_starts = microbatch.offsets(producer_sizes), microbatch.offsets(consumer_sizes)
    slices = set(zip(producer_starts, producer_sizes))
    first, end = producer_starts[i], producer_starts[i] + producer_sizes[i]
    out = []
    for j, (start, size) in enumerate(zip(consumer_starts, consumer_sizes)):
        if start < end and first < start + size:
            if (start, size) not in slices or (start, size) == (first, producer_sizes[i]):
                out.append(j)
    return out


def gradient_pieces_for(batch_major: bool, producer_sizes: Sequence[int], consumer_sizes: Sequence[int], i: int
                        ) -> List[Tuple[int, int, int]]:
    """(consumer replica, first row in producer replica i's slice, rows) of each gradient piece producer replica i
    gets (the pieces `gradient_pieces` cuts for it, in one pass)."""
    if not batch_major:
        return [(j, 0, size) for j, size in enumerate(consumer_sizes)] if i == 0 else []
    first = microbatch.offsets(producer_sizes)[i]
    end = first + producer_sizes[i]
    out = []
    for j, (start, size) in enumerate(zip(microbatch.offsets(consumer_sizes), consumer_sizes)):
        lo, hi = max(start, first), min(start + size, end)
        if lo < hi:
            out.append((j, lo - first, hi - lo))
    return out


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
