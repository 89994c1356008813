"""Reading a traced step (RunMetadata.step_stats): when each operation ran, and peak allocator use per device.

`op_interval_ns` is an operation's time: from when its device's executor took it up to when its kernel
finished. TF's other end stamp (all_end) comes after the executor has handed the outputs on, so it is not
an order: a thread preempted between the two stamps an end after a successor started (2 of 2000 steps beside
8 CPU-burning processes, up to 4.8 ms after, on TF's own graph edges; the kernel's end never, 2026-11-28).

A step run with RunOptions(trace_level=FULL_TRACE) records, for every operation, the bytes its
device's allocator had in use when it ran; the largest of these per device is the step's peak.
It works on remote devices too (workers return their step stats). Virtual CPU devices of one
process share one allocator, so each reports the process's peak; with the BFC CPU allocator
(TF_CPU_ALLOCATOR_USE_BFC=true) CPU devices report figures at all. The same trace also records
every allocation an operation made and its release (time, +-bytes): summed in time order per
device, they give each device's peak of what the step itself allocated, virtual devices included
(`step_allocation_peaks`). Constants are not in those
records: `constant_bytes_per_device` reads them from the step's partition graphs.
"""

from typing import Dict, Tuple

import tensorflow as tf


def op_interval_ns(node) -> Tuple[int, int]:
    """(start, end) of a NodeExecStats in ns: the executor taking the operation up, its kernel finishing (for an
    asynchronous kernel, its done callback); records without a kernel end (a worker's RecvTensor) end at all_end.
    Every operation that waits for this one starts at or after its end."""
    start = node.all_start_nanos or node.all_start_micros * 1000
    kernel_end = node.op_end_rel_nanos or node.op_end_rel_micros * 1000
    return start, start + (kernel_end or node.all_end_rel_nanos or node.all_end_rel_micros * 1000)


def peak_bytes_per_device(step_stats) -> Dict[str, int]:
    """Device name -> the largest `allocator_bytes_in_use` any of its operations saw (devices with none left out)."""
    peaks: Dict[str, int] = {}
    for device_stats in step_stats.dev_stats:
        used = [m.allocator_bytes_in_use for node in device_stats.node_stats for m in node.memory]
        if used and max(used) > 0:
            peaks[device_stats.device] = max(peaks.get(device_stats.device, 0), max(used))
    return peaks


def step_allocation_peaks(step_stats) -> Dict[str, int]:
    """Device name -> the largest total, over the step, of the bytes its operations had allocated and not yet
    released (the allocation records: +bytes when allocated, -bytes when released, each kept by the operation
    that allocated). Excludes what lives across steps (variables, the allocator's state before the step)."""
    peaks: Dict[str, int] = {}
    for device_stats in step_stats.dev_stats:
        records = sorted((r.alloc_micros, r.alloc_bytes) for node in device_stats.node_stats
                         for m in node.memory for r in m.allocation_records)
        live = peak = 0
        for _, nbytes in records:
            live += nbytes
            peak = max(peak, live)
        if records:
            peaks[device_stats.device] = max(peaks.get(device_stats.device, 0), peak)
    return peaks


def constant_bytes_per_device(partition_graphs) -> Dict[str, int]:
    """Device name -> bytes of the constants placed on it, from a step's partition graphs
    (RunOptions(output_partition_graphs=True)): persistent like variables and absent from the
    step's allocation records (grappler folds constant inputs, e.g. the micro-batch slices of a
    constant batch, into constants on the consuming device)."""
    totals: Dict[str, int] = {}
    for graph in partition_graphs:
        for node in graph.node:
            if node.op == "Const":
                nbytes = tf.make_ndarray(node.attr["value"].tensor).nbytes
                totals[node.device] = totals.get(node.device, 0) + nbytes
    return totals
