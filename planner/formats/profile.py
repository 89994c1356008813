"""Layer cost profiles: PipeDream's text format, the LayerCostProfile protobuf, and the
planner's in-memory view of a profile.

PipeDream text grammar (one item per line, blank lines ignored):

    # model_name=<name>          (header lines this project writes; other `#` lines are comments)
    # batch_size=<N>
    # step_ms=<ms>                (optional: the profiler's whole-step time, LayerCostProfile.step_ms)
    <id> -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>,
        activation_size=<bytes | [a; b; ...]>, parameter_size=<bytes>[ -- stage_id=<int>]
    <whitespace><src_id> -- <dst_id>

Values are read by position (like PipeDream's graph.py); the four metric keys must all be there, in
this order (a line missing a field is an error naming the file and line). Times are milliseconds for the whole
profile batch, whose size is given by the caller, else the `# batch_size=` header, else the file name
(`-pbs-32`, as PipeDream's own profiles); a header and a file name that disagree are an error. The
model name comes from the `# model_name=` header, else the file name. (PipeDream's own parser does
not know `#` lines: strip them for it.)

Conversion rules (stable; the profiler relies on them):
- layer name = node id ("node3"), description = the node's description text;
- `activation_size=[a; b]` -> output_activation_bytes [a, b], activation_bytes = a + b;
  a scalar -> activation_bytes only (output_activation_bytes stays empty);
- an edge `src -- dst` appends src to dst's `inputs` (file order is kept);
- layers are emitted in a topological order: the file order where it is already topological,
  otherwise Kahn's algorithm preferring earlier file lines; a cycle is an error naming nodes.

Errors are ProfileError (a ValueError) whose message starts with `<path>:<line>:`.
"""

from __future__ import annotations

import heapq
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from planner.formats import SchemaError, layer_cost_pb2, read_message
from planner.formats.memory_figures import SIDE_FILE_SUFFIX, MemoryInputError, side_file_memory

LayerCostProfile = layer_cost_pb2.LayerCostProfile

_PBS_RE = re.compile(r"-pbs-(\d+)")
_METRIC_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


class ProfileError(ValueError):
    """A profile that cannot be read; the message starts with `<path>:<line>:` (`<path>:` alone for
    a cycle in a protobuf profile, which has no lines: the message names the layers on it)."""


def batch_size_from_name(path: str) -> Optional[int]:
    """The profile batch size encoded as `-pbs-N` in a file name, or None."""
    match = _PBS_RE.search(os.path.basename(path))
    return int(match.group(1)) if match else None


def model_name_from_path(path: str) -> str:
    """`.../gnmt-16-pbs-64.txt` -> `gnmt-16`."""
    base = os.path.basename(path)
    base = os.path.splitext(base)[0] if "." in base else base
    return _PBS_RE.split(base)[0] if _PBS_RE.search(base) else base


