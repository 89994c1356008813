"""Profiles a model marked with dapple_tf.layer, layer by layer, on one local device.

Method. The model is built once, at the profile batch size, on the requested device, inside a fresh
LayerRecorder. One run of the whole forward pass (fed synthetic or given inputs) records the value
of every tensor that crosses a layer boundary. Then, for each layer i:
- forward: `sess.run([ops producing outputs_i], feed_dict={inputs_i: recorded values})`. TF1
  sessions prune the graph at fed tensors, so this runs exactly layer i's ops (nothing is fetched).
- backward: `tf.gradients(float outputs_i, differentiable inputs_i + variables_i, grad_ys=random,
  stop_gradients=inputs_i)`, run with the inputs and every forward tensor of layer i that the
  gradient ops read fed with recorded values, so only gradient ops run (no forward recomputation).
  An input is differentiable only if a real training step computes its gradient: a float computed
  from a trainable variable (not the features, nor e.g. an attention mask computed from them).
Timing, in interleaved rounds (profiler/rounds.py): the model is opened at every requested batch size, and each
round takes every measurement of every size once, in turn, so that the machine's slow and fast moments fall on
all of them alike; a time is the median over the rounds, and each profile keeps its whole step per round and their
relative spread. One measurement: `warmup` untimed runs, then `runs` timed runs alternating with runs of a no-op
fed the same feed dict (the per-run dispatch and feeding cost, which a real training step does not pay per layer),
the difference of their medians (clamped at 0), so that the sum of a profile's forward+backward times estimates
one training step's compute (tests/test_profiler.py checks it is within 30%).
Memory kept for backward (backward_kept_bytes): the bytes of the activations layer i's gradient ops
read from the forward pass (its inputs and its own intermediates), from the recorded values, each
tensor once: not in a later layer that reads it too (a layer's output, read by its own gradient and
by the next layer's, is counted in the first), not the model inputs (input_bytes) and not the weights
(nor values computed from them alone: counted with the parameters). With
step_memory, from TF's allocator statistics (profiler/memory.py): one whole forward+backward step's
peak (step_peak_bytes) and, per layer, what its backward allocates at its peak beyond the fed forward
values and its dense weight gradients (backward_working_bytes: input gradients and temporaries, e.g.
an unrolled LSTM's per-step slice gradients, each a dense buffer of the whole gate tensor until they
are summed; the weight gradients are counted with the parameters).
Input gradients (backward_input_ms): the backward's operations the layer's input gradients need
alone (the B part of a zero-bubble B/W split; the rest computes weight gradients).
Whole step (step_ms): one forward + backward of the whole model with every weight gradient added to an
accumulator, as the runtime runs each micro-batch: it holds what layer-by-layer runs miss (layers
evicting each other's weights from the caches, the accumulation), and the planner scales the layer
times to sum to it (planner/formats/model_profile.py).
Sizes are exact: activation bytes = bytes of every tensor leaving the layer (its recorded values;
per tensor in output_activation_bytes when there are several); parameter bytes = shape x dtype size
of the layer's trainable variables. The DAG: layer j is an input of layer i when i consumes a tensor
j produced. Analysis of the graph: profiler/analysis.py.
"""

import collections
import contextlib
import dataclasses
import os
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from dapple_tf.model import minimize as minimize_lib
from dapple_tf.model.layers import LayerRecorder
from dapple_tf.rewrite.template.outputs import split_model_result
from planner.formats import layer_cost_pb2
from profiler.analysis import analyze_layers, tensor_bytes
from profiler.memory import backward_working_bytes, step_peak_bytes
from profiler import rounds as rounds_lib
from profiler.timing import overhead_probe, round_ms


def session_config(device: str, threads: int = 0) -> tf.compat.v1.ConfigProto:
    """A ConfigProto with enough virtual CPU devices for `device` (CPU:k needs k + 1).

    threads > 0 sets the intra- and inter-op thread pools to that size (0: TF's default).
    """
    spec = tf.DeviceSpec.from_string(device)
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False, intra_op_parallelism_threads=threads,
                                      inter_op_parallelism_threads=threads)
    if (spec.device_type or "").upper() == "CPU":
        config.device_count["CPU"] = (spec.device_index or 0) + 1
    return config


