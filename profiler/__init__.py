"""The layer profiler: measures a marked model layer by layer and writes a layer cost profile.

    profile = profiler.profile_model(model_fn, make_inputs, input_values, batch_size, "/device:CPU:0")
    profiles = profiler.profile_specs(models.get_model("mlp"), [64, 256])   # side by side, {batch: profile}
    profiler.write_profile(profile, "mlp-pbs-32.txt")     # or .pb / .pbtxt / .json
    profile = profiler.read_profile("vgg-19-pbs-32.txt")

`profile_spec` profiles a registered reference model (models.get_model). The method is described in
profiler/core.py. The profile schema is planner/formats/layer_cost.proto; its generated module is
planner.formats.layer_cost_pb2 (re-exported here), since the planner reads it too.
"""

from planner.formats import layer_cost_pb2  # noqa: F401
from profiler.core import profile_model, profile_models, session_config
from profiler.io import format_pipedream, read_profile, write_profile


def profile_spec(spec, batch_size, device="/device:CPU:0", **kwargs):
    """profile_model for a models.ModelSpec, fed its synthetic batch (seeded by kwargs' `seed`)."""
    return profile_specs(spec, [batch_size], device, **kwargs)[batch_size]


def profile_specs(spec, batch_sizes, device="/device:CPU:0", **kwargs):
    """profile_models for a models.ModelSpec at several batch sizes side by side, fed its synthetic batches."""
    seed = kwargs.get("seed", 0)
    kwargs.setdefault("model_name", spec.name)
    inputs = {size: ((lambda size=size: spec.placeholders(size)), spec.synthetic_batch(size, seed=seed))
              for size in batch_sizes}
    return profile_models(spec.model_fn, inputs, device, **kwargs)


__all__ = ["layer_cost_pb2", "profile_model", "profile_models", "profile_spec", "profile_specs", "session_config",
           "read_profile",
           "write_profile", "format_pipedream"]
