"""Profile and plan messages round-trip through .pb/.pbtxt/.json; bad files name themselves."""

import os
import subprocess
import sys

import pytest

from planner.formats import SchemaError, layer_cost_pb2, plan_pb2, read_message, write_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample_profile():
    profile = layer_cost_pb2.LayerCostProfile(model_name="tiny", batch_size=32, source="test")
    profile.device.name = "/device:CPU:0"
    profile.device.kind = "CPU"
    for i, name in enumerate(["input", "dense1", "dense2", "loss"]):
        layer = profile.layers.add(name=name, index=i, forward_ms=0.5 * i, backward_ms=1.25 * i)
        layer.activation_bytes = 4096.0 * (i + 1)
        layer.output_activation_bytes.extend([1024.0, 3072.0 + 4096.0 * i])
        layer.parameter_bytes = 1e6 * i
        if i:
            layer.inputs.append(profile.layers[i - 1].name)
    profile.layers[3].inputs.append("input")  # a skip edge: layers form a DAG
    profile.layers[2].stage_id = 1
    profile.layers[2].has_stage_id = True
    return profile


def sample_plan():
    plan = plan_pb2.Plan(
        model_name="tiny",
        planner="dapple",
        global_batch_size=64,
        micro_batch_size=16,
        num_micro_batches=4,
        schedule=plan_pb2.DAPPLE,
        policy=plan_pb2.POLICY_A,
        estimated_iteration_ms=12.5,
        warmup_ms=1.0,
        steady_ms=10.0,
        ending_ms=1.5,
        pivot_stage=1,
    )
    plan.cluster.name = "local"
    plan.cluster.num_servers = 1
    plan.cluster.devices_per_server = 3
    plan.cluster.device_names.extend([f"/device:CPU:{i}" for i in range(3)])
    plan.stages.add(first_layer=0, last_layer=1, layer_names=["input", "dense1"], device_ids=[0, 1], warmup_micro_batches=2)
    plan.stages.add(first_layer=2, last_layer=3, layer_names=["dense2", "loss"], device_ids=[2], warmup_micro_batches=1)
    plan.device_peak_memory_bytes.extend([1e6, 1e6, 2e6])
    return plan


@pytest.mark.parametrize("ext", [".pb", ".pbtxt", ".json"])
@pytest.mark.parametrize("make", [sample_profile, sample_plan])
def test_round_trip(tmp_path, ext, make):
    msg = make()
    path = str(tmp_path / ("msg" + ext))
    write_message(msg, path)
    back = read_message(path, type(msg))
    assert back == msg
    assert back.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)


def test_json_uses_proto_field_names(tmp_path):
    path = str(tmp_path / "plan.json")
    write_message(sample_plan(), path)
    text = open(path).read()
    assert '"global_batch_size": 64' in text
    assert '"num_micro_batches": 4' in text
    assert "globalBatchSize" not in text


def test_malformed_text_names_file_and_line(tmp_path):
    path = tmp_path / "bad.pbtxt"
    path.write_text('model_name: "x"\nglobal_batch_size: 4\nno_such_field: 3\n')
    with pytest.raises(SchemaError, match=r"bad\.pbtxt:3: not a valid dapple\.planner\.Plan text proto"):
        read_message(str(path), plan_pb2.Plan)


def test_malformed_json_names_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"global_batch_size": "many"}')
    with pytest.raises(SchemaError, match=r"bad\.json: not a valid dapple\.planner\.Plan JSON file"):
        read_message(str(path), plan_pb2.Plan)


def test_malformed_binary_names_file(tmp_path):
    path = tmp_path / "bad.pb"
    path.write_bytes(b"\xff\xff\xff\xff")
    with pytest.raises(SchemaError, match=r"bad\.pb: not a valid dapple\.profiler\.LayerCostProfile file"):
        read_message(str(path), layer_cost_pb2.LayerCostProfile)


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(SchemaError, match=r"nope\.json: cannot read"):
        read_message(str(tmp_path / "nope.json"), plan_pb2.Plan)
    with pytest.raises(SchemaError, match=r"plan\.yaml: unknown extension '\.yaml'"):
        write_message(sample_plan(), str(tmp_path / "plan.yaml"))


@pytest.mark.primary_only
def test_generated_code_matches_protos():
    pytest.importorskip("grpc_tools")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "gen_protos.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
