"""Protobuf schemas (generated code) and reading/writing them as .pb, .pbtxt or .json.

`layer_cost_pb2` is compiled from profiler/layer_cost.proto, `plan_pb2` from planner/plan.proto,
by scripts/gen_protos.py. No TensorFlow here.
"""

from planner.schemas import layer_cost_pb2, plan_pb2
from planner.schemas.io import SchemaError, read_message, write_message

__all__ = ["layer_cost_pb2", "plan_pb2", "SchemaError", "read_message", "write_message"]
