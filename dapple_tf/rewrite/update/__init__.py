"""Gradients and the step that applies them: accumulation over micro-batches (gradients.py; gradient_kinds.py: which
variables get gradients of gathered rows), the sums across replicas (collectives.py, halving_exchange.py), the
transforms between the AllReduce and the apply step (gradient_transforms.py: clipping and gradient_fn;
gradient_replay.py: a script's own transform; loss_scaling.py), the copies of variables on every device that reads
them (replicas.py), and the optimizer's step on every copy (apply_step.py).

May import: graphs, batch.
collectives.py cuts pieces by the program's slice sizes (planner/formats/program.py). Which devices a graph builds, the means of each
reduction, the exchange's transfers and the sums over tasks come from the lowering passed in (hosts/lowering.py,
which imports this package): nothing here asks whether a device is this task's.
"""
