"""Profiles through the profiler's read/write API: the shipped PipeDream profiles round-trip through
every format with nothing lost, and bad output paths fail with a clear message."""

import glob
import os
import re

import pytest

import models
import profiler
from tests.shared_profiles import PROFILES

SHARED = sorted(glob.glob(PROFILES + "*.txt"))
SHARED = list({os.path.basename(p): p for p in SHARED}.values())
FORMATS = (".txt", ".pb", ".pbtxt", ".json")


def _raw_nodes_and_edges(path):
    """An independent reading of the text: {id: (fwd, bwd, [activations], params, stage)}, edges."""
    nodes, edges = {}, []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            if line[0].isspace():
                edges.append(tuple(part.strip() for part in line.strip().split(" -- ")))
                continue
            parts = line.rstrip("\n").split(" -- ")
            values = re.findall(r"=\s*(\[[^\]]*\]|[^,\s]+)", parts[2])
            acts = [float(v) for v in values[2].strip("[]").split(";")]
            stage = int(parts[3].split("=")[1]) if len(parts) > 3 else None
            nodes[parts[0]] = (float(values[0]), float(values[1]), acts, float(values[3]), stage, parts[1])
    return nodes, edges


@pytest.mark.skipif(not SHARED, reason="no shared profiles (../shared/profiles) next to this checkout")
@pytest.mark.parametrize("path", SHARED, ids=os.path.basename)
@pytest.mark.parametrize("ext", FORMATS)
def test_shared_profiles_round_trip(path, ext, tmp_path):
    original = profiler.read_profile(path)
    nodes, edges = _raw_nodes_and_edges(path)
    # the reading itself kept everything the file says
    assert len(original.layers) == len(nodes)
    assert sorted((s, l.name) for l in original.layers for s in l.inputs) == sorted(edges)
    for layer in original.layers:
        fwd, bwd, acts, params, stage, description = nodes[layer.name]
        assert (layer.forward_ms, layer.backward_ms, layer.parameter_bytes) == (fwd, bwd, params)
        assert layer.activation_bytes == pytest.approx(sum(acts), rel=1e-12)
        assert list(layer.output_activation_bytes) == (acts if len(acts) > 1 else [])
        assert layer.description == description
        assert (layer.has_stage_id, layer.stage_id) == (stage is not None, stage or 0)
    # and writing + reading back changes nothing
    out = tmp_path / (os.path.basename(path)[:-4] + ext)
    profiler.write_profile(original, str(out))
    again = profiler.read_profile(str(out))
    again.source = original.source
    assert again == original


@pytest.fixture(scope="module")
def gnmt_profile():
    return profiler.profile_spec(models.get_model("gnmt"), 2, warmup=0, runs=1)  # has a 2-output layer


@pytest.mark.parametrize("ext", FORMATS)
def test_own_profile_round_trips(ext, tmp_path, gnmt_profile):
    profile = profiler.layer_cost_pb2.LayerCostProfile()
    profile.CopyFrom(gnmt_profile)
    profile.step_peak_bytes = 123456.0
    assert any(len(layer.output_activation_bytes) == 2 for layer in profile.layers)
    out = tmp_path / ("gnmt-pbs-2" + ext)
    profiler.write_profile(profile, str(out))
    again = profiler.read_profile(str(out))
    assert again.batch_size == 2 and again.step_peak_bytes == 123456.0  # .txt: in `<file>.memory`
    if ext == ".txt":  # PipeDream text has no place for these: the step memory and step time stand for them
        for layer in profile.layers:
            layer.backward_kept_bytes = layer.input_bytes = layer.backward_working_bytes = 0
            layer.backward_input_ms = 0
        assert again.step_ms == profile.step_ms > 0  # a `# step_ms=` header
    assert list(again.layers) == list(profile.layers)
    if ext != ".txt":
        assert again == profile


@pytest.mark.parametrize("name,message", [
    ("missing_dir/p.pbtxt", "directory .* does not exist"),
    ("p-pbs-8.txt", r"the file name says batch size 8 but the profile's is 4; name it `...-pbs-4.txt`"),
    ("p.csv", "unknown profile extension '.csv'"),
    ("dir.pbtxt", "it is a directory"),
])
def test_unwritable_outputs_are_rejected(name, message, tmp_path):
    profile = profiler.layer_cost_pb2.LayerCostProfile(batch_size=4)
    profile.layers.add(name="a")
    (tmp_path / "dir.pbtxt").mkdir()
    with pytest.raises(ValueError, match=message):
        profiler.write_profile(profile, str(tmp_path / name))


def test_read_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad-pbs-2.txt"
    bad.write_text("node1 -- x -- forward_compute_time=abc\n")
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ":1:"):
        profiler.read_profile(str(bad))


def test_text_profile_keeps_model_name_and_batch_size_inside_the_file(tmp_path):
    profile = profiler.layer_cost_pb2.LayerCostProfile(model_name="my-net", batch_size=4)
    profile.layers.add(name="a", forward_ms=1.0)
    out = tmp_path / "renamed.txt"  # no -pbs- in the name
    profiler.write_profile(profile, str(out))
    assert out.read_text().startswith("# model_name=my-net\n# batch_size=4\n")
    again = profiler.read_profile(str(out))
    assert (again.model_name, again.batch_size, [layer.name for layer in again.layers]) == ("my-net", 4, ["a"])
    (tmp_path / "wrong-pbs-8.txt").write_text(out.read_text())
    with pytest.raises(ValueError, match=r"wrong-pbs-8.txt:0: the file says batch_size=4 but its name says -pbs-8"):
        profiler.read_profile(str(tmp_path / "wrong-pbs-8.txt"))
