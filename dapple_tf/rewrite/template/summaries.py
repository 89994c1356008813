"""The model's summaries in the pipelined graph, as a script writes them.

A summary model_fn adds (`tf.compat.v1.summary.scalar("cross_entropy", ...)`, an image of the inputs, a histogram
of activations, a streaming metric's update read by a summary) reads the template, whose inputs no step feeds. Each
such summary is built again once, reading what the pipeline computes: its operations outside the stages (the summary,
an argmax, a metric's update) are imported once, fed by
- each stage tensor it reads, combined over micro-batches and replicas as extra outputs are (outputs.py): a
  floating-point scalar as the mean of the micro-batches' values (a mean over the batch: cross entropy, accuracy);
  a batch-leading tensor as the whole batch's rows (predictions a metric counts), or, where only image, histogram or
  audio summaries read it, the first micro-batch's rows;
- the model's inputs themselves (the global batch);
- everything else as it is.
Summaries that do not read the batch are left as they are. A summary reading anything else of the batch (a tensor
that is neither a scalar nor batch-leading, the gradients) is dropped from SUMMARIES with a warning naming it.
Streaming metrics update once per step in which their summary runs, from the whole batch, as on one device.
"""

import dataclasses
import warnings
from typing import Callable, Dict, List, Optional, Set

import tensorflow as tf

from dapple_tf.rewrite.graphs import graph_defs, graph_walk
from dapple_tf.rewrite.template import outputs as outputs_lib

_SAMPLE_SUMMARIES = ("ImageSummary", "HistogramSummary", "AudioSummaryV2", "AudioSummary")


class _Unsupported(Exception):
    pass


@dataclasses.dataclass
class _Reader:
    summary: tf.Tensor  # as the SUMMARIES collection holds it
    ops: Set[tf.Operation]  # its operations outside the stages
    stage_tensors: Dict[str, tf.Tensor]
    input_tensors: Dict[str, tf.Tensor]
    fixed: Dict[str, tf.Tensor]


class Summaries:
    """The SUMMARIES model_fn added that read the batch, to build again on the pipeline; see the module docstring."""

    def __init__(self, graph: tf.Graph, template, created: Set[tf.Operation], excluded: Set[tf.Operation]):
        """`excluded`: ops a summary may not read (the script's own training step)."""
        self.graph = graph
        self.template = template
        stage_of = {op: s for s, st in enumerate(template.stages) for op in st.ops}
        placeholders = {graph.get_tensor_by_name(name).op for name in template.inputs}
        batch_dependent = graph_walk.descendants(list(placeholders), control=True)
        self.readers: List[_Reader] = []
        self.dropped: List[str] = []
        self.extras: Dict[str, outputs_lib.ExtraOutput] = {}
        kinds: Dict[str, str] = {}
        for summary in graph.get_collection(tf.compat.v1.GraphKeys.SUMMARIES):
            op = getattr(summary, "op", summary)
            if op not in created or op not in batch_dependent:
                continue
            try:
                reader = _reader(summary, stage_of, placeholders, batch_dependent, excluded)
                for name, t in reader.stage_tensors.items():
                    kinds[name] = _kind(t, op.type, kinds.get(name))
            except _Unsupported as e:
                self.dropped.append(f"{op.name} ({e})")
                continue
            self.readers.append(reader)
        for reader in self.readers:
            for name, t in reader.stage_tensors.items():
                self.extras.setdefault(name, outputs_lib.ExtraOutput(name, t, kinds[name], stage_of[t.op]))
        for extra in self.extras.values():
            wanted = template.stages[extra.stage].extra_outputs
            if extra.tensor not in wanted:
                wanted.append(extra.tensor)

    def combined_extras(self) -> List[outputs_lib.ExtraOutput]:
        """What `build` combines over the clones, in the order it asks for them."""
        return list(self.extras.values()) if self.readers else []

    def build(self, combined: Optional[Callable[[outputs_lib.ExtraOutput], tf.Tensor]], device: str) -> None:
        """Imports the summaries once on the combined values and puts them in SUMMARIES in place of the
        template's (StageBuilder.combined gives the values). combined=None (a per-host graph that does not
        combine them): the template's are removed and none is imported."""
        collection = self.graph.get_collection_ref(tf.compat.v1.GraphKeys.SUMMARIES)
        replaced = {id(r.summary) for r in self.readers}
        dropped = {name.split(" ")[0] for name in self.dropped}
        imported = self._imported(combined, device) if self.readers and combined else {}
        collection[:] = [imported.get(id(s), s) for s in collection
                         if id(s) in imported or id(s) not in replaced and getattr(s, "op", s).name not in dropped]
        if self.dropped and combined:
            warnings.warn(f"summaries {self.dropped} read the batch in a way the pipeline cannot compute once per "
                          "step; they are not recorded in pipelined training", UserWarning, stacklevel=3)

    def _imported(self, combined, device: str) -> Dict[int, tf.Tensor]:
        ops = sorted(set().union(*(r.ops for r in self.readers)), key=lambda op: op._id)  # pylint: disable=W0212
        input_map = {}
        for reader in self.readers:
            input_map.update(reader.fixed)
            input_map.update({name: self.template.inputs[name] for name in reader.input_tensors})
        input_map.update({name: combined(extra) for name, extra in self.extras.items()})
        graph_def = graph_defs.stage_graph_defs(self.graph, [ops])[0].graph_def
        read = {i for node in graph_def.node for i in node.input}
        input_map = {k: v for k, v in input_map.items() if k in read or k.endswith(":0") and k[:-2] in read}
        names = [r.summary.name for r in self.readers]
        with tf.device(device):
            results = tf.compat.v1.import_graph_def(graph_def, input_map=input_map, return_elements=names,
                                                    name="dapple/summaries")
        return {id(r.summary): t for r, t in zip(self.readers, results)}


def _reader(summary, stage_of, placeholders, batch_dependent, excluded) -> _Reader:
    reader = _Reader(summary, set(), {}, {}, {})
    stack = [getattr(summary, "op", summary)]
    while stack:
        op = stack.pop()
        if op in reader.ops:
            continue
        if op in excluded:
            raise _Unsupported(f"it reads {op.name}, part of the training step model_fn builds")
        reader.ops.add(op)
        for t in op.inputs:
            if t.op in stage_of:
                reader.stage_tensors[t.name] = t
            elif t.op in placeholders:
                reader.input_tensors[t.name] = t
            elif t.op in batch_dependent:
                stack.append(t.op)
            else:
                reader.fixed[t.name] = t
        stack.extend(c for c in op.control_inputs if c in batch_dependent and c not in stage_of)
    return reader


def _kind(t: tf.Tensor, summary_type: str, before) -> str:
    """How a stage tensor a summary reads is combined (the module docstring); `before`: another summary's kind."""
    if t.shape.rank == 0:
        if not t.dtype.is_floating:
            raise _Unsupported(f"it reads {t.name}, a {t.dtype.name} scalar computed from the batch, not a mean")
        return outputs_lib.MEAN
    if t.shape.rank is None or tf.compat.dimension_value(t.shape[0]) is not None:
        raise _Unsupported(f"it reads {t.name} of shape {t.shape}, neither a scalar mean nor batch-leading")
    kind = outputs_lib.FIRST if summary_type in _SAMPLE_SUMMARIES else outputs_lib.BATCH
    return outputs_lib.BATCH if outputs_lib.BATCH in (kind, before) else kind
