"""One `input_fn` contract for dapple_profile, dapple_train, dapple_tf.Trainer and tf.estimator.

    def input_fn(step, batch_size):
        return features, labels

returns the global batch for training step `step`: `batch_size` (a Python int) samples, features
and labels each a numpy array, a tensor, or a nest (dict, tuple) of them, the batch leading.
`step` is a Python int or an int64 scalar tensor; a function of the step alone makes a resumed run
see the batches an uninterrupted one would. Two kinds of input_fn follow from what it returns for a
Python int step (it is called once with step=0, in a scratch graph, to find out; a function that
fails on an int is tried with a step tensor):

- **tensors** (TF ops on `step`: `tf.random.stateless_normal(..., seed=[7, step])`, a table
  lookup): called once more with the step tensor; the graph computes each step's batch.
- **numpy arrays**: called for every step with the step as a Python int, through
  `tf.numpy_function` (so in the process that runs the session: one process or Horovod; on a TF
  cluster (dapple_launch) return tensors). Every step's arrays must have the dtypes and shapes of
  step 0's.

Older forms taking one argument still work where they were accepted: `input_fn(batch_size)`
(dapple_profile) and `input_fn(step)` (dapple_tf.Trainer): a function with one required positional
parameter, unless its second positional parameter is named `batch_size` (`input_fn(step,
batch_size=32)` is the contract's form). Every leaf must lead with `batch_size` samples (an error
otherwise: a profile labelled with one batch size but measured at another would be wrong). For tf.estimator, `estimator_input_fn`
wraps such a function into an Estimator input_fn (step = the global step).
"""

import inspect
from typing import Optional

import numpy as np
import tensorflow as tf

from dapple_tf.errors import DappleError

CONTRACT = ("input_fn(step, batch_size) -> (features, labels): the global batch of `step` as numpy arrays or "
            "tensors (dapple_tf/model/inputs.py)")
LEGACY = ("step", "batch_size")


def _takes_one_argument(input_fn) -> bool:
    """True for the older one-argument forms: one required positional parameter, and no second positional
    parameter named `batch_size` (`input_fn(step, batch_size=32)` takes the contract's two arguments)."""
    try:
        parameters = list(inspect.signature(input_fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return False
    positional = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(positional) > 1 and positional[1].name == "batch_size":
        return False
    return sum(p.default is p.empty for p in positional) == 1


def call(input_fn, step, batch_size: Optional[int], legacy: Optional[str] = None):
    """input_fn's raw result for `step`; `legacy` ("step" or "batch_size"): what a one-argument
    function receives."""
    if legacy not in (None,) + LEGACY:
        raise ValueError(f"legacy must be None, 'step' or 'batch_size', got {legacy!r}")
    if legacy and _takes_one_argument(input_fn):
        return input_fn(step if legacy == "step" else batch_size)
    if batch_size is None:
        raise DappleError(f"{describe(input_fn)} takes (step, batch_size) but no global batch size is known here: "
                          "pass batch_size= (or a plan with its global_batch_size)")
    return input_fn(step, batch_size)


def describe(input_fn) -> str:
    return f"input_fn {getattr(input_fn, '__qualname__', repr(input_fn))}"


def _pair(result, input_fn):
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise DappleError(f"{describe(input_fn)} returned {type(result).__name__}; expected {CONTRACT}")
    return tuple(result)


def _check_batch_size(leaves, batch_size: Optional[int], input_fn, step) -> None:
    """Every leaf leads with `batch_size` samples (where both are known)."""
    if batch_size is None:
        return
    for i, value in enumerate(leaves):
        if value is None:
            continue
        shape = tf.TensorShape(value.shape) if hasattr(value, "shape") else tf.TensorShape(np.shape(value))
        leading = shape[0] if shape.rank else None
        if leading is not None and leading != batch_size:
            raise DappleError(f"{describe(input_fn)}: leaf {i} for step {step} leads with {leading} samples, but the "
                              f"batch size is {batch_size}. Contract: {CONTRACT}")


def _is_tensor(value) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable, tf.SparseTensor, tf.RaggedTensor)) or tf.is_tensor(value)


