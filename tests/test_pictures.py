"""planner.simulation.trace and planner.simulation.gantt: Chrome-trace JSON and PNG Gantt charts of simulated iterations,
and the dapple_simulate CLI that writes them."""

import json
import os
import struct

import pytest

from planner.simulation.gantt import draw_gantt
from planner.formats.schedule import build_schedule
from planner.simulation.simulator import StageCost, simulate
from planner.simulation.trace import write_trace
from tests.shared_profiles import PROFILES, requires_profiles
from tests.programs import run_program

BERT = PROFILES + "bert-48-pbs-2.txt"


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def example(kind="dapple", stages=3, m=4):
    costs = [StageCost(1.0, 2.0, devices=(0, 1), forward_transfer_ms=0.25, allreduce_ms=1.0, optimizer_ms=0.5,
                       static_bytes=1e9, activation_bytes=0.5e9),
             StageCost(1.0, 2.0, devices=(2,), forward_transfer_ms=0.25, allreduce_ms=0.0, optimizer_ms=0.5,
                       static_bytes=1e9, activation_bytes=0.5e9),
             StageCost(1.0, 2.0, devices=(3,), optimizer_ms=0.5, static_bytes=1e9, activation_bytes=0.5e9)]
    return simulate(costs[:stages], build_schedule(stages, m, kind), device_memory_bytes=4e9)


def test_chrome_trace_content(tmp_path):
    r = example()
    path = tmp_path / "t.json"
    boxes = write_trace(r, str(path))
    doc = json.loads(path.read_text())
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    # 4 devices x (4 F + 4 B + 1 optimizer) + sends: 2 cuts x 4 mb x 2 directions, by sender's
    # devices (cut 0 activations from 2 devices, gradients from 1; cut 1: 1 and 1) + AllReduce of stage 0 (2 devices).
    assert boxes == len(x) == 4 * 9 + (4 * 2 + 4 + 4 + 4) + 2
    names = {(e["pid"], e["name"]) for e in x if e["cat"] in ("forward", "backward")}
    assert len(names) == 4 * 8 and (3, "F3") in names and (0, "B0") in names
    assert {e["pid"] for e in x} == {0, 1, 2, 3}
    assert {e["tid"] for e in x if e["cat"] == "send_activation"} == {1}
    assert {e["tid"] for e in x if e["cat"] == "allreduce"} == {2}
    processes = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert processes == {0: "device 0 (stage 0)", 1: "device 1 (stage 0)", 2: "device 2 (stage 1)",
                         3: "device 3 (stage 2)"}
    f0 = next(e for e in x if e["pid"] == 2 and e["name"] == "F0")
    assert (f0["ts"], f0["dur"], f0["args"]["micro_batch"]) == (1250.0, 1000.0, 0)  # microseconds
    end = max(e["ts"] + e["dur"] for e in x)
    assert end == pytest.approx(r.iteration_ms * 1000)
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C" and e["pid"] == 3]
    assert max(c["args"]["GiB"] for c in counters) == pytest.approx(1.5e9 / 2**30, abs=1e-4)


def test_gantt_png_rows_and_boxes(tmp_path):
    gpipe, dapple = example("gpipe"), example("dapple")
    path = tmp_path / "g.png"
    info = draw_gantt([gpipe, dapple], str(path))
    assert info.rows == [4, 4]
    assert info.boxes["forward"] == info.boxes["backward"] == 2 * 4 * 4
    assert info.boxes["optimizer"] == 2 * 4
    # Sends are drawn on the sender's devices: activations from stages 0 (2 devices) and 1,
    # gradients from stages 1 and 2.
    assert info.boxes["send_activation"] == 2 * 4 * 3
    assert info.boxes["send_gradient"] == 2 * 4 * 2
    assert info.boxes["allreduce"] == 2 * 2
    assert info.labels == 2 * 4 * 8  # every forward/backward box carries its micro-batch id
    assert png_size(str(path)) == (info.width_px, info.height_px)
    assert info.width_px == 1200 and info.height_px > 600
    assert os.path.getsize(path) > 20000


def test_gantt_skips_labels_in_thin_boxes(tmp_path):
    r = example("dapple", stages=2, m=64)
    info = draw_gantt(r, str(tmp_path / "thin.png"), memory=False, width_in=4, dpi=50)
    assert info.rows == [3]
    assert info.boxes["forward"] == 3 * 64
    assert info.labels == 0  # 1 ms of ~200 ms on 160 px: no room for an id


def test_gantt_errors(tmp_path):
    with pytest.raises(ValueError, match="draw_gantt needs at least one simulation result"):
        draw_gantt([], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="got 1 titles for 2 charts"):
        draw_gantt([example(), example()], str(tmp_path / "x.png"), titles=["one"])


@requires_profiles
def test_simulate_cli_writes_trace_and_png(tmp_path):
    from planner.formats.cluster import preset_cluster
    from planner.planning.plan_eval import Options, evaluate, to_plan
    from planner.formats.model_profile import ModelProfile
    from planner.formats.profile import load_profile
    from planner.planning import cost_model as cm
    from planner.formats import write_message

    model = ModelProfile.from_proto(load_profile(BERT))
    cut = model.descriptions.index("layer_24")
    stages = [(0, cut, (0,)), (cut, model.num_layers, (1,))]
    est = evaluate(model, cm.Prefix(model), preset_cluster("paper_b"), stages, 16, 2, Options())
    plan_path = tmp_path / "plan.json"
    write_message(to_plan(est, model, preset_cluster("paper_b"), 16, "manual"), str(plan_path))
    trace, png = tmp_path / "out.json", tmp_path / "out.png"
    result = run_program("dapple_simulate", f"--profile={BERT}", f"--plan={plan_path}", "--schedule=gpipe",
                         f"--trace={trace}", f"--png={png}", timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "plan: manual planner, 2 stages (1:1 devices), global batch 16 = 8 x 2" in out
    assert "gpipe schedule, S=2, M=8, K=[8, 8], micro-batch size 2" in out
    assert "analytic " in out and "simulated " in out
    # 2 devices x (8 F + 8 B + optimizer) + 8 activations + 8 gradients; no AllReduce (1 device per stage).
    assert f"wrote {trace} (50 boxes)" in out
    assert f"wrote {png} (2 rows, 50 boxes)" in out
    doc = json.loads(trace.read_text())
    assert sum(1 for e in doc["traceEvents"] if e["ph"] == "X") == 50
    assert png_size(str(png))[0] == 1200
    # the same plan's interleaved variant: each device runs two stages, 2 rows still
    result = run_program("dapple_simulate", f"--profile={BERT}", f"--plan={plan_path}", "--schedule=interleaved",
                         f"--png={png}", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "plan: manual planner, 4 stages (1:1:1:1 devices), global batch 16 = 8 x 2" in result.stdout
    assert "interleaved schedule, S=4, M=8, K=[5, 3], micro-batch size 2" in result.stdout
    assert "analytic" not in result.stdout  # formula 2 costs the plan's own partition, not the variant
    # 2 devices x 2 stages x (8 F + 8 B + optimizer) + 3 cuts x (8 activations + 8 gradients)
    assert f"wrote {png} (2 rows, 116 boxes)" in result.stdout
    result = run_program("dapple_simulate", f"--profile={BERT}", f"--plan={plan_path}", "--schedule=interleaved",
                         "--virtual_stages=1", timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the plan has no interleaved variant: an interleaved variant needs at least 2 stages per device group, "
        "got 1")


def test_simulate_cli_errors():
    result = run_program("dapple_simulate", "--global_batch_size=8", timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "error: --profile is required"
