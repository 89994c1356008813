"""dapple_tf: trains a user's single-device TF graph as a DAPPLE pipelined data-parallel graph.

    with dapple_tf.layer("dense1"): ...          # mark layers while writing the model, or
    build_pipeline(..., layers=dapple_tf.layers_by_scope(depth=2))   # use the model's own name scopes
    handle = dapple_tf.build_pipeline(model_fn, features, labels, optimizer, plan)
    dapple_tf.Trainer(model_fn, input_fn, optimizer, plan, model_dir).train(steps)   # or a training loop
    train_op = dapple_tf.minimize(loss, optimizer, global_step=...)   # inside a TF1 script's model_fn
"""

from dapple_tf.rewrite.batch.batch_norm import BatchNormWarning, MovingStatisticsWarning, collect_updates
from dapple_tf.cluster.servers import ClusterError, TFCluster
from dapple_tf.errors import DappleError, LayerMarkerError, PlanError
from dapple_tf.model.layers import LayerRecorder, layer
from dapple_tf.model.minimize import minimize
from dapple_tf.rewrite.options import PipelineOptions
from dapple_tf.rewrite.pipeline import PipelineHandle, build_pipeline
from dapple_tf.plan import Plan
from dapple_tf.rewrite.template.random_ops import RandomOpsWarning
from dapple_tf.model.scopes import ScopeLayers, layers_by_scope
from dapple_tf.frontends.trainer import Trainer, TrainerOptions

__all__ = [
    "BatchNormWarning",
    "MovingStatisticsWarning",
    "collect_updates",
    "ClusterError",
    "TFCluster",
    "Trainer",
    "TrainerOptions",
    "DappleError",
    "LayerMarkerError",
    "PlanError",
    "LayerRecorder",
    "layer",
    "layers_by_scope",
    "ScopeLayers",
    "Plan",
    "RandomOpsWarning",
    "PipelineHandle",
    "PipelineOptions",
    "build_pipeline",
    "minimize",
]
