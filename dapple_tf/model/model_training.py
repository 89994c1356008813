"""How model_fn asked to be trained, and the train op each pipelined step runs.

Three ways, one per build:
- none in model_fn: build_pipeline's optimizer;
- `dapple_tf.minimize` (minimize.py): its request names the optimizer, global step and clipping;
- the script's own `minimize`, `compute_gradients` + `apply_gradients` or `tf.gradients` + `apply_gradients`
  (script_training.py): the pipeline's step stands for what those calls built.
An Estimator-style model_fn returns an EstimatorSpec whose train_op may group more around that: a
`global_step.assign_add(1)` after it (TF1 BERT), an `ExponentialMovingAverage.apply` under a control dependency on
it, the batch norms' UPDATE_OPS (`tf.group(minimize_op, update_ops)`, `tf.control_dependencies(update_ops)`).
`TrainOp` reads that train_op when model_fn returns: the pipeline's step stands for the training ops, the UPDATE_OPS
members are what the pipeline runs once per step itself, and everything else the train_op runs must not read the
batch (no step feeds the template's inputs). `run_after(step)` makes the train_op run the pipeline's step where it
ran those: every control edge into them now points at the step. Nothing is rebuilt: the user's other ops (the EMA's
shadow variables included) keep their names, so checkpoints hold them under their single-device names.
"""

import dataclasses
from typing import List, Optional, Set

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.model import script_training
from dapple_tf.model.minimize import MinimizeRequest
from dapple_tf.model.training_calls import TrainingCalls


@dataclasses.dataclass
class TrainOp:
    """The EstimatorSpec's train_op, read once; see the module docstring."""

    op: tf.Operation
    stands_for_step: Set[tf.Operation]  # what the pipeline's step replaces (edges into it go to the step)
    rewired: List[tf.Operation]  # ops of the train_op with control edges into stands_for_step

    @classmethod
    def read(cls, train_op, training_ops: Set[tf.Operation], update_ops: Set[tf.Operation],
             computed: Set[tf.Operation], batch_dependent: Set[tf.Operation], what: str) -> "TrainOp":
        """`training_ops`: what the step replaces (minimize's op, or the script's apply); `computed`: the script's
        gradients and their transform, which the train_op may only run through `training_ops`; `what` names the
        training ops in messages."""
        op = train_op if isinstance(train_op, tf.Operation) else train_op.op
        stands_for = training_ops | update_ops
        seen, stack, runs, rewired = set(), [op], op in training_ops, []
        while stack:
            current = stack.pop()
            if current in seen or current in stands_for:
                continue
            seen.add(current)
            if current in computed:
                raise DappleError(
                    f"the EstimatorSpec's train_op {op.name} runs {current.name}, part of the gradients {what} "
                    "applies, other than through applying them: the pipeline computes the gradients per micro-batch; "
                    "group only the apply (and what does not read the batch)")
            if current in batch_dependent:
                raise DappleError(
                    f"the EstimatorSpec's train_op {op.name} computes from the model's inputs ({current.name}) besides "
                    f"running {what}: nothing but the pipeline's step reads the batch; group only what does not read "
                    "it (global_step updates, UPDATE_OPS, ...)")
            for t in current.inputs:
                if t.op in stands_for:
                    raise DappleError(f"{current.name} in the EstimatorSpec's train_op {op.name} reads {t.name}, an "
                                      f"output of {what}: group it under a control dependency instead")
                stack.append(t.op)
            into = [c for c in current.control_inputs if c in stands_for]
            runs = runs or any(c in training_ops for c in into)
            if into:
                rewired.append(current)
            stack.extend(c for c in current.control_inputs if c not in stands_for)
        if not runs:
            raise DappleError(f"the EstimatorSpec's train_op {op.name} does not run {what}: return that op (or a "
                              "tf.group with it) as the train_op")
        return cls(op, stands_for, rewired)

    def run_after(self, step: tf.Operation) -> tf.Operation:
        if self.op in self.stands_for_step:
            return step
        for op in self.rewired:
            kept = [c for c in op.control_inputs if c not in self.stands_for_step]
            op._remove_all_control_inputs()  # pylint: disable=protected-access
            op._add_control_inputs(kept + [step])  # pylint: disable=protected-access
        return self.op


@dataclasses.dataclass
class ModelTraining:
    """How model_fn asked to be trained; see the module docstring."""

    request: Optional[MinimizeRequest] = None
    script: Optional[script_training.ScriptTraining] = None
    train_op: Optional[TrainOp] = None

    @classmethod
    def of(cls, requests: List[MinimizeRequest], calls: TrainingCalls, loss: tf.Tensor, spec_train_op,
           update_ops: Set[tf.Operation], variable_of_handle, batch_dependent: Set[tf.Operation]) -> "ModelTraining":
        if len(requests) > 1:
            raise DappleError(f"model_fn called dapple_tf.minimize {len(requests)} times; call it once, on the loss")
        request = requests[0] if requests else None
        if request is not None and tf.convert_to_tensor(request.loss) is not loss:
            raise DappleError(f"dapple_tf.minimize was given {request.loss.name}, but model_fn returned the loss "
                              f"{loss.name}: minimize the loss model_fn returns")
        if request is not None and calls.applies:
            raise DappleError(f"model_fn calls dapple_tf.minimize and also applies gradients itself (at "
                              f"{calls.applies[0].where}): keep one of the two")
        script = None if request is not None else script_training.of(calls, loss, variable_of_handle, batch_dependent)
        train_op = None
        if spec_train_op is not None:
            if request is None and script is None:
                name = getattr(spec_train_op, "name", spec_train_op)
                raise DappleError(
                    f"model_fn returned an EstimatorSpec whose train_op ({name}) applies no optimizer: the pipeline "
                    "computes and applies the gradients itself, with the tf.compat.v1.train.Optimizer whose "
                    "minimize or apply_gradients model_fn calls (or dapple_tf.minimize(loss, optimizer, ...))")
            if request is not None:
                train_op = TrainOp.read(spec_train_op, {request.train_op}, update_ops, set(), batch_dependent,
                                        "dapple_tf.minimize's op")
            else:
                train_op = TrainOp.read(spec_train_op, script.apply.ops, update_ops,
                                        script.replaced - script.apply.ops, batch_dependent,
                                        f"the apply_gradients at {script.where}")
        return cls(request, script, train_op)

    @property
    def asked(self) -> bool:
        """model_fn named its optimizer itself (dapple_tf.minimize or its own calls)."""
        return self.request is not None or self.script is not None

    @property
    def optimizer(self):
        return self.request.optimizer if self.request is not None else self.script.optimizer

    @property
    def global_step(self):
        return self.request.global_step if self.request is not None else self.script.global_step

    def run_after(self, step: tf.Operation) -> tf.Operation:
        """The op a step runs: the train_op model_fn returned, running the pipeline's `step` where it ran its own
        training ops; minimize's op (after the step); or the step."""
        if self.request is not None:
            self.request.train_op._add_control_inputs([step])  # pylint: disable=protected-access
        if self.train_op is not None:
            return self.train_op.run_after(step)
        return self.request.train_op if self.request is not None else step
