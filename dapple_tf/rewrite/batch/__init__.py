"""The batch axis: which axes carry the samples (normalization.py for batch statistics, batch_axis.py for boundary
tensors, time-major ones too; sample_rows.py for row blocks), how the batch is cut into micro-batches and slices and
slices move between stages (microbatch.py), and the batch statistics: batch norm's UPDATE_OPS once per step
(batch_norm.py) and sync batch norm's rewrite of a stage's GraphDef (sync_batch_norm.py).

May import: graphs, template.
Back-edge (template imports this package too): batch_norm.py combines its statistics as template/outputs.py's
extra outputs. sync_batch_norm.py's markers (hint QUEUES) are what hosts/host_sync_batch_norm.py sums through queues.
"""
