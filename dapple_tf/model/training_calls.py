"""What a model_fn asked TensorFlow to compute and apply as its training step, read while the template is traced.

A TF1 script builds its train op inside model_fn: `optimizer.minimize(loss, global_step)`, or
`optimizer.compute_gradients` then `apply_gradients`, or `tf.gradients(loss, tvars)` then `apply_gradients`.
The graph holds what those calls built, but not which tensors were their results (tf.gradients leaves no mark on
its outputs) nor the optimizer object, which the pipeline calls again for every variable copy. So while model_fn
runs for the template, `observe` watches the operations it creates (an op creation callback: nothing of
TensorFlow is replaced) and, for each, the Python calls it is created in:
- a `GradientsCall` per tf.gradients call (`tf.gradients`, `tf.compat.v1.gradients`, `compute_gradients`): the
  tensor differentiated, the variables, whether `grad_ys` were given, the operations it created and, once it
  has returned, its result per variable (read from the finished call's own bookkeeping);
- an `ApplyCall` per `apply_gradients` of a `tf.compat.v1.train.Optimizer` (called by the script or by
  `minimize`; the outermost one when a subclass calls its base class): the optimizer, the (gradient, variable)
  pairs, the global step and the operations it created.
Each records where the script called it (file:line), for messages. What the calls mean for the pipeline is
decided elsewhere (script_training.py).
"""

import contextlib
import dataclasses
import os
import sys
from typing import Dict, List, Optional, Set, Tuple

import tensorflow as tf
from tensorflow.python.framework import op_callbacks
from tensorflow.python.ops import gradients_util

from dapple_tf.errors import DappleError

_GRADIENTS_CODE = gradients_util._GradientsHelper.__code__  # pylint: disable=protected-access
_SITE = os.path.dirname(os.path.dirname(tf.__file__))
_LIBRARY_ROOTS = tuple(os.path.join(_SITE, name) + os.sep for name in ("tensorflow", "tensorflow_estimator", "keras",
                                                                        "tf_keras"))


def _is_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_ROOTS) or filename == __file__


def call_site(frame) -> str:
    """file:line of the first frame above `frame` (its caller, or further out) outside TensorFlow: the script's
    line that made the call."""
    frame = frame.f_back
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "an unknown place"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


@dataclasses.dataclass
class GradientsCall:
    """One tf.gradients call (or compute_gradients, which makes one)."""

    where: str
    ys: List[tf.Tensor]
    xs: List[object]  # as TensorFlow differentiates them: variable handles or tensors
    grad_ys_given: bool
    ops: Set[tf.Operation] = dataclasses.field(default_factory=set)
    frame: object = None  # the finished call, read once (results)
    _results: Optional[list] = None

    def results(self) -> list:
        """Its result, one gradient (Tensor, IndexedSlices or None) per x, as tf.gradients returned it."""
        if self._results is None:
            local = self.frame.f_locals if self.frame is not None else {}
            grads, xs = local.get("grads"), local.get("xs")
            if not isinstance(grads, dict) or not isinstance(xs, list):
                raise DappleError(
                    f"the tf.gradients call at {self.where} cannot be followed on this TensorFlow version "
                    f"({tf.__version__}): compute the train op with dapple_tf.minimize(loss, optimizer, ...)")
            self._results = [_gradient_of(grads, x) for x in xs]
            self.frame = None
        return self._results


def _gradient_of(grads: dict, x) -> object:
    """What tf.gradients returns for `x` from the gradients it collected per op (aggregated once processed)."""
    op_grads = grads.get(x.op)
    if not op_grads:
        return None
    grad = op_grads[x.value_index]
    return None if isinstance(grad, list) and not grad else grad


@dataclasses.dataclass
class ApplyCall:
    """One Optimizer.apply_gradients call (from minimize or the script)."""

    where: str
    optimizer: object
    grads_and_vars: Optional[List[Tuple[object, object]]]  # None: given as an iterable that cannot be re-read
    global_step: object
    ops: Set[tf.Operation] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class TrainingCalls:
    gradients: List[GradientsCall] = dataclasses.field(default_factory=list)
    applies: List[ApplyCall] = dataclasses.field(default_factory=list)

    def ops(self) -> Set[tf.Operation]:
        return set().union(*(c.ops for c in self.gradients), *(c.ops for c in self.applies))