def _check_device(sess, device):
    spec = tf.DeviceSpec.from_string(device)
    if not spec.device_type:
        raise ValueError(f"device {device!r} names no device type; use e.g. /device:CPU:0")
    wanted = (spec.device_type.upper(), spec.device_index or 0)
    for d in sess.list_devices():
        ds = tf.DeviceSpec.from_string(d.name)
        if (ds.device_type.upper(), ds.device_index) == wanted:
            return d
    names = ", ".join("/device:" + d.name.split("/device:")[-1] for d in sess.list_devices())
    raise ValueError(f"device {device!r} is not available here; available: {names}")


def _device_description(device_attrs, device):
    spec = tf.DeviceSpec.from_string(device)
    kind = spec.device_type.upper()
    memory = float(device_attrs.memory_limit_bytes) if kind != "CPU" else 0.0
    if kind == "CPU" and hasattr(os, "sysconf"):
        try:
            memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            pass
    name = f"/device:{kind}:{spec.device_index or 0}"
    return layer_cost_pb2.DeviceDescription(name=name, kind=kind, memory_bytes=memory)


def _dependent_ops(graph, sources):
    """Names of the ops whose outputs depend on the ops named in `sources` (and those)."""
    dependent = set(sources)
    for op in graph.get_operations():  # creation order is a topological order
        if any(t.op.name in dependent for t in op.inputs):
            dependent.add(op.name)
    return dependent


def _variable_dependent_ops(graph):
    """Names of the ops whose outputs depend on a trainable variable (a training step's gradient reaches them)."""
    return _dependent_ops(graph, {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)})


@dataclasses.dataclass(frozen=True)
class _Timing:
    """How each measurement is taken in a round: `warmup` untimed runs, then the median of `runs` on `clock`,
    less the probe's (profiler/timing.py round_ms)."""

    warmup: int
    runs: int
    clock: str

    def measure(self, sess, target, probe, feed) -> Callable[[], float]:
        return lambda: round_ms(sess, target, probe, feed, self.warmup, self.runs, self.clock)


@dataclasses.dataclass
class _ModelGraph:
    """The model built once for profiling: its layers, their backward targets and the whole-step targets."""

    graph: tf.Graph
    input_tensors: list
    infos: list
    backward: list
    weight_only: set
    step_grads: list
    step_target: "_AccumulatedStep"
    init: tf.Operation


@dataclasses.dataclass
class _LayerRun:
    """What measuring one layer shares with the others: the session, timing and every boundary value."""

    sess: tf.compat.v1.Session
    probe: object
    timing: _Timing
    values: dict
    model_inputs: set
    weight_only: set
    rng: np.random.Generator
    device: str
    step_memory: bool
    counted: set = dataclasses.field(default_factory=set)  # kept tensors already counted by an earlier layer


def profile_model(model_fn: Callable, make_inputs: Callable, input_values, batch_size: int,
                  device: str = "/device:CPU:0", **kwargs) -> layer_cost_pb2.LayerCostProfile:
    """Measures `model_fn(features, labels) -> loss` layer by layer at one batch size; returns a LayerCostProfile.

    `make_inputs()` makes the (features, labels) tensors (placeholders) of batch `batch_size`; `input_values` are
    numpy values of the same structure; the keyword arguments are profile_models'."""
    return profile_models(model_fn, {batch_size: (make_inputs, input_values)}, device, **kwargs)[batch_size]


