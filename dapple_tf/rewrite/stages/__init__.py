"""Every stage's forward and backward tasks per micro-batch and replica, as imported clones (stage_builder.py) or
calls of functions defined once (stage_function.py), the stage boundaries between them (boundaries.py: rows gathered
from producer replicas, gradient pieces cut for them and summed), and their order: the control edges of the
schedule (tasks.py), and the weight gradients batched over micro-batches for dapple-batched-w (weight_batching.py).

May import: graphs, batch, template, update.
stage_builder.py builds the replicas the lowering lists (hosts/lowering.py, passed in: the program's, with their
slices) and takes from it the stage boundaries it builds (boundaries.py's, or a per-host graph's, which sends and
receives what crosses to other tasks), the loss's sum over the tasks and sync batch norm's sums through queues: it
imports nothing of hosts/. Imported by pipeline.py, and boundaries.py by hosts/ (which extends it).
"""
