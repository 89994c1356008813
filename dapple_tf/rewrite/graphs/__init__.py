"""Reading and copying graphs: walks over a graph's operations (graph_walk.py), the GraphDefs of a set of operations
and their private copies (graph_defs.py), TF1 control flow in copies (v1_control_flow.py), values computed from the
batch's shape (shape_values.py), and variables taken as values (variable_reads.py).

The bottom of the rewrite: what it owns knows nothing of stages, batches or devices.
May import: no other rewrite package.
"""
