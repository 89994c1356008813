"""Memory a run allocates, from TF's allocator statistics (BFC allocator; on CPU it needs
TF_CPU_ALLOCATOR_USE_BFC=true set before TensorFlow starts).

- `run_peak_bytes`: the allocator's peak above its use before one session run.
- `step_peak_bytes`: a forward+backward step's peak plus the weights (LayerCostProfile.step_peak_bytes).
- `backward_working_bytes`: what one layer's backward allocates at its peak (the gradients it
  produces and its temporaries, e.g. the dense gradient buffers an unrolled loop's per-step slices
  are aggregated from), beyond the fed forward values: the peak of the backward run minus that of a
  no-op run with the same feeds (the feeding itself may allocate).
"""

import tensorflow as tf


def allocator_name(device: str) -> str:
    """`CPU:0` for /device:CPU:0 (the name tf.config.experimental.get_memory_info takes)."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type.upper()}:{spec.device_index or 0}"


def run_peak_bytes(sess, fetches, feed, device: str) -> float:
    """Allocator peak on `device` above its use before one `sess.run(fetches, feed)`; RuntimeError
    when the allocator keeps no statistics (CPU without TF_CPU_ALLOCATOR_USE_BFC=true)."""
    name = allocator_name(device)
    try:
        start = tf.config.experimental.get_memory_info(name)["current"]
        tf.config.experimental.reset_memory_stats(name)
    except ValueError as e:
        raise RuntimeError(f"cannot read allocator statistics of {name} (on CPU set TF_CPU_ALLOCATOR_USE_BFC=true "
                           f"before TensorFlow starts): {e}") from None
    sess.run(fetches, feed_dict=feed)
    return float(tf.config.experimental.get_memory_info(name)["peak"] - start)


def step_peak_bytes(sess, grads, feed, device, parameter_bytes: float, runs: int = 3) -> float:
    """Weights plus the allocator's peak above its use before a forward+backward step (gradients
    and what the step keeps for backward), on `device`: the median of `runs` steps (a step's peak
    moves with the allocator's chunk reuse, e.g. VGG-19 tiny at batch 8: 1.32-1.38 MB)."""
    sess.run(grads, feed_dict=feed)  # warm-up: allocator pools, constant folding
    return _median(run_peak_bytes(sess, grads, feed, device) for _ in range(runs)) + parameter_bytes


def backward_working_bytes(sess, target, probe, feed, device, runs: int = 3) -> float:
    """Peak bytes one layer's backward run (`target` fed its forward values) allocates beyond the
    feeding: the median peak of `runs` runs minus that of the no-op `probe` with the same feeds
    (>= 0). One run's peak follows the executor's op order (GNMT tiny's first LSTM at batch 8:
    86-163 KB between single runs)."""
    sess.run(target, feed_dict=feed)  # warm-up
    total = _median(run_peak_bytes(sess, target, feed, device) for _ in range(runs))
    feeding = _median(run_peak_bytes(sess, probe, feed, device) for _ in range(runs))
    return max(total - feeding, 0.0)


def _median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]
