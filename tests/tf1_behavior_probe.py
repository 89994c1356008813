"""Run by tests/test_tf1_behavior.py in a process of its own: after `tf.compat.v1.disable_v2_behavior()` (v1
TensorShapes, control flow v1 while loops, reference variables unless resource variables are enabled), TF1-style
models train pipelined as on one device. Prints one JSON object: case -> [largest weight difference, largest
global-norm difference, global step] or the error message."""

import json
import sys

import tensorflow as tf

tf.compat.v1.disable_v2_behavior()
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 4)

import dapple_tf  # noqa: E402
from tests import script_harness, script_models, tf1_models  # noqa: E402
from tests.pipeline_harness import cpu, initial_weights  # noqa: E402
from tests.training_scripts_harness import differences, train_pipelined, train_single  # noqa: E402

STEPS = 3  # AdamW's warmup learning rate is 0 at step 0


def compare(loss_fn, batch, make_optimizer, stages, layers, clip, **build):
    x, y = batch
    initial = initial_weights(loss_fn, x, y)
    want = train_single(loss_fn, x, y, make_optimizer, STEPS, clip, initial)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=2)
    got = train_pipelined(loss_fn, x, y, make_optimizer, plan, STEPS, clip, initial, layers=layers, **build)
    weights, norms = differences(want, got)
    return [weights, norms, int(got.global_step), min(float(n) for n in want.norms)]


def compare_script(idiom: str, i: int):
    """The script_models idiom trained as written on one device and pipelined: [largest difference, global step]."""
    sparse = idiom in script_models.SPARSE_IDIOMS
    x, y = script_models.ids_batch() if sparse else script_models.batch()
    bn = not sparse and i % 2 == 0
    stages, micro_batches, build = ((script_models.SPARSE_STAGES, 2, {}) if sparse else
                                    (script_models.BN_CASES if bn else script_models.FREE_CASES)[i // 2 % 2])
    model_fn = script_models.model_fn(idiom, bn)
    initial = script_harness.initial_values(model_fn, x, y)
    want, _ = script_harness.train_one_device(model_fn, x, y, STEPS, initial)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=micro_batches)
    got, _ = script_harness.train_pipelined(model_fn, x, y, plan, STEPS, initial, **build)
    return [script_harness.largest_difference(want, got), int(got["global_step"])]


def main():
    results = {}
    bert = dapple_tf.layers_by_scope(patterns=tf1_models.BERT_LAYERS)
    by_scope = dapple_tf.layers_by_scope(depth=1)
    adam = tf1_models.adamw  # its slots made in apply_gradients, global_step advanced by the script
    first, second = ("bert/embeddings", "bert/encoder/layer_0"), ("bert/encoder/layer_1", "loss")
    tf.compat.v1.enable_resource_variables()
    cases = {
        "bert 2:1 dapple": (tf1_models.bert_loss, tf1_models.bert_batch(8), tf1_models.adamw,
                            [(*first, [cpu(0), cpu(1)]), (*second, [cpu(2)])], bert, tf1_models.CLIP, {}),
        "bert straight zb-h1 functions": (tf1_models.bert_loss, tf1_models.bert_batch(8), tf1_models.adamw,
                                          [(*first, [cpu(0)]), (*second, [cpu(1)])], bert, tf1_models.CLIP,
                                          {"schedule": "zb-h1", "stage_functions": True}),
        "dynamic_rnn straight": (tf1_models.seq2seq_loss, tf1_models.seq_batch(8), adam,
                                 [("lstm_0", "lstm_0", [cpu(0)]), ("lstm_1", "head", [cpu(1)])], by_scope, 0.05, {}),
        "dynamic_rnn 2:1 gpipe": (tf1_models.seq2seq_loss, tf1_models.seq_batch(8), adam,
                                  [("lstm_0", "lstm_0", [cpu(0), cpu(1)]), ("lstm_1", "head", [cpu(2)])], by_scope,
                                  0.05, {"schedule": "gpipe"}),
        "while_loop 1:2 recompute": (tf1_models.while_loop_loss, tf1_models.seq_batch(8), adam,
                                     [("loop", "loop", [cpu(0)]), ("head", "head", [cpu(1), cpu(2)])], by_scope,
                                     0.05, {"recompute": True}),
    }
    for name, (loss_fn, batch, optimizer, stages, layers, clip, build) in cases.items():
        results[name] = compare(loss_fn, batch, optimizer, stages, layers, clip, **build)
    for i, idiom in enumerate(script_models.IDIOMS + script_models.SPARSE_IDIOMS):
        results[f"script {idiom}"] = compare_script(idiom, i)
    tf.compat.v1.disable_resource_variables()
    try:
        compare(tf1_models.seq2seq_loss, tf1_models.seq_batch(8), adam,
                [("lstm_0", "lstm_0", [cpu(0)]), ("lstm_1", "head", [cpu(1)])], by_scope, 0.05)
        results["reference variables"] = "built"
    except dapple_tf.DappleError as e:
        results["reference variables"] = str(e)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
