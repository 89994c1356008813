"""A Keras model trained with DAPPLE as written: plain Keras layers, no dapple_tf markers, numpy data.

The layers are the model's own name scopes (`dapple_tf.layers_by_scope(depth=1)`: one layer per
Keras layer, in Keras 2 and Keras 3). This script profiles the model layer by layer, plans it with
the DAPPLE planner for 4 virtual CPU devices and trains the pipelined graph, through the Python API:

    python examples/keras_classifier.py

The same module from the command line (`model_fn` and `input_fn` below; run from this folder, or put
it on PYTHONPATH, so that `keras_classifier` can be imported):

    cd examples
    dapple_profile --model_fn=keras_classifier:model_fn --input_fn=keras_classifier:input_fn \
        --scope_depth=1 --batch_size=16 --output=keras-classifier.txt
    dapple_train --model_fn=keras_classifier:model_fn --input_fn=keras_classifier:input_fn \
        --scope_depth=1 --global_batch_size=64 --steps=60 --learning_rate=0.05
"""

import numpy as np
import tensorflow as tf

import dapple_tf
import profiler
from planner.planning import api as planner_api
from planner.formats.cluster import local_cluster

FEATURES, CLASSES, NUM_DEVICES, GLOBAL_BATCH = 16, 4, 4, 64
_TEACHER = np.random.RandomState(0).randn(FEATURES, CLASSES)  # the labels' rule, learned by the model


def _init(seed):
    return tf.keras.initializers.GlorotUniform(seed=seed)  # seeded: the same weights in every run and plan


def model_fn(features, labels):
    """The loss of a small classifier on a global batch (a scalar mean over the samples)."""
    x = tf.keras.layers.Dense(32, activation="relu", kernel_initializer=_init(1))(features)
    x = tf.keras.layers.LayerNormalization()(x)
    x = tf.keras.layers.Dense(32, activation="relu", kernel_initializer=_init(2))(x)
    logits = tf.keras.layers.Dense(CLASSES, kernel_initializer=_init(3))(x)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def input_fn(step, batch_size):
    """The global batch of training step `step` (dapple_tf/model/inputs.py's contract): numpy arrays."""
    x = np.random.RandomState(step).randn(batch_size, FEATURES).astype(np.float32)
    return x, (x @ _TEACHER).argmax(axis=1).astype(np.int32)


def main(steps=60):
    cpu = tf.config.list_physical_devices("CPU")[0]  # before TensorFlow starts: 4 virtual devices
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES)
    layers = dapple_tf.layers_by_scope(depth=1)

    batch = GLOBAL_BATCH // NUM_DEVICES  # profile at the size a data-parallel replica would see
    values = input_fn(0, batch)
    profile = profiler.profile_model(
        model_fn, lambda: tuple(tf.compat.v1.placeholder(v.dtype, v.shape) for v in values), values, batch,
        layers=layers, warmup=1, runs=3)
    print("profiled:", ", ".join(f"{layer.name} {layer.forward_ms + layer.backward_ms:.2f} ms"
                                 for layer in profile.layers))

    plan = dapple_tf.Plan.from_proto(planner_api.plan(profile, local_cluster(NUM_DEVICES), GLOBAL_BATCH))
    print("plan:", "; ".join(f"layers {s.first_layer}..{s.last_layer} on {len(s.devices)} devices"
                             for s in plan.stages), f"M={plan.num_micro_batches}")

    trainer = dapple_tf.Trainer(model_fn, input_fn, lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05), plan,
                                layers=layers, options=dapple_tf.TrainerOptions(log_every=20, summary_every=0))
    result = trainer.train(steps)
    print(f"trained {result.step} steps: loss {result.loss:.3f}")
    return result


if __name__ == "__main__":
    main()
