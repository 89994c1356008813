"""`ModelSpec`: what the registry knows about a reference model.

The model contract (shared with the profiler and the graph runtime): `model_fn(features, labels) -> loss`,
a scalar mean over the batch produced inside the last `dapple_tf.layer` marker; every op computing from
features/labels lives in some marker; markers are opened in order and never nested. Features and labels
are a tensor or a dict of tensors whose first dimension is the batch.
"""

import dataclasses
from typing import Any, Callable, Dict, Optional

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """Shape (without the batch dimension), dtype and the value range of synthetic data for one input."""
    shape: tuple
    dtype: Any
    high: int = 0  # > 0: integers in [0, high); 0: standard normal floats


@dataclasses.dataclass
class ModelSpec:
    """A reference model at one config: its `model_fn`, its inputs and synthetic data."""
    name: str
    config: Dict[str, Any]
    model_fn: Callable
    feature_spec: Any  # an InputSpec or a dict name -> InputSpec
    label_spec: Any
    predict_fn: Optional[Callable] = None  # features -> logits, same layers and variable names


    def placeholders(self, batch_size):
        """(features, labels) placeholders of the given batch size (structure as the specs)."""
        def make(spec, name):
            return tf.compat.v1.placeholder(spec.dtype, [batch_size] + list(spec.shape), name=name)
        return _map(self.feature_spec, make, "features"), _map(self.label_spec, make, "labels")

    def synthetic_batch(self, batch_size, seed=0):
        """(features, labels) numpy arrays of the given batch size (structure as the specs)."""
        rng = np.random.default_rng(seed)

        def make(spec, name):
            del name
            shape = [batch_size] + list(spec.shape)
            if spec.high:
                return rng.integers(0, spec.high, size=shape).astype(tf.as_dtype(spec.dtype).as_numpy_dtype)
            return rng.standard_normal(shape).astype(tf.as_dtype(spec.dtype).as_numpy_dtype)
        return _map(self.feature_spec, make, "features"), _map(self.label_spec, make, "labels")

    def step_input_fn(self, batch_size, seed=0):
        """An input_fn(step) for dapple_tf.Trainer: synthetic (features, labels) tensors computed in the
        graph from (seed, step) alone, so a resumed run sees the batches an uninterrupted one would."""
        def input_fn(step):
            step = tf.cast(step, tf.int64)
            counter = iter(range(1, 1 << 20))

            def make(spec, name):
                del name
                key = tf.stack([tf.constant(seed * 1000 + next(counter), tf.int64), step])
                shape = [batch_size] + list(spec.shape)
                if spec.high:
                    value = tf.random.stateless_uniform(shape, key, minval=0, maxval=spec.high, dtype=tf.int64)
                    return tf.cast(value, spec.dtype)
                return tf.cast(tf.random.stateless_normal(shape, key), spec.dtype)
            return _map(self.feature_spec, make, "features"), _map(self.label_spec, make, "labels")
        return input_fn

    def feed_dict(self, placeholders, values):
        """Pairs placeholders with values of the same structure."""
        return dict(zip(tf.nest.flatten(placeholders), tf.nest.flatten(values)))


def _map(spec, fn, prefix):
    if isinstance(spec, dict):
        return {k: fn(v, f"{prefix}_{k}") for k, v in sorted(spec.items())}
    return fn(spec, prefix)


def resolve_config(presets, config, overrides):
    """`presets[config]` updated with `overrides`; unknown config names or keys raise ValueError."""
    if config not in presets:
        raise ValueError(f"unknown config {config!r}; expected one of {', '.join(sorted(presets))}")
    resolved = dict(presets[config])
    for key, value in overrides.items():
        if key not in resolved:
            raise ValueError(f"unknown model flag {key!r}; this model takes {', '.join(sorted(resolved))}")
        default = resolved[key]
        try:
            if isinstance(default, (list, tuple)) and isinstance(value, str):
                value = [int(v) for v in value.replace(";", ":").split(":") if v]
            elif isinstance(default, bool) and isinstance(value, str):
                value = value.lower() in ("1", "true", "yes")
            elif isinstance(default, (int, float)) and not isinstance(default, bool):
                value = type(default)(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model flag {key}={value!r}: expected a value like {default!r}") from e
        resolved[key] = value
    return resolved


def image_classifier(name, cfg, build):
    """The ModelSpec of an NHWC image classifier whose `build(features, labels, cfg)` returns
    (logits, loss or None)."""
    size = cfg["image_size"]
    return ModelSpec(
        name, cfg,
        model_fn=lambda features, labels: build(features, labels, cfg)[1],
        feature_spec=InputSpec((size, size, 3), tf.float32),
        label_spec=InputSpec((), tf.int32, high=cfg["num_classes"]),
        predict_fn=lambda features: build(features, None, cfg)[0],
    )
