"""Errors raised while recording layers, reading plans or building the pipelined graph."""


class DappleError(ValueError):
    """Base class: a user input dapple_tf cannot build from; the message says what to change."""


class LayerMarkerError(DappleError):
    """dapple_tf.layer markers are missing, nested, duplicated or out of order."""


class PlanError(DappleError):
    """A plan that does not fit the model, the devices or the batch."""


class PerHostError(PlanError):
    """What per-host graphs (PipelineOptions.own_task) do not build yet; one graph for the cluster does."""