def _number(text: str, path: str, line_no: int, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ProfileError(f"{path}:{line_no}: {what}: not a number: {text!r}") from None


def _parse_node(line: str, path: str, line_no: int):
    parts = line.split(" -- ")
    stage_id = None
    if len(parts) >= 4 and parts[-1].strip().startswith("stage_id="):
        text = parts.pop().strip()[len("stage_id="):]
        try:
            stage_id = int(text)
        except ValueError:
            raise ProfileError(f"{path}:{line_no}: stage_id: not an integer: {text!r}") from None
    if len(parts) < 3:
        raise ProfileError(
            f"{path}:{line_no}: expected `<id> -- <description> -- forward_compute_time=..., "
            f"backward_compute_time=..., activation_size=..., parameter_size=...`, got {line.strip()!r}"
        )
    node_id = parts[0].strip()
    description = " -- ".join(parts[1:-1])
    metrics = [m.strip() for m in parts[-1].split(",")]
    if len(metrics) != 4 or any("=" not in m for m in metrics):
        raise ProfileError(
            f"{path}:{line_no}: expected 4 comma-separated key=value metrics "
            f"({', '.join(_METRIC_KEYS)}), got {parts[-1].strip()!r}"
        )
    keys = [m.split("=", 1)[0].strip() for m in metrics]
    if keys != list(_METRIC_KEYS):
        missing = [k for k in _METRIC_KEYS if k not in keys]
        raise ProfileError(
            f"{path}:{line_no}: expected the metrics {', '.join(_METRIC_KEYS)} in this order"
            + (f"; missing {', '.join(missing)}" if missing else "") + f", got {parts[-1].strip()!r}"
        )
    values = [m.split("=", 1)[1].strip() for m in metrics]
    fwd = _number(values[0], path, line_no, _METRIC_KEYS[0])
    bwd = _number(values[1], path, line_no, _METRIC_KEYS[1])
    act_text = values[2]
    outputs: List[float] = []
    if act_text.startswith("["):
        if not act_text.endswith("]"):
            raise ProfileError(f"{path}:{line_no}: activation_size: unterminated list {act_text!r}")
        inner = act_text[1:-1].strip()
        outputs = [_number(v.strip(), path, line_no, _METRIC_KEYS[2]) for v in inner.split(";")] if inner else []
        act = float(sum(outputs))
    else:
        act = _number(act_text, path, line_no, _METRIC_KEYS[2])
    params = _number(values[3], path, line_no, _METRIC_KEYS[3])
    if not node_id or any(ch.isspace() for ch in node_id):
        raise ProfileError(f"{path}:{line_no}: bad node id {node_id!r}")
    for name, v in (("forward_compute_time", fwd), ("backward_compute_time", bwd),
                    ("activation_size", act), ("parameter_size", params)):
        if v < 0 or v != v:
            raise ProfileError(f"{path}:{line_no}: {name} must be >= 0, got {v}")
    layer = layer_cost_pb2.LayerCost(
        name=node_id, description=description, forward_ms=fwd, backward_ms=bwd,
        activation_bytes=act, parameter_bytes=params,
    )
    layer.output_activation_bytes.extend(outputs)
    if stage_id is not None:
        layer.stage_id = stage_id
        layer.has_stage_id = True
    return layer


def topological_order(names: Sequence[str], inputs: Dict[str, Sequence[str]]) -> List[str]:
    """Kahn's algorithm preferring earlier positions in `names`; raises ValueError on a cycle.

    The ValueError message lists the nodes on one cycle, e.g. `cycle: node3 -> node4 -> node3`.
    """
    position = {n: i for i, n in enumerate(names)}
    consumers: Dict[str, List[str]] = {n: [] for n in names}
    indegree = {n: 0 for n in names}
    for dst in names:
        for src in inputs.get(dst, ()):
            consumers[src].append(dst)
            indegree[dst] += 1
    ready = [position[n] for n in names if indegree[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = names[heapq.heappop(ready)]
        order.append(n)
        for c in consumers[n]:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(ready, position[c])
    if len(order) < len(names):
        left = {n for n in names if indegree[n] > 0}
        # Walk back along inputs inside `left` until a node repeats: that is a cycle.
        node = min(left, key=position.get)
        seen: List[str] = []
        while node not in seen:
            seen.append(node)
            node = next(s for s in inputs[node] if s in left)
        cycle = seen[seen.index(node):][::-1]
        raise ValueError("cycle: " + " -> ".join(cycle + [cycle[0]]))
    return order


def _is_non_negative(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def _header(text: str, path: str) -> Dict[str, str]:
    """`# key=value` lines at the top of the text (model_name, batch_size)."""
    header = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if not raw.startswith("#"):
            if raw.strip():
                break
            continue
        key, sep, value = raw[1:].strip().partition("=")
        if sep and key.strip() in ("model_name", "batch_size", "step_ms"):
            header[key.strip()] = value.strip()
            if key.strip() == "batch_size" and not value.strip().isdigit():
                raise ProfileError(f"{path}:{line_no}: batch_size: not a positive integer: {value.strip()!r}")
            if key.strip() == "step_ms" and not _is_non_negative(value.strip()):
                raise ProfileError(f"{path}:{line_no}: step_ms: not a non-negative number: {value.strip()!r}")
    return header


def parse_pipedream(text: str, path: str = "<string>", batch_size: Optional[int] = None) -> LayerCostProfile:
    """Parses PipeDream profile text into a LayerCostProfile (layers in topological order).

    `batch_size` defaults to the `# batch_size=` header, else the `-pbs-N` in `path`; ProfileError if
    none gives one, or if the header and the file name disagree.
    """
    header = _header(text, path)
    batch_size = _profile_batch_size(header, path, batch_size)
    layers, order, edges = _nodes_and_edges(text, path)
    inputs, edge_line = _layer_inputs(layers, order, edges, path)
    try:
        topo = topological_order(order, inputs)
    except ValueError as e:
        cycle = str(e)[len("cycle: "):].split(" -> ")
        line_no = edge_line.get((cycle[0], cycle[1]), 0)
        raise ProfileError(f"{path}:{line_no}: {e}") from None
    model_name = header.get("model_name") or model_name_from_path(path)
    profile = LayerCostProfile(model_name=model_name, batch_size=batch_size, source=path,
                               step_ms=float(header.get("step_ms", 0.0)))
    for index, name in enumerate(topo):
        layer = profile.layers.add()
        layer.CopyFrom(layers[name])
        layer.index = index
        layer.inputs.extend(inputs[name])
    return profile


def _profile_batch_size(header: Dict[str, str], path: str, batch_size: Optional[int]) -> int:
    """`batch_size`, else the header's, else the file name's (see parse_pipedream)."""
    in_header = int(header["batch_size"]) if "batch_size" in header else None
    in_name = batch_size_from_name(path)
    if in_header is not None and in_name is not None and in_header != in_name:
        raise ProfileError(f"{path}:0: the file says batch_size={in_header} but its name says -pbs-{in_name}")
    if batch_size is None:
        batch_size = in_header if in_header is not None else in_name
    if batch_size is None:
        raise ProfileError(
            f"{path}:0: no profile batch size: add a `# batch_size=N` line, name the file `...-pbs-N.txt` "
            "or pass batch_size"
        )
    if batch_size < 1:
        raise ProfileError(f"{path}:0: profile batch size must be >= 1, got {batch_size}")
    return batch_size


def _nodes_and_edges(text: str, path: str):
    """({name: layer}, node names in file order, [(src, dst, line)]) of the text's node and edge lines."""
    layers: Dict[str, layer_cost_pb2.LayerCost] = {}
    node_line: Dict[str, int] = {}
    order: List[str] = []
    edges: List[Tuple[str, str, int]] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip() or raw.startswith("#"):
            continue
        if raw[0].isspace():
            parts = [p.strip() for p in raw.strip().split(" -- ")]
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ProfileError(f"{path}:{line_no}: expected an edge `<src> -- <dst>`, got {raw.strip()!r}")
            edges.append((parts[0], parts[1], line_no))
            continue
        layer = _parse_node(raw, path, line_no)
        if layer.name in layers:
            raise ProfileError(f"{path}:{line_no}: node {layer.name} defined twice (first on line {node_line[layer.name]})")
        layers[layer.name] = layer
        node_line[layer.name] = line_no
        order.append(layer.name)
    if not layers:
        raise ProfileError(f"{path}:0: no nodes in profile")
    return layers, order, edges


def _layer_inputs(layers, order: List[str], edges: List[Tuple[str, str, int]], path: str):
    """({layer: its inputs in edge order}, {(src, dst): line}); ProfileError on a bad edge."""
    inputs: Dict[str, List[str]] = {n: [] for n in order}
    edge_line: Dict[Tuple[str, str], int] = {}
    for src, dst, line_no in edges:
        for node in (src, dst):
            if node not in layers:
                raise ProfileError(f"{path}:{line_no}: edge {src} -- {dst} names undefined node {node}")
        if src == dst:
            raise ProfileError(f"{path}:{line_no}: cycle: {src} -> {src}")
        if src in inputs[dst]:
            raise ProfileError(f"{path}:{line_no}: duplicate edge {src} -- {dst}")
        inputs[dst].append(src)
        edge_line[(src, dst)] = line_no
    return inputs, edge_line


def read_pipedream(path: str, batch_size: Optional[int] = None) -> LayerCostProfile:
    """Reads a PipeDream text profile file (see parse_pipedream)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfileError(f"{path}:0: cannot read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}:0: not a text file: {e}") from e
    return parse_pipedream(text, path=path, batch_size=batch_size)


def _num(v: float) -> str:
    return repr(float(v))


def format_pipedream(profile: LayerCostProfile) -> str:
    """PipeDream text for a LayerCostProfile: `# model_name=` and `# batch_size=` header lines, node lines
    in layer order, then edge lines."""
    lines = []
    if profile.model_name:
        if "\n" in profile.model_name:
            raise ProfileError(f"<profile>:0: model name {profile.model_name!r} cannot be written in PipeDream text")
        lines.append(f"# model_name={profile.model_name}")
    if profile.batch_size:
        lines.append(f"# batch_size={profile.batch_size}")
    if profile.step_ms > 0:
        lines.append(f"# step_ms={_num(profile.step_ms)}")
    for layer in profile.layers:
        if "\n" in layer.description or " -- " in layer.name:
            raise ProfileError(f"<profile>:0: layer {layer.name!r} cannot be written in PipeDream text")
        if len(layer.output_activation_bytes):
            act = "[" + "; ".join(_num(v) for v in layer.output_activation_bytes) + "]"
        else:
            act = _num(layer.activation_bytes)
        line = (
            f"{layer.name} -- {layer.description} -- forward_compute_time={_num(layer.forward_ms)}, "
            f"backward_compute_time={_num(layer.backward_ms)}, activation_size={act}, "
            f"parameter_size={_num(layer.parameter_bytes)}"
        )
        if layer.has_stage_id:
            line += f" -- stage_id={layer.stage_id}"
        lines.append(line)
    for layer in profile.layers:
        for src in layer.inputs:
            lines.append(f"\t{src} -- {layer.name}")
    return "\n".join(lines) + "\n"


def write_pipedream(profile: LayerCostProfile, path: str) -> None:
    """Writes format_pipedream(profile) to `path` (ProfileError on I/O failure), and the step memory,
    which the text has no place for, to the side file `<path>.memory` (planner/formats/memory_figures.py).
    Per-layer kept and input bytes are not written: the step memory stands for them; nor the input-gradient
    times (backward_input_ms): write .pbtxt/.pb/.json to keep them."""
    text = format_pipedream(profile)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if profile.step_peak_bytes > 0:
            with open(path + SIDE_FILE_SUFFIX, "w", encoding="utf-8") as f:
                f.write(f"{profile.step_peak_bytes:.0f}B\n")
    except OSError as e:
        raise ProfileError(f"{path}:0: cannot write: {e.strerror}") from e


def validate_profile(profile: LayerCostProfile, path: str = "<profile>") -> LayerCostProfile:
    """Checks names are unique, inputs exist, and layers are in topological order.

    Returns the profile itself, or a re-ordered copy if the layers were not topologically
    ordered (index fields renumbered). Raises ProfileError (`<path>:0: ...`).
    """
    names = [layer.name for layer in profile.layers]
    if not names:
        raise ProfileError(f"{path}:0: profile has no layers")
    seen = set()
    for layer in profile.layers:
        if layer.name in seen:
            raise ProfileError(f"{path}:0: layer {layer.name} appears twice")
        seen.add(layer.name)
    for layer in profile.layers:
        for src in layer.inputs:
            if src not in seen:
                raise ProfileError(f"{path}:0: layer {layer.name} consumes unknown layer {src}")
    if profile.batch_size < 1:
        raise ProfileError(f"{path}:0: profile batch_size must be >= 1, got {profile.batch_size}")
    inputs = {layer.name: list(layer.inputs) for layer in profile.layers}
    try:
        topo = topological_order(names, inputs)
    except ValueError as e:
        raise ProfileError(f"{path}: layers form a {e}") from None
    if topo == names and all(layer.index == i for i, layer in enumerate(profile.layers)):
        return profile
    by_name = {layer.name: layer for layer in profile.layers}
    out = LayerCostProfile()
    out.CopyFrom(profile)
    del out.layers[:]
    for i, name in enumerate(topo):
        layer = out.layers.add()
        layer.CopyFrom(by_name[name])
        layer.index = i
    return out


def load_profile(path: str, batch_size: Optional[int] = None) -> LayerCostProfile:
    """Loads a profile in any supported format: .txt (PipeDream), .pb, .pbtxt, .json.

    Protobuf files are validated (unique names, known inputs, acyclic) and put in
    topological order. Raises ProfileError.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext in (".pb", ".pbtxt", ".json"):
        try:
            profile = read_message(path, LayerCostProfile)
        except SchemaError as e:
            msg = str(e)
            if msg.startswith(path + ":") and not re.match(re.escape(path) + r":\d+:", msg):
                msg = f"{path}:0:" + msg[len(path) + 1:]
            raise ProfileError(msg) from None
        if batch_size is not None:
            profile.batch_size = batch_size
        return validate_profile(profile, path)
    profile = read_pipedream(path, batch_size=batch_size)
    try:
        step = side_file_memory(path)
    except MemoryInputError as e:
        raise ProfileError(f"{path}:0: {e}") from None
    if step:
        profile.step_peak_bytes = step
    return profile