def profile_models(model_fn: Callable, inputs: Dict[int, Tuple[Callable, object]], device: str = "/device:CPU:0",
                   warmup: int = 1, runs: int = 2, rounds: int = 5, model_name: str = "model",
                   progress: Optional[Callable] = None, round_progress: Optional[Callable] = None, seed: int = 0,
                   clock: str = "wall", threads: int = 0, layers=None,
                   step_memory: bool = False) -> Dict[int, layer_cost_pb2.LayerCostProfile]:
    """Profiles of `model_fn` at several batch sizes ({batch size: (make_inputs, input_values)}), measured side by
    side: the model is built and opened at every size, then `rounds` rounds each time every layer's forward,
    backward and input-gradient backward and the whole step at every size once (profiler/rounds.py); each time is
    the median over the rounds, and each profile records its whole step per round and their relative spread.
    A round's measurement: `warmup` untimed runs, then the median of `runs` timed runs less that of as many no-op
    runs under the same feeds. `progress(i, n, layer_cost)` is called per layer at the end (i from 1; several
    sizes: the first size's layers), `round_progress(r, rounds, {size: step ms})` after each round.
    `clock`: "wall" (elapsed time, the default) or "cpu" (process CPU time, for shared machines);
    `threads`: TF thread-pool sizes (0: default). `layers`: None (dapple_tf.layer markers) or
    dapple_tf.layers_by_scope(...), as given to build_pipeline. model_fn may also return (loss, {name: tensor}).
    `step_memory`: also measure one forward+backward step's peak memory (step_peak_bytes) and each
    layer's backward_working_bytes (profiler/memory.py). Raises LayerMarkerError (a ValueError) for
    a model that breaks the marker contract and ValueError for an unavailable device.
    """
    timing = _Timing(warmup, runs, clock)
    with contextlib.ExitStack() as stack:
        opened = {size: _open_size(stack, model_fn, make, values, size, device, timing, model_name, seed, threads,
                                   layers, step_memory, rounds)
                  for size, (make, values) in sorted(inputs.items())}
        measures = {(size, key): measure for size, o in opened.items() for key, measure in o.measures.items()}

        def after_round(r, samples):
            if round_progress:
                round_progress(r, rounds, {size: samples[(size, "step")][-1] for size in opened})

        samples = rounds_lib.measure_in_rounds(measures, rounds, after_round)
    for i, (size, o) in enumerate(opened.items()):
        _fill_times(o.profile, {key: samples[(size, key)] for key in o.measures})
        if progress and i == 0:
            for layer in o.profile.layers:
                progress(layer.index + 1, len(o.profile.layers), layer)
    return {size: o.profile for size, o in opened.items()}


@dataclasses.dataclass
class _Opened:
    profile: layer_cost_pb2.LayerCostProfile  # every field but the times
    measures: Dict[object, Callable[[], float]]  # (layer index, kind) or "step" -> one round's measurement


def _open_size(stack, model_fn, make_inputs, input_values, batch_size, device, timing, model_name, seed, threads,
               layers, step_memory, rounds) -> _Opened:
    """The model built and opened at `batch_size`: its profile's sizes, memory and DAG, and what to time."""
    model = _build_model_graph(model_fn, make_inputs, device, seed, layers)
    base_feed = dict(zip(model.input_tensors, tf.nest.flatten(input_values)))
    profile = layer_cost_pb2.LayerCostProfile(
        model_name=model_name, batch_size=batch_size, timing_rounds=rounds,
        source=f"dapple_tf profiler, {rounds} interleaved rounds of {timing.warmup} warm-up + median of "
               f"{timing.runs} runs")
    sess = stack.enter_context(tf.compat.v1.Session(graph=model.graph, config=session_config(device, threads)))
    attrs = _check_device(sess, device)
    profile.device.CopyFrom(_device_description(attrs, device))
    sess.run(model.init)
    probe = overhead_probe(model.graph, device)
    boundary = {t.name: t for info in model.infos for t in info.inputs + info.outputs}
    names = sorted(boundary)
    values = dict(zip(names, sess.run([boundary[n] for n in names], feed_dict=base_feed)))
    run = _LayerRun(sess, probe, timing, values, {t.name for t in model.input_tensors}, model.weight_only,
                    np.random.default_rng(seed), device, step_memory)
    measures = {}
    for info, bwd in zip(model.infos, model.backward):
        measures.update(_open_layer(profile, run, info, bwd, model.infos))
    sess.run(model.step_target.initializer)
    measures["step"] = timing.measure(sess, model.step_target.ops, probe, base_feed)
    if step_memory:
        profile.step_peak_bytes = step_peak_bytes(sess, model.step_grads, base_feed, device,
                                                  sum(layer.parameter_bytes for layer in profile.layers))
    return _Opened(profile, measures)


def _fill_times(profile: layer_cost_pb2.LayerCostProfile, samples) -> None:
    """Each time the median of its rounds; the whole step's rounds and their spread recorded."""
    for layer in profile.layers:
        for kind in ("forward", "backward", "backward_input"):
            if (layer.index, kind) in samples:
                setattr(layer, f"{kind}_ms", rounds_lib.median_and_spread(samples[(layer.index, kind)])[0])
        layer.backward_input_ms = min(layer.backward_input_ms, layer.backward_ms)
    profile.step_ms, profile.relative_spread = rounds_lib.median_and_spread(samples["step"])
    profile.step_ms_rounds.extend(samples["step"])


