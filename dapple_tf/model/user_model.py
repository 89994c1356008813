"""A user's own model for the command-line programs (dapple_profile, dapple_train):
`--model_fn=package.module:function`, its inputs and its layers.

model_fn(features, labels) -> loss (or (loss, {name: tensor})), layers marked with dapple_tf.layer or
cut by `--scope_depth` / `--scope_patterns` (dapple_tf.layers_by_scope; `define_scope_flags` defines
both flags for both programs). Inputs: `--input_fn=package.module:function`, the contract of
dapple_tf/model/inputs.py: input_fn(step, batch_size) -> (features, labels), numpy arrays or tensors
(nests allowed; dapple_profile also takes the older input_fn(batch_size)), or, for dapple_profile,
`--features=DTYPE:SHAPE` / `--labels=DTYPE:SHAPE[:MAX]` (e.g. float32:32,32,3 and int32::10): random
values of one sample's shape, integers in [0, MAX).
"""

import importlib
import os
import sys

import numpy as np

from absl import flags


def load_function(spec: str, flag: str):
    """`package.module:function` -> the function (ValueError naming the flag otherwise; for a module that
    cannot be imported, which module and how to make it importable)."""
    module_name, sep, name = (spec or "").partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"--{flag}={spec}: expected package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:  # console scripts do not search the current directory
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and module_name != missing and not module_name.startswith(missing + "."):
            # the module was found but fails to import something of its own
            raise ValueError(f"--{flag}={spec}: importing {module_name} failed: {e}") from None
        raise ValueError(
            f"--{flag}={spec}: cannot import {module_name} ({e}). Python looks for it in the current directory "
            f"({os.getcwd()}) and on PYTHONPATH ({os.environ.get('PYTHONPATH') or 'not set'}): run from the folder "
            f"that holds {module_name.split('.')[0]}/ or {module_name.split('.')[0]}.py, or add that folder to "
            "PYTHONPATH (export PYTHONPATH=/path/to/folder)") from None
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
    """(features, labels) numpy values of one batch (step 0), from input_fn or the --features/--labels specs."""
    if input_fn is not None:
        from dapple_tf.model import inputs  # pylint: disable=import-outside-toplevel

        return inputs.batch_values(input_fn, 0, batch_size, legacy="batch_size")
    if not features or not labels:
        raise ValueError("--model_fn needs --input_fn, or both --features and --labels")
    rng = np.random.RandomState(seed)
    return _random_values(features, "features", batch_size, rng), _random_values(labels, "labels", batch_size, rng)


def placeholders_like(values):
    """tf.compat.v1 placeholders of the values' dtypes and shapes (same nest)."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda v: tf.compat.v1.placeholder(tf.as_dtype(np.asarray(v).dtype), np.shape(v)),
                                 values)


def define_scope_flags():
    """--scope_depth and --scope_patterns (once per process: dapple_profile and dapple_train share them)."""
    if "scope_depth" in flags.FLAGS:
        return
    flags.DEFINE_integer("scope_depth", None, "Layers = the model's name scopes at this depth "
                         "(dapple_tf.layers_by_scope; e.g. 1 for Keras layers called in model_fn).")
    flags.DEFINE_list("scope_patterns", None, "Layers = the name scopes matching these patterns "
                      "(dapple_tf.layers_by_scope).")


def scope_layers(depth: int = None, patterns=None):
    """dapple_tf.layers_by_scope for --scope_depth / --scope_patterns, or None (markers)."""
    if depth is None and not patterns:
        return None
    import dapple_tf  # pylint: disable=import-outside-toplevel

    return dapple_tf.layers_by_scope(depth=depth, patterns=patterns or None)
