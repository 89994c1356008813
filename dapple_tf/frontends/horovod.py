"""The Horovod backend: each horovodrun process runs the pipeline over its own devices.

    hvd.init()
    pipeline = dapple_tf.frontends.horovod.HorovodPipeline(plan_proto_or_file)   # checks the plan's process count
    handle = pipeline.build(model_fn, features, labels, optimizer)       # this process's share of the batch
    hooks = [pipeline.broadcast_hook(handle)]                            # rank 0's variables, then the copies

Gradients are reduced hierarchically: within the process by TF collectives across the devices
holding each variable (as build_pipeline always does), then once per packed gradient buffer across
processes by one Horovod allreduce, pre-scaled by this process's share of the global batch (never
per variable copy). Initial (or restored) variables are broadcast from rank 0 with Horovod, and only
then are the copies set from them (handle.broadcast_op). Plans come from planner/planning/horovod_plan.py.
Horovod is imported here only (TF 2.15 environment): other modules never import this one.
"""

import dataclasses
from typing import Optional

import tensorflow as tf

from dapple_tf.rewrite.options import PipelineOptions
from dapple_tf.errors import DappleError, PlanError
from dapple_tf.rewrite.pipeline import build_pipeline
from dapple_tf.plan import Plan
from planner.planning import horovod_plan
from planner.formats import plan_pb2, read_message


def _hvd():
    import horovod.tensorflow as hvd

    return hvd


def cross_process_reduce(share: float):
    """A cross_process_reduce for build_pipeline: Sum over processes of buffer * share."""
    hvd = _hvd()
    counter = iter(range(1 << 30))

    def reduce(buffer: tf.Tensor) -> tf.Tensor:
        # Names match across processes because every process builds the same graph in the same order.
        return hvd.allreduce(buffer, op=hvd.Sum, prescale_factor=share, name=f"dapple_grads_{next(counter)}")

    return reduce


class HorovodPipeline:
    """A per-process plan checked against horovodrun's process count; builds and initializes the pipeline."""

    def __init__(self, plan):
        hvd = _hvd()
        if not hvd.is_initialized():
            raise PlanError("call horovod.tensorflow.init() before building a Horovod pipeline")
        proto = read_message(plan, plan_pb2.Plan) if isinstance(plan, str) else plan
        if not isinstance(proto, plan_pb2.Plan):
            raise PlanError("the Horovod backend needs the plan file or proto (it records the number of processes)")
        try:
            processes = horovod_plan.num_processes(proto)
        except horovod_plan.HorovodPlanError as e:
            raise PlanError(str(e)) from None
        if processes != hvd.size():
            raise PlanError(
                f"the plan is for {processes} Horovod process(es) but horovodrun started {hvd.size()}: plan with "
                f"dapple_plan --backend=horovod --num_processes={hvd.size()}"
            )
        self.plan = Plan.from_proto(proto, source=plan if isinstance(plan, str) else "plan")
        self.rank, self.size = hvd.rank(), hvd.size()

    def local_slice(self, global_batch):
        """This process's contiguous slice of a global batch (a nest of tensors with a known batch size)."""
        def cut(tensor):
            total = tf.compat.dimension_value(tensor.shape[0])
            if total is None or total % self.size:
                raise PlanError(f"the global batch ({total}) must be a known multiple of the {self.size} processes")
            share = total // self.size
            return tensor[self.rank * share:(self.rank + 1) * share]
        return tf.nest.map_structure(cut, global_batch)

    def build(self, model_fn, features, labels, optimizer, schedule: Optional[str] = None, global_step=None,
              global_batch_size: int = 0, batch_norm: str = "per_slice", layers=None,
              options: Optional[PipelineOptions] = None):
        """build_pipeline on this process's batch; gradients averaged over processes by batch share.
        batch_norm="sync" synchronizes a stage's replicas in this process only (statistics per process).
        options: a PipelineOptions instead of schedule and batch_norm (its cross_process_reduce is set here)."""
        local = int(tf.nest.flatten(features)[0].shape[0])
        share = local / (global_batch_size or local * self.size)
        if options is not None and (schedule is not None or batch_norm != "per_slice"):
            raise DappleError("give schedule and batch_norm in options=PipelineOptions(...), not beside it")
        options = options or PipelineOptions(schedule=schedule, batch_norm=batch_norm)
        return build_pipeline(model_fn, features, labels, optimizer, self.plan,
                              dataclasses.replace(options, cross_process_reduce=cross_process_reduce(share)),
                              global_step=global_step, layers=layers)

    def broadcast_hook(self, handle) -> tf.compat.v1.train.SessionRunHook:
        return _BroadcastHook(handle)


class _BroadcastHook(tf.compat.v1.train.SessionRunHook):
    """After init or restore: rank 0's global variables to every process, then the copies from them."""

    def __init__(self, handle):
        self._handle = handle

    def begin(self):
        self._broadcast = _hvd().broadcast_global_variables(0)

    def after_create_session(self, session, coord):
        session.run(self._broadcast)
        session.run(self._handle.broadcast_op)
