"""The layer profiler: measures a marked model layer by layer and writes a layer cost profile.

    profile = profiler.profile_model(model_fn, make_inputs, input_values, batch_size, "/device:CPU:0")
    profiler.write_profile(profile, "mlp-pbs-32.txt")     # or .pb / .pbtxt / .json
    profile = profiler.read_profile("vgg-19-pbs-32.txt")

`profile_spec` profiles a registered reference model (models.get_model). The method is described in
profiler/core.py. The profile schema is planner/formats/layer_cost.proto; its generated module is
planner.formats.layer_cost_pb2 (re-exported here), since the planner reads it too.
"""

from planner.formats import layer_cost_pb2  # noqa: F401
from profiler.core import profile_model, session_config
from profiler.io import format_pipedream, read_profile, write_profile


def profile_spec(spec, batch_size, device="/device:CPU:0", **kwargs):
    """profile_model for a models.ModelSpec, fed its synthetic batch (seeded by kwargs' `seed`)."""
    values = spec.synthetic_batch(batch_size, seed=kwargs.get("seed", 0))
    kwargs.setdefault("model_name", spec.name)
    return profile_model(spec.model_fn, lambda: spec.placeholders(batch_size), values, batch_size, device, **kwargs)


__all__ = ["layer_cost_pb2", "profile_model", "profile_spec", "session_config", "read_profile",
           "write_profile", "format_pipedream"]
