"""The planner's in-memory view of a layer cost profile (per-sample costs as plain lists), built from
a LayerCostProfile; PipeDream's graph-input nodes are kept in the layer list but cost nothing."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from planner.formats.memory_figures import kept_bytes_per_sample
from planner.formats.profile import LayerCostProfile, validate_profile

INPUT_PREFIX = "Input"


def is_input_node(description: str) -> bool:
    """PipeDream lists the graph's inputs as nodes described `Input`, `Input0`, ...: not layers."""
    text = description.strip()
    return text.startswith(INPUT_PREFIX) and (text == INPUT_PREFIX or text[len(INPUT_PREFIX):].isdigit())


def step_time_scale(profile: LayerCostProfile) -> float:
    """The factor that makes the layers' forward + backward times sum to the measured whole step
    (LayerCostProfile.step_ms: what layer-by-layer runs miss, shared caches and gradient accumulation);
    1 where the profile has no whole step (PipeDream's and the paper's profiles)."""
    layers_ms = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)
    return profile.step_ms / layers_ms if profile.step_ms > 0 and layers_ms > 0 else 1.0


@dataclasses.dataclass
class ModelProfile:
    """The planner's view of a profile: per-sample costs in topological order (plain lists).

    forward_ms/backward_ms/activation_bytes/kept_bytes are per sample (profile value / batch size; the
    times scaled by step_time_scale where the profiler measured a whole step);
    parameter_bytes per layer; consumers[i] = indices of layers consuming layer i;
    last_use[i] = the largest consumer index (or i when unused).
    Input nodes (is_input) stay in the layer list (plans name them) but cost nothing: no compute,
    no kept bytes, and their tensors cross no cut (the runtime feeds them to their consumers).
    kept_bytes: what each layer keeps for its backward (planner/formats/memory_figures.py); memory_source
    says where it came from ("step", "measured" or "lower_bound"). input_bytes: the model inputs a
    layer reads directly (the profile's input_bytes; an Input node's bytes go to its first consumer).
    working_bytes: per-sample backward working memory (the profile's backward_working_bytes; 0 when
    not measured), held once per stage (memory_model.stage_working_bytes).
    """

    name: str
    names: List[str]
    descriptions: List[str]
    forward_ms: List[float]
    backward_ms: List[float]
    activation_bytes: List[float]
    parameter_bytes: List[float]
    inputs: List[List[int]]
    last_use: List[int]
    kept_bytes: List[float] = dataclasses.field(default_factory=list)
    input_bytes: List[float] = dataclasses.field(default_factory=list)
    is_input: List[bool] = dataclasses.field(default_factory=list)
    working_bytes: List[float] = dataclasses.field(default_factory=list)
    memory_source: str = "lower_bound"
    # per sample: the part of backward_ms the input gradients need (LayerCost.backward_input_ms); empty when
    # the profile does not split the backward (then the whole backward precedes the input gradients)
    backward_input_ms: List[float] = dataclasses.field(default_factory=list)
    # how far the profile's whole step moved over its measurement rounds, relative (LayerCostProfile.relative_spread;
    # 0: unknown): plans whose simulated times differ by less are ties (planner/planning/ties.py)
    relative_spread: float = 0.0

    def __post_init__(self):
        if not self.is_input:
            self.is_input = [False] * len(self.names)
        if not self.kept_bytes:
            self.kept_bytes = list(self.activation_bytes)
        if not self.input_bytes:
            self.input_bytes = [0.0] * len(self.names)
        if not self.working_bytes:
            self.working_bytes = [0.0] * len(self.names)

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @classmethod
    def from_proto(cls, profile: LayerCostProfile, step_memory_bytes: Optional[float] = None) -> "ModelProfile":
        """`step_memory_bytes`: one training step's memory at the profile batch size (e.g. the
        paper's Table 1 figure); defaults to the profile's step_peak_bytes (0: none). The profiler's
        own step (step_peak_bytes with measured kept bytes; not a `.memory` side file's figure, which
        may be the paper's) is read in time (memory_figures.kept_bytes_per_sample)."""
        profile = validate_profile(profile)
        bs = float(profile.batch_size)
        layers = list(profile.layers)
        index = {layer.name: i for i, layer in enumerate(layers)}
        inputs = [[index[s] for s in layer.inputs] for layer in layers]
        is_input = [is_input_node(layer.description) and not layer.inputs for layer in layers]
        last_use = list(range(len(inputs)))
        for dst, srcs in enumerate(inputs):
            for s in srcs:
                last_use[s] = max(last_use[s], dst)
        # the profiler's own step: measured with the per-layer kept bytes (a side file's figure comes without)
        measured_step = (step_memory_bytes is None and profile.step_peak_bytes > 0
                         and any(layer.backward_kept_bytes > 0 for layer in layers))
        if step_memory_bytes is None and profile.step_peak_bytes > 0:
            step_memory_bytes = profile.step_peak_bytes
        params = [0.0 if inp else layer.parameter_bytes for layer, inp in zip(layers, is_input)]
        kept, source = kept_bytes_per_sample(
            [layer.activation_bytes for layer in layers], [layer.backward_kept_bytes for layer in layers],
            params, is_input, profile.batch_size, step_memory_bytes, profile.model_name or "model",
            [0.0 if inp else layer.backward_working_bytes for layer, inp in zip(layers, is_input)], measured_step)
        input_bytes = [layer.input_bytes / bs for layer in layers]
        for i, layer in enumerate(layers):
            if is_input[i]:
                consumers = [j for j, srcs in enumerate(inputs) if i in srcs]
                if consumers:
                    input_bytes[consumers[0]] += layer.activation_bytes / bs
        scale = step_time_scale(profile) / bs
        return cls(
            name=profile.model_name or "model",
            names=[layer.name for layer in layers],
            descriptions=[layer.description for layer in layers],
            forward_ms=[0.0 if inp else layer.forward_ms * scale for layer, inp in zip(layers, is_input)],
            backward_ms=[0.0 if inp else layer.backward_ms * scale for layer, inp in zip(layers, is_input)],
            activation_bytes=[layer.activation_bytes / bs for layer in layers],
            parameter_bytes=params,
            inputs=inputs,
            last_use=[i if inp else u for i, (u, inp) in enumerate(zip(last_use, is_input))],
            kept_bytes=kept,
            input_bytes=input_bytes,
            is_input=is_input,
            working_bytes=[0.0 if inp else layer.backward_working_bytes / bs for layer, inp in zip(layers, is_input)],
            memory_source=source,
            backward_input_ms=([0.0 if inp else layer.backward_input_ms * scale for layer, inp in zip(layers, is_input)]
                               if any(layer.backward_input_ms > 0 for layer in layers) else []),
            relative_spread=profile.relative_spread,
        )
