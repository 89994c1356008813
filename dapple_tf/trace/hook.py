"""A SessionRunHook that traces one training step and writes its measured timeline.

`TraceHook(path, handle, at_step, simulated)` runs step `at_step` of a training run (counted from the
run's first step, so that graph optimization and warm-up are over) with FULL_TRACE and writes
- `path`: the measured per-device timeline as a Chrome trace (dapple_tf/trace/timeline.py: forward and
  backward boxes per micro-batch and stage, transfers, AllReduce, optimizer step);
- `path` with the suffix .png: the timeline drawn, above the simulator's timeline of the same plan
  when `simulated` (a planner SimulationResult) is given.
dapple_train's --trace and the Trainer's TrainerOptions.trace_path use it.
"""

import os
from typing import Optional

import tensorflow as tf

from dapple_tf.trace import timeline


def png_path(path: str) -> str:
    return os.path.splitext(path)[0] + ".png"


class TraceHook(tf.compat.v1.train.SessionRunHook):
    def __init__(self, path: str, handle, at_step: int = 5, simulated=None, log=print):
        self.path, self.handle, self.at_step, self.simulated, self.log = path, handle, max(1, at_step), simulated, log
        self._steps = 0
        self.written: Optional[str] = None

    def before_run(self, run_context):
        self._steps += 1
        if self._steps != self.at_step:
            return None
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                          output_partition_graphs=True)
        return tf.compat.v1.train.SessionRunArgs(fetches=None, options=options)

    def end(self, session):
        del session
        if self.written is None:
            self.log(f"no step traced: this run ran {self._steps} step(s), fewer than the step to trace "
                     f"({self.at_step}); nothing written to {self.path}")

    def after_run(self, run_context, run_values):
        if self._steps != self.at_step:
            return
        self.write(timeline.measured_timeline(run_values.run_metadata, self.handle))

    def write(self, measured) -> None:
        """The measured timeline as a Chrome trace at `path`, and drawn (beside the simulated one if given)."""
        timeline.write_measured_trace(measured, self.path)
        picture = png_path(self.path)
        if self.simulated is not None:
            timeline.draw_measured_vs_simulated(measured, self.simulated, picture)
            versus = f"; simulated {self.simulated.iteration_ms:.1f} ms"
        else:
            timeline.gantt_lib.draw_gantt(measured, picture, titles=[f"measured: {measured.iteration_ms:.1f} ms"],
                                          memory=False)
            versus = ""
        self.written = self.path
        self.log(f"traced step {self._steps} of this run: measured {measured.iteration_ms:.1f} ms{versus}; "
                 f"wrote {self.path} (Chrome trace) and {picture}")