def _build_model_graph(model_fn, make_inputs, device, seed, layers) -> _ModelGraph:
    """Builds the model once at the profile batch on `device`, with each layer's backward and the whole step."""
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        tf.compat.v1.set_random_seed(seed)
        features, labels = make_inputs()
        first_model_op = len(graph.get_operations())
        recorder = layers.recorder(graph) if layers is not None else LayerRecorder(graph)
        with recorder.activate(), minimize_lib.trace(graph):  # dapple_tf.minimize's request is not used here
            result, _ = minimize_lib.spec_parts(minimize_lib.training_model_fn(model_fn)(features, labels))
            loss, _ = split_model_result(result)
        if not isinstance(loss, tf.Tensor):
            raise ValueError(f"model_fn must return the loss tensor, got {type(loss).__name__}")
        input_tensors = tf.nest.flatten((features, labels))
        model_ops = graph.get_operations()[first_model_op:]
        if layers is not None:  # scope layers hold every op related to a layer; heads the loss does not use go
            recorder.drop_layers_unused_by(loss)
            model_ops = ()
        infos = analyze_layers(recorder, loss, model_ops, input_tensors)
        # weights and values computed from them alone: counted with the parameters, not as kept activations
        weight_only = _variable_dependent_ops(graph) - _dependent_ops(graph, {t.op.name for t in input_tensors})
        backward = _build_backward(infos)
        trainable = tf.compat.v1.trainable_variables()
        pairs = [(g, v) for g, v in zip(tf.gradients(loss, trainable), trainable) if g is not None]
        step_target = _AccumulatedStep(pairs)
        init = tf.compat.v1.global_variables_initializer()
    return _ModelGraph(graph, input_tensors, infos, backward, weight_only, [g for g, _ in pairs], step_target, init)


def _open_layer(profile, run: _LayerRun, info, bwd, infos) -> Dict[object, Callable[[], float]]:
    """Adds layer `info`'s LayerCost (sizes, memory, DAG) to `profile`; returns what to time of it."""
    values, model_inputs = run.values, run.model_inputs
    feed = {t: values[t.name] for t in info.inputs}
    measures = {}
    fwd_target = sorted({t.op for t in info.outputs}, key=lambda op: op.name)  # run, not fetched
    if fwd_target:
        measures[(info.index, "forward")] = run.timing.measure(run.sess, fwd_target, run.probe, feed)
    kept = working = 0.0
    if bwd is not None:
        kept, working, backward = _open_backward(run, bwd, feed)
        measures.update({(info.index, kind): m for kind, m in backward.items()})
    layer = profile.layers.add(
        name=info.name, index=info.index, description=_describe(info), backward_kept_bytes=kept,
        backward_working_bytes=working,
        input_bytes=float(sum(values[t.name].nbytes for t in info.inputs if t.name in model_inputs)),
        activation_bytes=float(sum(values[t.name].nbytes for t in info.outputs)),
        parameter_bytes=float(sum(tensor_bytes(v) for v in info.variables)),
        inputs=[infos[j].name for j in info.input_layers])
    if len(info.outputs) > 1:
        layer.output_activation_bytes.extend(float(values[t.name].nbytes) for t in info.outputs)
    return measures


def _open_backward(run: _LayerRun, bwd: "_Backward", feed):
    """(kept bytes, working bytes, {"backward": measure, "backward_input": measure}) of one layer's backward."""
    values = run.values
    forward_values = run.sess.run(bwd.fed_forward, feed_dict=feed) if bwd.fed_forward else []
    # Kept for backward: the activations this layer's gradient ops read, each counted once.
    read = list(zip(bwd.fed_forward, forward_values)) + [(t, values[t.name]) for t in bwd.read_inputs]
    kept_now = {t.name: v.nbytes for t, v in read
                if t.op.name not in run.weight_only and t.name not in run.model_inputs and t.name not in run.counted}
    run.counted.update(kept_now)
    kept = float(sum(kept_now.values()))
    bwd_feed = dict(zip(bwd.fed_forward, forward_values))
    bwd_feed.update(feed)
    for ph, out in bwd.grad_ys:
        bwd_feed[ph] = (run.rng.standard_normal(values[out.name].shape) * 1e-3).astype(ph.dtype.as_numpy_dtype)
    measures = {"backward": run.timing.measure(run.sess, bwd.target, run.probe, bwd_feed)}
    if bwd.input_target:
        measures["backward_input"] = run.timing.measure(run.sess, bwd.input_target, run.probe, bwd_feed)
    working = 0.0
    if run.step_memory:
        working = max(backward_working_bytes(run.sess, bwd.target, run.probe, bwd_feed, run.device)
                      - bwd.weight_grad_bytes, 0.0)
    return kept, working, measures


