"""The lowering and per-host graphs (PipelineOptions.own_task): the pipeline program of a build lowered for one
graph's devices, every device's or one task's (lowering.py, the object the builders get; lowered_gradients.py, the
cluster's gradients as that graph reduces and transforms them), which devices a task builds and the queues to other
tasks' graphs (host_part.py) and their names (queue_names.py), stage boundaries in a per-host graph
(boundary_exchange.py: stages/boundaries.py's, with rows received from and sent to other tasks' replicas, gradient
pieces too), sums over the tasks in one order (task_sums.py), a per-host graph's gradients and its transforms on the
loss's task (host_transform.py), sync batch norm's sums through queues (host_sync_batch_norm.py), and the build in a
scratch copy of the task's graph, of which the task's graph receives only what its part reads (host_graph.py).
Only this package asks whether a device is this task's (tests/test_layout.py checks that the others do not).

May import: graphs, batch, template, update, stages.
boundary_exchange.py extends stages/boundaries.py and pairs replicas by the program's row pairing
(planner/formats/program.py), host_transform.py replays update/gradient_replay.py, host_sync_batch_norm.py sums
batch/sync_batch_norm.py's markers, lowering.py makes update/collectives.py's choices.
"""
