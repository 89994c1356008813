"""`dapple_tf.PipelineOptions`: how build_pipeline builds the graph, beyond what the plan says.

Every field has a default that suits most models; the plan decides the stages, devices, M and, unless
`schedule` is given, the schedule.
"""

import dataclasses
from typing import Callable, Optional, Sequence, Union

from dapple_tf.errors import DappleError, PlanError
from dapple_tf.rewrite.batch.batch_norm import MODES as BATCH_NORM_MODES
from planner.formats.schedule import SCHEDULE_KINDS


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Tuning of the rewrite. Fields:

    schedule: "dapple" (early backward, 1F1B), "gpipe", "zb-h1" or "zb-h2" (zero bubble), "interleaved" (1F1B
        with virtual stages: a plan whose stages share devices round-robin); None: the plan's, else
        "interleaved" where stages share devices and "dapple" otherwise.
    recompute: re-computation (GPipe's re-materialization, recompute.py): True, False or a list of stage
        indices; None: the plan's choice, else none.
    batch_norm: "per_slice" (each replica's slice of a micro-batch normalized with its own statistics) or
        "sync" (a replicated stage's batch norms use the whole micro-batch's statistics: sync_batch_norm.py;
        per-sample normalizations such as LayerNormalization are told apart: normalization.py).
    allreduce_bucket_bytes: gradients are all-reduced in buckets of at least this many bytes, last layers
        first, overlapping the last micro-batch's backward; None: 25 MiB (planner.formats.constants
        ALLREDUCE_BUCKET_BYTES, what the planner's cost model assumes); 0: one bucket per variable.
    stage_functions: True builds each stage once, as functions called per micro-batch and replica
        (stage_function.py; a stage it does not cover is imported per clone: PipelineHandle.function_fallbacks):
        the graph and the first step no longer grow with the model's ops times M. False imports every stage per
        micro-batch and replica. None: functions when the clones would be large (stage_function.use_functions).
    traced_functions: stage functions are called so that a traced step (RunOptions FULL_TRACE) records their
        bodies' operations (per-operation timelines and memory peaks): PartitionedCall ops, which step slower
        (run them with PipelineHandle.session_config). False: RemoteCall ops on their own device where it is a
        CPU, whose traces show each call as one operation; PartitionedCall on GPUs (stage_function.py).
    cross_process_reduce: sums gradients across processes after the in-process AllReduce
        (gradients.reduce_and_pair; dapple_tf.frontends.horovod passes it).
    input_gradients_first: inside each backward task of schedules dapple, gpipe and interleaved, the
        operations the previous stage waits for run before those only the weight gradients need
        (tasks.input_gradients_first). False leaves each backward in TensorFlow's own order, as DAPPLE's
        runtime did: the baseline the zero-bubble schedules are measured against (stages cloned per
        micro-batch only: a stage function's backward is a B call, then a W call).
    clip_global_norm: clip the full-batch gradients (accumulated over micro-batches, summed over replicas) by
        their global norm over every stage's variables before the apply step, as
        `tf.clip_by_global_norm(tf.gradients(loss, tvars), c)` does on one device (gradient_transforms.py);
        PipelineHandle.global_norm is the norm before clipping. None: no clipping.
    gradient_fn: fn([(gradient, variable)]) -> [(gradient, variable)], run once per step on the full-batch
        gradients of the user's variables (after clipping), for what a script does between its gradients and
        apply_gradients (per-variable scaling, clipping by value, noise); it must return each variable it got.
    own_task: build only this task's part of the pipeline (per-host graphs, hosts/lowering.py): every task of the
        cluster runs the same program with its own task ("/job:worker/replica:0/task:1") and a session on its own
        server; tensors between tasks go through shared queues. None: one graph for every device of the plan.
    whole_template: with own_task, keep every task's layers in this task's graph (the model as traced once, which
        evaluating model_fn again on this task reads); False: only what this task's part reads (host_graph.py).
    """

    schedule: Optional[str] = None
    recompute: Union[None, bool, Sequence[int]] = None
    batch_norm: str = "per_slice"
    allreduce_bucket_bytes: Optional[int] = None
    stage_functions: Optional[bool] = None
    traced_functions: bool = False
    cross_process_reduce: Optional[Callable] = None
    input_gradients_first: bool = True
    clip_global_norm: Optional[float] = None
    gradient_fn: Optional[Callable] = None
    own_task: Optional[str] = None
    whole_template: bool = False

    def __post_init__(self):
        if self.clip_global_norm is not None and not (isinstance(self.clip_global_norm, (int, float))
                                                      and self.clip_global_norm > 0):
            raise DappleError(f"clip_global_norm must be a number > 0, got {self.clip_global_norm!r}")
        if self.gradient_fn is not None and not callable(self.gradient_fn):
            raise DappleError(f"gradient_fn must be a function of [(gradient, variable)], got {self.gradient_fn!r}")
        if self.batch_norm not in BATCH_NORM_MODES:
            raise DappleError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {self.batch_norm!r}")
        if self.schedule is not None and self.schedule not in SCHEDULE_KINDS:
            raise PlanError(f"unknown schedule {self.schedule!r}; expected one of {SCHEDULE_KINDS}")
        if self.allreduce_bucket_bytes is not None and self.allreduce_bucket_bytes < 0:
            raise DappleError(f"allreduce_bucket_bytes must be >= 0, got {self.allreduce_bucket_bytes}")
