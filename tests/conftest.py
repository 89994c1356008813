"""Test session setup: this process's CPU is split into 8 virtual devices before TF starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

NUM_VIRTUAL_CPUS = 8


def pytest_configure(config):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_VIRTUAL_CPUS)
    except RuntimeError:
        pass  # already initialized (e.g. by a plugin); tests needing devices will say so
