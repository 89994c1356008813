"""A user's own model for the command-line programs: `--model_fn=package.module:function` and its inputs.

model_fn(features, labels) -> loss (or (loss, {name: tensor})), layers marked with dapple_tf.layer or
cut by `--scope_depth` / `--scope_patterns` (dapple_tf.layers_by_scope). Inputs: `--input_fn=
package.module:function`, called as input_fn(batch_size) -> (features, labels) numpy values (nests
allowed), or `--features=DTYPE:SHAPE` / `--labels=DTYPE:SHAPE[:MAX]` (e.g. float32:32,32,3 and
int32::10): random values of one sample's shape, integers in [0, MAX).
"""

import importlib

import numpy as np


def load_function(spec: str, flag: str):
    """`package.module:function` -> the function (ValueError naming the flag otherwise)."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"--{flag}={spec}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--{flag}={spec}: cannot import {module_name}: {e}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--{flag}={spec}: {module_name} has no function {name!r}")
    return function


def _random_values(spec: str, flag: str, batch_size: int, rng):
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"--{flag}={spec}: expected DTYPE:SHAPE[:MAX], e.g. float32:32,32,3 or int32::10")
    try:
        dtype = np.dtype(parts[0])
        shape = [int(d) for d in parts[1].split(",") if d.strip()]
        high = int(parts[2]) if len(parts) == 3 else 2
    except (TypeError, ValueError) as e:
        raise ValueError(f"--{flag}={spec}: {e}") from None
    full = [batch_size] + shape
    if np.issubdtype(dtype, np.integer):
        return rng.randint(0, high, size=full).astype(dtype)
    return rng.standard_normal(full).astype(dtype)


def input_values(batch_size: int, input_fn=None, features=None, labels=None, seed=0):
    """(features, labels) numpy values of one batch, from input_fn or the --features/--labels specs."""
    if input_fn is not None:
        return input_fn(batch_size)
    if not features or not labels:
        raise ValueError("--model_fn needs --input_fn, or both --features and --labels")
    rng = np.random.RandomState(seed)
    return _random_values(features, "features", batch_size, rng), _random_values(labels, "labels", batch_size, rng)


def placeholders_like(values):
    """tf.compat.v1 placeholders of the values' dtypes and shapes (same nest)."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda v: tf.compat.v1.placeholder(tf.as_dtype(np.asarray(v).dtype), np.shape(v)),
                                 values)


def scope_layers(depth: int = None, patterns=None):
    """dapple_tf.layers_by_scope for --scope_depth / --scope_patterns, or None (markers)."""
    if depth is None and not patterns:
        return None
    import dapple_tf

    return dapple_tf.layers_by_scope(depth=depth, patterns=patterns or None)
