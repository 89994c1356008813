"""dapple_train: train a model with DAPPLE (pipelined, data-parallel) in one process or on a cluster.

Without TF_CONFIG it runs in this process on --num_devices virtual CPU devices; under dapple_launch
(TF_CONFIG names the worker tasks and this task is the chief) it builds the pipelined graph here and
runs it on the workers; where TF_CONFIG names this task a worker (dapple_launch --per_host), every task
runs it and builds only its own part. With no --plan it profiles the model (or reads --profile) and plans
it with the DAPPLE planner for the devices it runs on (or for --cluster); per host, worker task 0 plans
and every other task trains its plan.

Examples:
  dapple_train --model=mlp --global_batch_size=24 --steps=100 --model_dir=m
  dapple_train --model=bert --model_flags=num_layers=4 --plan=plan.json --steps=1000 --model_dir=m
  dapple_train --model_fn=my.module:model_fn --input_fn=my.module:input_fn --global_batch_size=64 --steps=10
  dapple_launch --cluster=local:3x2 -- dapple_train --model=mlp --global_batch_size=24 --steps=6 --model_dir=m
  horovodrun -np 2 --gloo dapple_train --backend=horovod --plan=hvd_plan.json --num_devices=3 --model=mlp --steps=6

With --backend=horovod (under horovodrun) every process trains the --plan (from `dapple_plan
--backend=horovod --num_processes=P`: one server's plan at the per-process batch) on its own
--num_devices virtual CPUs, on its slice of the global batch; gradients are averaged across processes
by Horovod, rank 0 writes checkpoints and logs.

A user's --model_fn(features, labels) returns the loss, its layers marked with dapple_tf.layer or,
for a model without markers (Keras layers, tf-slim nets), cut by its name scopes: --scope_depth=N or
--scope_patterns=... (dapple_tf.layers_by_scope, as dapple_profile's). --input_fn(step, batch_size)
returns (features, labels) of the global batch for `step`, numpy arrays or tensors (the contract of
dapple_tf/model/inputs.py, shared with dapple_profile and dapple_tf.Trainer): a function of the step alone
makes a resumed run continue exactly. The module must be importable: run from its folder or put the
folder on PYTHONPATH. Flags can come from a file: --flagfile=train.flags.

  dapple_train --model_fn=my_net:model_fn --input_fn=my_net:input_fn --scope_depth=1 \
      --global_batch_size=32 --steps=100        # a Keras model, no markers

An Estimator-style --model_fn(features, labels, mode, params) is called in TRAIN mode and names its optimizer,
global step and clipping in dapple_tf.minimize (a TF1 script ported as in the user guide's "Porting a training
script"); --optimizer and --learning_rate do not apply to it.
"""

import dataclasses
import os

from absl import flags

from planner.formats.schedule import SCHEDULE_KINDS
from scripts.cli import quiet_tensorflow, reject_arguments, run_main

quiet_tensorflow()
from dapple_tf.model import user_model  # noqa: E402  pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Reference model (mlp, vgg19, resnet50, bert, gnmt).")
flags.DEFINE_string("config", "tiny", "Reference model config: tiny or paper.")
flags.DEFINE_string("model_flags", "", "Reference model overrides, key=value,key=value.")
flags.DEFINE_string("model_fn", None, "A user's model: package.module:function(features, labels) -> loss, or an "
                    "Estimator model_fn(features, labels, mode, params) calling dapple_tf.minimize.")
flags.DEFINE_string("input_fn", None, "A user's input: package.module:function(step, batch_size) -> "
                    "(features, labels), numpy arrays or tensors (dapple_tf/model/inputs.py).")
user_model.define_scope_flags()
flags.DEFINE_string("eval_input_fn", None, "Held-out input for --model_fn, same signature as --input_fn.")
flags.DEFINE_string("plan", None, "Plan file from dapple_plan (default: profile and plan here).")
flags.DEFINE_string("profile", None, "Profile file to plan from (default: profile the model here).")
flags.DEFINE_string("cluster", None, "Cluster to plan for (dapple_plan's --cluster; default: the devices this "
                    "runs on: --num_devices virtual CPUs, or the launched cluster's tasks).")