class _AccumulatedStep:
    """One forward + backward step whose weight gradients are each added to an accumulator's value."""

    def __init__(self, grads_and_vars):
        self.accumulators = [
            tf.Variable(tf.zeros(v.shape, v.dtype.base_dtype), trainable=False, name="profiler_accumulator",
                        collections=[]) for _, v in grads_and_vars]
        sums = [tf.convert_to_tensor(g) + a.read_value() for (g, _), a in zip(grads_and_vars, self.accumulators)]
        # built with the graph: grouping the initializers later marks them (control dependencies), which TF calls
        # a mutation of ops a session already ran
        self.initializer = tf.compat.v1.variables_initializer(self.accumulators)
        self.ops = [s.op for s in sums]  # run, not fetched (a group of them would be pruned away)


_Backward = collections.namedtuple(
    "_Backward", "target fed_forward grad_ys read_inputs weight_grad_bytes input_target")


def _build_backward(infos):
    """Per layer: a _Backward (gradient target ops, forward tensors to feed, [(grad_ys placeholder, output)],
    the layer's inputs its gradient ops read, bytes of its dense weight gradients, the target ops of
    its input gradients alone) or None."""
    graph = tf.compat.v1.get_default_graph()
    dependent = _variable_dependent_ops(graph)
    result = []
    for info in infos:
        xs = [t for t in info.inputs if t.dtype.is_floating and t.op.name in dependent]
        xs += info.variables
        ys = [t for t in info.outputs if t.dtype.is_floating]
        if not xs or not ys:
            result.append(None)
            continue
        first = len(graph.get_operations())
        with tf.name_scope(f"profiler_backward/{info.name}"):
            grad_ys = []
            for y in ys:
                if y.shape.ndims == 0 and info is infos[-1]:
                    grad_ys.append(None)  # the loss: d loss / d loss = 1
                else:
                    grad_ys.append(tf.compat.v1.placeholder(y.dtype, y.shape, name="grad_y"))
            # stop at the layer's inputs: the gradient must not flow on into earlier layers
            grads = tf.gradients(ys, xs, grad_ys=grad_ys, stop_gradients=list(info.inputs))
            # dense weight gradients: the planner counts them with the parameters (2 x weights)
            weight_grad_bytes = sum(tensor_bytes(v) for v, g in zip(info.variables, grads[-len(info.variables):])
                                    if isinstance(g, tf.Tensor)) if info.variables else 0
            input_grads = [g for g in grads[:len(grads) - len(info.variables)] if g is not None]
            grads = [g for g in grads if g is not None]
            if not grads:
                result.append(None)
                continue
            target = _ops_of(grads)
            input_target = _ops_of(input_grads)
        new_ops = {op.name for op in graph.get_operations()[first:]}
        own = {op.name for op in info.ops} | {t.op.name for t in info.inputs}
        input_names = {t.name for t in info.inputs}
        fed = {}
        for op in graph.get_operations()[first:]:
            for t in op.inputs:
                if (t.op.name not in new_ops and t.op.name in own and t.name not in input_names
                        and t.dtype != tf.resource and t.dtype != tf.variant and graph.is_feedable(t)):
                    fed[t.name] = t
        read_inputs = {t.name: t for op in graph.get_operations()[first:] for t in op.inputs if t.name in input_names}
        pairs = [(ph, y) for ph, y in zip(grad_ys, ys) if ph is not None]
        result.append(_Backward(target, [fed[n] for n in sorted(fed)], pairs, [read_inputs[n] for n in sorted(read_inputs)],
                                weight_grad_bytes, input_target))
    return result


def _ops_of(grads):
    return sorted({g.op if isinstance(g, tf.Tensor) else g.values.op for g in grads}, key=lambda op: op.name)


def _describe(info):
    kinds = sorted({op.type for op in info.ops if op.type in _HEAVY})
    return f"{info.name} ({', '.join(kinds) or 'elementwise'}; {len(info.ops)} ops)"


_HEAVY = {"MatMul", "BatchMatMulV2", "Conv2D", "MaxPool", "AvgPool", "GatherV2", "ResourceGather",
          "Softmax", "SparseSoftmaxCrossEntropyWithLogits", "Tanh", "Sigmoid", "Relu", "Mean"}
