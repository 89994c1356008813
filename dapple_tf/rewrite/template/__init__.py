"""The user's model traced once and cut into stages (template.py, template_devices.py: its placement), the plan
resolved against it (layout.py: PipelineLayout, what the later passes read of the plan), its extra outputs
(outputs.py) and summaries (summaries.py), re-computation's choice and its recomputed clones (recompute.py), and
the warning for random ops (random_ops.py).

May import: graphs, batch.
"""
