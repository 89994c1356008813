"""Gradients and the step that applies them: accumulation over micro-batches (gradients.py; gradient_kinds.py: which
variables get gradients of gathered rows), the sums across replicas (collectives.py, halving_exchange.py), the
transforms between the AllReduce and the apply step (gradient_transforms.py: clipping and gradient_fn;
gradient_replay.py: a script's own transform; loss_scaling.py), the copies of variables on every device that reads
them (replicas.py), and the optimizer's step on every copy (apply_step.py).

May import: graphs, batch, hosts.
collectives.py cuts pieces by batch/microbatch.py's slice sizes. hosts is a back-edge, for today's per-host branches
(host_part.py, task_sums.py, host_boundaries.py, host_transform.py), while hosts/host_transform.py imports
update/gradient_replay.py.
"""