def _step_zero(input_fn, batch_size, legacy):
    """input_fn's batch for step 0, in the default graph: called with the int 0, else (a function using
    tensor methods on `step`) with a constant step tensor."""
    try:
        return _pair(call(input_fn, 0, batch_size, legacy), input_fn)
    except DappleError:
        raise
    except (AttributeError, TypeError, ValueError) as error:
        try:
            return _pair(call(input_fn, tf.constant(0, tf.int64), batch_size, legacy), input_fn)
        except Exception:  # pylint: disable=broad-except
            raise error from None


def batch_tensors(input_fn, step, batch_size: Optional[int], legacy: Optional[str] = None):
    """(features, labels) tensors in the default graph for `step` (an int64 scalar tensor or an int)."""
    with tf.Graph().as_default():  # the probe: what input_fn returns for step 0
        probe = _step_zero(input_fn, batch_size, legacy)
    leaves = tf.nest.flatten(probe)
    _check_batch_size(leaves, batch_size, input_fn, 0)
    if any(_is_tensor(v) for v in leaves):
        try:
            result = call(input_fn, step, batch_size, legacy)
        except (TypeError, NotImplementedError, ValueError) as e:
            raise DappleError(
                f"{describe(input_fn)} returned tensors for step 0 (a Python int) but failed on the step tensor "
                f"({type(e).__name__}: {e}): compute the batch with TF ops on `step`, or return numpy arrays "
                f"(then it is called with a Python int every step). Contract: {CONTRACT}") from None
        return tf.nest.map_structure(lambda v: None if v is None else tf.convert_to_tensor(v), _pair(result, input_fn))
    given = [i for i, v in enumerate(leaves) if v is not None]  # labels may be None, as for build_pipeline
    arrays = [np.asarray(leaves[i]) for i in given]
    for value, array in zip([leaves[i] for i in given], arrays):
        if array.dtype == object or array.ndim == 0:
            raise DappleError(f"{describe(input_fn)} returned {type(value).__name__} {value!r:.60}: each leaf must be "
                              f"a numpy array (or a tensor) with the batch leading. Contract: {CONTRACT}")
    dtypes = [tf.as_dtype(a.dtype) for a in arrays]

    def batch(step_value):
        flat = tf.nest.flatten(_pair(call(input_fn, int(step_value), batch_size, legacy), input_fn))
        values = [np.asarray(flat[i]) for i in given]
        for i, (value, want) in enumerate(zip(values, arrays)):
            if value.shape != want.shape or value.dtype != want.dtype:
                raise DappleError(f"{describe(input_fn)}: leaf {i} for step {int(step_value)} is {value.dtype} "
                                  f"{value.shape}, for step 0 {want.dtype} {want.shape}: every step's batch needs "
                                  "the same dtypes and shapes")
        return values

    step = tf.cast(step, tf.int64)
    tensors = tf.numpy_function(batch, [step], dtypes, stateful=True, name="dapple_input_fn")
    flat = [None] * len(leaves)
    for i, tensor, array in zip(given, tensors, arrays):
        tensor.set_shape(array.shape)
        flat[i] = tensor
    return tf.nest.pack_sequence_as(probe, flat)


def batch_values(input_fn, step: int, batch_size: Optional[int], legacy: Optional[str] = None):
    """(features, labels) as numpy values for a Python int `step` (tensors are evaluated in a session)."""
    with tf.Graph().as_default():
        result = _step_zero(input_fn, batch_size, legacy) if step == 0 else _pair(
            call(input_fn, step, batch_size, legacy), input_fn)
        _check_batch_size(tf.nest.flatten(result), batch_size, input_fn, step)
        if not any(_is_tensor(v) for v in tf.nest.flatten(result)):
            return tf.nest.map_structure(lambda v: None if v is None else np.asarray(v), result)
        flat = tf.nest.flatten(result)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.tables_initializer())
            got = iter(sess.run([v for v in flat if v is not None]))
        return tf.nest.pack_sequence_as(result, [None if v is None else next(got) for v in flat])


def estimator_input_fn(input_fn, batch_size: int):
    """An Estimator input_fn (no arguments) giving input_fn's batch for the current global step."""

    def estimator_fn():
        step = tf.compat.v1.train.get_or_create_global_step()
        return batch_tensors(input_fn, tf.identity(step), batch_size)

    return estimator_fn
