"""dapple_tf: trains a user's single-device TF graph as a DAPPLE pipelined data-parallel graph.

    with dapple_tf.layer("dense1"): ...          # mark layers while writing the model
    handle = dapple_tf.build_pipeline(model_fn, features, labels, optimizer, plan)
"""

from dapple_tf.cluster import ClusterError, TFCluster
from dapple_tf.errors import DappleError, LayerMarkerError, PlanError
from dapple_tf.layers import LayerRecorder, layer
from dapple_tf.pipeline import PipelineHandle, build_pipeline
from dapple_tf.plan import Plan
from dapple_tf.trainer import Trainer, TrainerOptions

__all__ = [
    "ClusterError",
    "TFCluster",
    "Trainer",
    "TrainerOptions",
    "DappleError",
    "LayerMarkerError",
    "PlanError",
    "LayerRecorder",
    "layer",
    "Plan",
    "PipelineHandle",
    "build_pipeline",
]
