"""Every stage's forward and backward tasks per micro-batch and replica, as imported clones (stage_builder.py) or
calls of functions defined once (stage_function.py), and their order: the control edges of the schedule (tasks.py),
and the weight gradients batched over micro-batches for dapple-batched-w (weight_batching.py).

May import: graphs, batch, template, update, hosts.
stage_builder.py builds the replicas the lowering lists (hosts/lowering.py: the program's, with their slices) and
leaves what crosses stage boundaries to hosts/boundary_exchange.py (rows gathered or received, gradient pieces kept
or sent) and the loss's sum over tasks to hosts/task_sums.py; no rewrite package imports this one but pipeline.py.
"""
