"""Every stage's forward and backward tasks per micro-batch and replica, as imported clones (stage_builder.py) or
calls of functions defined once (stage_function.py), and their order: the control edges of the schedule (tasks.py),
and the weight gradients batched over micro-batches for dapple-batched-w (weight_batching.py).

May import: graphs, batch, template, update, hosts.
stage_builder.py builds the devices the lowering lists (hosts/lowering.py) and routes what crosses to other tasks'
graphs through hosts/ (boundary_exchange.py, task_sums.py); no rewrite package imports this one but pipeline.py.
"""