flags.DEFINE_integer("num_devices", 4, "Virtual CPU devices when running in one process (no TF_CONFIG).")
flags.DEFINE_integer("global_batch_size", None, "Samples per step, all processes together (default: the plan file's).")
flags.DEFINE_enum("backend", "tf", ["tf", "horovod"], "tf: this process or a TF cluster (TF_CONFIG); horovod: one "
                  "process of horovodrun, with a --plan from dapple_plan --backend=horovod.")
flags.DEFINE_enum("schedule", None, list(SCHEDULE_KINDS), "Pipeline schedule (default: the plan's, else dapple); "
                  "without --plan, the planner weighs this schedule only (interleaved: its plan with two stages per "
                  "device).")
flags.DEFINE_enum("batch_norm", "per_slice", ["per_slice", "sync"],
                  "Batch norm statistics in replicated stages: per replica's slice, or synchronized over the "
                  "stage's replicas (the whole micro-batch).")
flags.DEFINE_integer("steps", 100, "Train until the global step reaches this (a resumed run continues to it).")
flags.DEFINE_string("model_dir", None, "Checkpoints and TensorBoard summaries; resumes from its latest checkpoint.")
flags.DEFINE_integer("save_checkpoints_steps", 100, "Save a checkpoint every this many steps (0: off).")
flags.DEFINE_float("save_checkpoints_secs", 0, "Save a checkpoint every this many seconds (0: off).")
flags.DEFINE_integer("keep_checkpoints", 5, "Checkpoints kept.")
flags.DEFINE_integer("log_every", 10, "Progress line every this many steps.")
flags.DEFINE_integer("summary_every", 10, "Summaries (loss, samples/s, step time, peak memory) every this many steps.")
flags.DEFINE_integer("eval_every", 0, "Held-out loss through the single-device graph every this many steps (0: off).")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "momentum", "adam"], "Optimizer (not for an Estimator-style "
                  "--model_fn, whose dapple_tf.minimize names its own).")
flags.DEFINE_float("learning_rate", 0.01, "Learning rate (with --optimizer).")
flags.DEFINE_float("clip_global_norm", None, "Clip the full-batch gradients by their global norm, as "
                   "tf.clip_by_global_norm (default: no clipping).")
flags.DEFINE_integer("seed", 0, "Random seed (initial weights, synthetic data).")
flags.DEFINE_float("failure_timeout", 30, "On a cluster: a step or a task that does not answer ends training within "
                   "this (s); a task whose process is gone, within seconds.")
flags.DEFINE_string("trace", None, "Write the measured timeline of one step (--trace_step) to this Chrome trace "
                    "file, and a PNG beside it (above the simulated timeline when the plan comes with a profile).")
flags.DEFINE_integer("trace_step", 5, "With --trace: which step of this run to trace.")
flags.DEFINE_float("worker_wait_timeout", 60, "On a cluster: how long to wait for the workers to come up (s).")
flags.DEFINE_float("plan_wait_timeout", 900, "Per host without --plan: how long the other tasks wait for worker "
                   "task 0 to profile and plan (s).")


def main(argv):
    reject_arguments(argv)
    if FLAGS.steps < 1 or FLAGS.num_devices < 1:
        raise ValueError("--steps and --num_devices must be >= 1")
    if bool(FLAGS.model) == bool(FLAGS.model_fn):
        raise ValueError("give exactly one of --model (a reference model) or --model_fn (your own)")
    if FLAGS.model_fn and not FLAGS.input_fn:
        raise ValueError("--model_fn needs --input_fn (package.module:function(step, batch_size))")
    if not (FLAGS.global_batch_size or FLAGS.plan):
        raise ValueError("--global_batch_size is required (or a --plan file that says it)")
    if FLAGS.clip_global_norm is not None and FLAGS.clip_global_norm <= 0:
        raise ValueError(f"--clip_global_norm must be > 0, got {FLAGS.clip_global_norm}")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # CPU devices then report peak memory
    from scripts.workflows import train as train_run

    names = [field.name for field in dataclasses.fields(train_run.TrainSettings)]
    return train_run.train(train_run.TrainSettings(**{name: FLAGS[name].value for name in names}))


def run():
    run_main(main)


if __name__ == "__main__":
    run()