def _sequence(iterable) -> Optional[list]:
    """The items of a list, tuple or zip of lists and tuples, without consuming it (None for anything else)."""
    if isinstance(iterable, (list, tuple)):
        return list(iterable)
    if isinstance(iterable, zip):
        columns = []
        for iterator in iterable.__reduce__()[1]:
            reduced = iterator.__reduce__()
            if len(reduced) < 2 or not reduced[1] or not isinstance(reduced[1][0], (list, tuple)):
                return None
            columns.append(reduced[1][0])
        return list(zip(*columns)) if columns else None
    return None


def _is_apply_frame(frame) -> bool:
    """A frame of some optimizer's apply_gradients (a tf.compat.v1.train one, or another that the build refuses
    with a message naming the one to use)."""
    if frame.f_code.co_name != "apply_gradients":
        return False
    owner = frame.f_locals.get("self")
    return owner is not None and any(c.__name__ == "Optimizer" for c in type(owner).__mro__)


class _Observer:
    def __init__(self, graph: tf.Graph, stop_frame):
        self.graph = graph
        self.stop_frame = stop_frame
        self.calls = TrainingCalls()
        self._gradients_of_frame: Dict[int, GradientsCall] = {}
        self._apply_of_frame: Dict[int, ApplyCall] = {}
        self._frames = []  # keeps the observed frames alive, so that their ids stay theirs

    def __call__(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        del op_type, inputs, attrs
        if graph is not self.graph:
            return None
        gradients_frame = apply_frame = None
        frame = sys._getframe(1)  # pylint: disable=protected-access
        while frame is not None and frame is not self.stop_frame:
            code = frame.f_code
            if code is _GRADIENTS_CODE:
                gradients_frame = frame
            elif code.co_name == "apply_gradients" and _is_apply_frame(frame):
                apply_frame = frame
            frame = frame.f_back
        if gradients_frame is None and apply_frame is None:
            return None
        op = outputs[0].op if outputs else self.graph.get_operation_by_name(op_name)  # Const gives its name asked
        if gradients_frame is not None:
            self._gradients_call(gradients_frame).ops.add(op)
        if apply_frame is not None:
            self._apply_call(apply_frame).ops.add(op)
        return None

    def _gradients_call(self, frame) -> GradientsCall:
        call = self._gradients_of_frame.get(id(frame))
        if call is None:
            local = frame.f_locals
            grad_ys = local.get("grad_ys")
            call = GradientsCall(where=call_site(frame), ys=list(local.get("ys") or []), xs=list(local.get("xs") or []),
                                 grad_ys_given=grad_ys is not None and any(g is not None for g in grad_ys),
                                 frame=frame)
            self._frames.append(frame)
            self._gradients_of_frame[id(frame)] = call
            self.calls.gradients.append(call)
        return call

    def _apply_call(self, frame) -> ApplyCall:
        call = self._apply_of_frame.get(id(frame))
        if call is None:
            local = frame.f_locals
            call = ApplyCall(where=call_site(frame), optimizer=local.get("self"),
                             grads_and_vars=_sequence(local.get("grads_and_vars")),
                             global_step=local.get("global_step"))
            self._frames.append(frame)
            self._apply_of_frame[id(frame)] = call
            self.calls.applies.append(call)
        return call


@contextlib.contextmanager
def observe(graph: tf.Graph):
    """While the block runs (model_fn, in the calling frame): the TrainingCalls of the ops it creates in `graph`."""
    observer = _Observer(graph, sys._getframe(2))  # pylint: disable=protected-access  # the `with` statement's frame
    op_callbacks.add_op_callback(observer)
    try:
        yield observer.calls
    finally:
        op_callbacks.remove_op_callback(observer)
        observer._frames.clear()  # pylint: disable=protected-access
