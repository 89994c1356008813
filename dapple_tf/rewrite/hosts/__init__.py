"""Per-host graphs (PipelineOptions.own_task): which devices this task builds and the queues to other tasks' graphs
(host_part.py), who reads whose activations at stage boundaries (host_boundaries.py, boundary_exchange.py), sums
over the tasks in one order (task_sums.py), a script's gradient transform on the loss's task (host_transform.py),
sync batch norm's sums through queues (host_sync_batch_norm.py), and the build in a scratch copy of the task's
graph, of which the task's graph receives only what its part reads (host_graph.py).

May import: graphs, batch, template, update.
host_boundaries.py pairs replicas by batch/microbatch.py's offsets, boundary_exchange.py reads the template's
boundaries, host_transform.py replays update/gradient_replay.py. Back-edges: batch and update import this package
too, for their per-host branches.
"""
