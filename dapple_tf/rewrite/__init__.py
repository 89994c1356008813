"""The rewrite: from a user's single-device model and a plan to a DAPPLE pipelined graph.

Its modules sit in sub-packages by concern, each `__init__.py` saying what it owns and which others it may import:
graphs/ (reading and copying graphs), batch/ (the batch axis, micro-batches, batch statistics), template/ (the model
traced once and cut into stages, the plan resolved against it), stages/ (every stage's tasks and their order),
update/ (gradients, their reductions and transforms, variable copies, the apply step), hosts/ (per-host graphs);
here only pipeline.py (build_pipeline) and options.py (PipelineOptions).

`pipeline.build_pipeline` runs the passes in this order (paper section 5):
1. template (template/template.py, template/layout.py, batch/batch_axis.py, template/template_devices.py): the
   model built once on placeholders, cut into stages by its layers, each boundary tensor's batch axis found
   (time-major ones too), what a stage computes from the inputs alone computed again there; the plan resolved
   against it (layout.PipelineLayout) is what the later passes read of the plan;
2. forward (stages/stage_builder.py, graphs/graph_defs.py, stages/stage_function.py, graphs/variable_reads.py,
   template/recompute.py): each stage per micro-batch and replica, as imported clones or as calls of functions
   defined once;
3. split/concat (stages/boundaries.py, batch/microbatch.py, update/replicas.py): slices of the batch and of activations between stages of
   different replication, and a copy of each variable on every device that reads it;
4. backward (stages/stage_builder.py, stages/tasks.py): per stage in reverse, gradients of each clone or function
   call, split into input gradients (B) and weight gradients (W);
5. order (stages/tasks.py, stages/weight_batching.py): control edges that make each device run its tasks in the
   schedule's order (for dapple-batched-w, after stacking each stage's weight gradients over its micro-batches);
6. gradients and AllReduce (update/gradients.py, update/collectives.py, update/halving_exchange.py): accumulation
   over micro-batches, then sums across the replicas in buckets;
7. apply (update/gradient_transforms.py, update/gradient_replay.py, update/loss_scaling.py, update/apply_step.py,
   pipeline.py, update/replicas.py, batch/batch_norm.py, template/summaries.py): a script's loss scale in each
   clone's seed (step 4), clipping and the gradient function (or the script's own transform, replayed), the
   optimizer's step on every copy, UPDATE_OPS once per step, the model's summaries built again on the pipeline.
The passes build for the devices the lowering lists: the pipeline program of the layout (planner.formats.program,
plain data) lowered for this graph (hosts/lowering.py), every device's (one graph) or one task's (per-host graphs,
PipelineOptions.own_task). Only the lowering and hosts/ ask whether a device is this task's: what crosses to other
tasks' graphs goes in shared queues (hosts/host_part.py, hosts/queue_names.py; the stage boundaries of
stages/boundaries.py extended in hosts/boundary_exchange.py); sums over the tasks in one order (hosts/task_sums.py);
the gradients as a graph reduces and transforms them (hosts/lowered_gradients.py), in a per-host graph with the
transforms that see every gradient replayed on the loss's task (hosts/host_transform.py); sync batch norm's sums over CPU replicas through queues (hosts/host_sync_batch_norm.py);
built in a scratch copy of the task's graph, of which the task's graph receives only what its part reads
(hosts/host_graph.py).
Analyses the passes consult: batch/normalization.py and batch/sync_batch_norm.py (batch statistics),
template/random_ops.py, template/outputs.py (extra outputs), graphs/graph_walk.py.
"""
