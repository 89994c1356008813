"""PipeDream text profiles: parse, round trip, topological order, and errors with file:line."""

import glob

import pytest

from planner.formats.model_profile import ModelProfile
from planner.formats.profile import (LayerCostProfile, ProfileError, format_pipedream, load_profile, parse_pipedream,
                             read_pipedream, write_pipedream)
from planner.formats import write_message
from tests.shared_profiles import PROFILES

SHIPPED = sorted(glob.glob(PROFILES + "*.txt"))
NODE = "{} -- {} -- forward_compute_time={}, backward_compute_time=2.0, activation_size={}, parameter_size=8.0"


@pytest.mark.parametrize("path", SHIPPED)
def test_round_trip_shipped(path, tmp_path):
    p = read_pipedream(path)
    assert p == parse_pipedream(format_pipedream(p), path=path)
    out = str(tmp_path / "copy-pbs-{}.txt".format(p.batch_size))
    write_pipedream(p, out)
    q = read_pipedream(out)
    assert list(q.layers) == list(p.layers)


def test_shipped_counts():
    vgg = read_pipedream(PROFILES + "vgg-19-pbs-32.txt")
    assert (vgg.model_name, vgg.batch_size, len(vgg.layers)) == ("vgg-19", 32, 26)
    gnmt = read_pipedream(PROFILES + "gnmt-16-pbs-64.txt")
    names = [l.name for l in gnmt.layers]
    assert names[:4] == ["node1", "node4", "node2", "node5"]  # node2 moved before its consumer node5
    lstm = gnmt.layers[names.index("node7")]
    assert list(lstm.output_activation_bytes) == [9175040.0, 262144.0, 262144.0]
    assert lstm.activation_bytes == 9175040.0 + 2 * 262144.0
    assert list(gnmt.layers[names.index("node43")].inputs) == ["node41", "node42", "node39", "node2"]


def test_stage_id_and_lists_round_trip():
    text = NODE.format("n1", "In", 1.0, "[1.0; 2.0]") + " -- stage_id=3\n" + NODE.format("n2", "D -- x", 0.5, 4) + "\n\tn1 -- n2\n"
    p = parse_pipedream(text, batch_size=4)
    assert p.layers[0].has_stage_id and p.layers[0].stage_id == 3
    assert p.layers[1].description == "D -- x" and not p.layers[1].has_stage_id
    assert list(p.layers[0].output_activation_bytes) == [1.0, 2.0] and p.layers[0].activation_bytes == 3.0
    assert parse_pipedream(format_pipedream(p), batch_size=4) == p


@pytest.mark.parametrize("text,message", [
    ("a -- x -- forward_compute_time=1\n", "t-pbs-2.txt:1: expected 4 comma-separated key=value metrics"),
    (NODE.format("a", "x", "abc", 1) + "\n", "t-pbs-2.txt:1: forward_compute_time: not a number: 'abc'"),
    (NODE.format("a", "x", 1, 1) + "\n\ta -- b\n", "t-pbs-2.txt:2: edge a -- b names undefined node b"),
    (NODE.format("a", "x", 1, 1) + "\n" + NODE.format("b", "y", 1, 1) + "\n\ta -- b\n\tb -- a\n",
     "t-pbs-2.txt:4: cycle: b -> a -> b"),
    (NODE.format("a", "x", 1, 1) + "\n" + NODE.format("a", "y", 1, 1) + "\n",
     "t-pbs-2.txt:2: node a defined twice (first on line 1)"),
    # the last line lacks its final field (parameter_size), another field in its place
    (NODE.format("a", "x", 1, 1) + "\nb -- y -- forward_compute_time=1, backward_compute_time=1, activation_size=4, "
     "stage_id=1", "t-pbs-2.txt:2: expected the metrics forward_compute_time, backward_compute_time, activation_size, "
     "parameter_size in this order; missing parameter_size, got"),
    (NODE.format("a", "x", 1, 1) + "\nb -- y -- forward_compute_time=1, backward_compute_time=1, parameter_size=4, "
     "activation_size=4\n", "t-pbs-2.txt:2: expected the metrics forward_compute_time, backward_compute_time, "
     "activation_size, parameter_size in this order, got"),
])
def test_errors(text, message):
    with pytest.raises(ProfileError) as e:
        parse_pipedream(text, path="t-pbs-2.txt")
    assert str(e.value).startswith(message)


def test_batch_size_required():
    with pytest.raises(ProfileError, match=r"^x.txt:0: no profile batch size: add a `# batch_size=N` line"):
        parse_pipedream(NODE.format("a", "x", 1, 1), path="x.txt")


@pytest.mark.parametrize("ext", [".pb", ".pbtxt", ".json"])
def test_load_profile_proto(tmp_path, ext):
    p = read_pipedream(SHIPPED[0])
    path = str(tmp_path / ("p" + ext))
    write_message(p, path)
    assert load_profile(path) == p


def test_model_profile_per_sample():
    m = ModelProfile.from_proto(read_pipedream(PROFILES + "vgg-19-pbs-32.txt"))
    assert m.forward_ms[1] == pytest.approx(3.4 / 32)
    assert m.last_use[1] == 2 and m.last_use[25] == 25
    # The graph input (node1, `Input`: 3.4 ms forward, 19 MB) is not a layer: no cost, crosses no cut.
    assert m.is_input[0] and not any(m.is_input[1:])
    assert m.forward_ms[0] == 0 and m.kept_bytes[0] == 0 and m.last_use[0] == 0
    assert m.memory_source == "lower_bound" and m.kept_bytes[1] == pytest.approx(384e6 / 32)


def test_proto_cycle_names_layers(tmp_path):
    p = LayerCostProfile(model_name="c", batch_size=2)
    p.layers.add(name="a", inputs=["b"])
    p.layers.add(name="b", inputs=["a"])
    path = str(tmp_path / "c.pbtxt")
    write_message(p, path)
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert str(e.value) == f"{path}: layers form a cycle: b -> a -> b"
