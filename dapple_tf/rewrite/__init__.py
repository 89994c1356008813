"""The rewrite: from a user's single-device model and a plan to a DAPPLE pipelined graph.

`pipeline.build_pipeline` runs the passes in this order (paper section 5):
1. template (template.py, layout.py, batch_axis.py, template_devices.py): the model built once on placeholders,
   cut into stages by its layers, each boundary tensor's batch axis found (time-major ones too), what a stage
   computes from the inputs alone computed again there; the plan resolved against it (layout.PipelineLayout) is
   what the later passes read of the plan;
2. forward (stage_builder.py, graph_defs.py, stage_function.py, variable_reads.py, recompute.py): each stage
   per micro-batch and replica, as imported clones or as calls of functions defined once;
3. split/concat (microbatch.py, replicas.py): slices of the batch and of activations between stages of
   different replication, and a copy of each variable on every device that reads it;
4. backward (stage_builder.py, tasks.py): per stage in reverse, gradients of each clone or function call,
   split into input gradients (B) and weight gradients (W);
5. order (tasks.py, weight_batching.py): control edges that make each device run its tasks in the schedule's
   order (for dapple-batched-w, after stacking each stage's weight gradients over its micro-batches);
6. gradients and AllReduce (gradients.py, collectives.py, halving_exchange.py): accumulation over micro-batches, then sums
   across the replicas in buckets;
7. apply (gradient_transforms.py, gradient_replay.py, loss_scaling.py, apply_step.py, pipeline.py, replicas.py,
   batch_norm.py, summaries.py): a script's loss scale in each clone's seed (step 4), clipping and the gradient function (or the script's own transform, replayed), the optimizer's
   step on every copy, UPDATE_OPS once per step, the model's summaries built again on the pipeline.
Per-host graphs (PipelineOptions.own_task): the same passes over one task's devices, with what crosses to other
tasks' graphs in shared queues (host_part.py, host_boundaries.py, boundary_exchange.py); sums over the tasks in one
order (task_sums.py); a script's own gradient transform replayed on the loss's task (host_transform.py); sync batch
norm's sums over CPU replicas through queues (host_sync_batch_norm.py); built in a scratch copy of the task's graph,
of which the task's graph receives only what its part reads (host_graph.py).
Analyses the passes consult: normalization.py and sync_batch_norm.py (batch statistics), random_ops.py,
outputs.py (extra outputs), graph_walk.py.
"""
