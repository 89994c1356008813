"""The layer profiler: measures a marked model layer by layer and writes a layer cost profile.

The profile schema is profiler/layer_cost.proto; its generated module is
planner.schemas.layer_cost_pb2 (re-exported here), since the planner reads it too.
"""

from planner.schemas import layer_cost_pb2  # noqa: F401
