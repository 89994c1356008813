"""Every stage's forward and backward tasks per micro-batch and replica, as imported clones (stage_builder.py) or
calls of functions defined once (stage_function.py), and their order: the control edges of the schedule (tasks.py),
and the weight gradients batched over micro-batches for dapple-batched-w (weight_batching.py).

May import: graphs, batch, template, update, hosts.
stage_builder.py asks hosts/ what crosses to other tasks' graphs; no rewrite package imports this one but pipeline.py.
"""
