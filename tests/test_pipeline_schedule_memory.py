"""Each schedule's memory in the runtime: per-device peaks of what a traced step allocates
(dapple_tf.trace.step_stats.step_allocation_peaks), for two equal stages at M=4, each stage in its own worker
task (tests/schedule_memory_probe.py). ZB-H1 keeps 1F1B's peak (the zero-bubble paper's claim, issue 21),
GPipe and ZB-H2 hold more."""

import json
import os
import subprocess
import sys

import pytest
from tensorflow.core.framework import step_stats_pb2

from dapple_tf.trace.step_stats import step_allocation_peaks
from tests.programs import ROOT
from tests.schedule_memory_probe import MICRO_BATCH, WIDTH

SCHEDULES = ("dapple", "zb-h1", "zb-h2", "gpipe")


@pytest.fixture(scope="module")
def peaks():
    """schedule -> rewrite ("clones", "functions") -> [stage 0 task, stage 1 task] peak bytes."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "tests.schedule_memory_probe", *SCHEDULES], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rewrite", ["clones", "functions"])
def test_zb_h1_keeps_the_1f1b_peak_and_gpipe_does_not(peaks, rewrite):
    by_schedule = {s: peaks[s][rewrite] for s in SCHEDULES}
    dapple, zb_h1, zb_h2 = by_schedule["dapple"], by_schedule["zb-h1"], by_schedule["zb-h2"]
    activation = 4 * 4 * MICRO_BATCH * WIDTH  # one layer's four tanh outputs for one micro-batch
    # The first stage's peaks are the same run to run (one inter-op thread per task; 20 runs of the probe in each
    # environment beside a test run). It has the highest peak (two micro-batches in flight); ZB-H1 runs 1F1B's
    # order there with each W right after its B, so its peak is 1F1B's, byte for byte.
    assert zb_h1[0] == dapple[0], by_schedule
    assert dapple[0] > dapple[1], by_schedule
    # ZB-H2's one more warm-up forward holds exactly a micro-batch of the first stage's two layers.
    assert zb_h2[0] - dapple[0] == 2 * activation, by_schedule
    # The last stage's deferred W keeps a micro-batch's saved activations a while longer: +256 KiB (one activation)
    # with cloned stages, +256 to +384 KiB with stage functions over those 40 runs. Its peaks move by up to 128 KiB
    # with when the first stage's activations (64 KiB each) arrive.
    assert zb_h1[1] - dapple[1] > activation / 2, by_schedule
    # GPipe holds all four micro-batches before its first backward.
    assert all(g > d + activation for g, d in zip(by_schedule["gpipe"], dapple)), by_schedule


def test_step_allocation_peaks_sum_records_in_time_order():
    stats = step_stats_pb2.StepStats()
    dev = stats.dev_stats.add(device="/device:CPU:0")
    for node_records in ([(10, 100), (40, -100)], [(20, 50), (30, -50)], [(35, 70)]):
        memory = dev.node_stats.add().memory.add()
        for micros, nbytes in node_records:
            memory.allocation_records.add(alloc_micros=micros, alloc_bytes=nbytes)
    stats.dev_stats.add(device="/device:CPU:1").node_stats.add()  # nothing allocated: left out
    # live: 100 at 10, 150 at 20, 100 at 30, 170 at 35, 70 at 40
    assert step_allocation_peaks(stats) == {"/device:CPU:0": 170}
