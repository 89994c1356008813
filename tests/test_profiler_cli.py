"""dapple_profile, run as a program: progress per layer, the profile file, clear errors."""


import pytest

import profiler
from tests.programs import run_program

def _run(*args, env=None):
    return run_program("dapple_profile", *args, env=env)


def test_profiles_a_model_with_progress(tmp_path):
    out = tmp_path / "mlp-pbs-8.txt"
    result = _run("--model=mlp", "--model_flags=hidden=16:8", "--batch_size=8", "--runs=1", "--warmup=0",
                  f"--output={out}", env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert result.returncode == 0, result.stderr
    # TF warns when an op a session ran is changed afterwards (an error in a later TF): the profiler changes none
    assert "after it was run by a session" not in result.stderr, result.stderr
    for i, name in enumerate(["dense_0", "dense_1", "head"], start=1):
        assert f"[{i}/3] {name}: forward " in result.stderr
    assert f"wrote {out}: 3 layers" in result.stdout
    profile = profiler.read_profile(str(out))
    assert profile.batch_size == 8
    assert [layer.parameter_bytes for layer in profile.layers] == [(64 * 16 + 16) * 4, (16 * 8 + 8) * 4,
                                                                   (8 * 10 + 10) * 4]
    assert [layer.activation_bytes for layer in profile.layers] == [8 * 16 * 4, 8 * 8 * 4, 4]


@pytest.mark.parametrize("args,message", [
    (["--model=nope", "--output=OUT/p.pbtxt"], "error: unknown model 'nope'; known models: mlp, vgg19"),
    (["--model=mlp", "--output=OUT/missing/p.pbtxt"], "error: OUT/missing/p.pbtxt: cannot write: directory"),
    (["--model=mlp", "--output=OUT/p.pbtxt", "--model_flags=depth=2"], "error: unknown model flag 'depth'"),
])
def test_bad_input_fails_with_one_clear_line(args, message, tmp_path):
    result = _run(*[a.replace("OUT", str(tmp_path)) for a in args])
    assert result.returncode == 1
    assert message.replace("OUT", str(tmp_path)) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "p.pbtxt").exists()


def test_profile_memory_records_kept_bytes_and_the_step_peak(tmp_path):
    from planner.formats.model_profile import ModelProfile

    out = tmp_path / "mlp-pbs-8.pbtxt"
    result = _run("--model=mlp", "--model_flags=hidden=16:8", "--batch_size=8", "--runs=1", "--warmup=0",
                  "--profile_memory", f"--output={out}")
    assert result.returncode == 0, result.stderr
    profile = profiler.read_profile(str(out))
    kept = [layer.backward_kept_bytes for layer in profile.layers]
    # Each activation a backward reads, once: dense_0's ReLU output (8 x 16 floats; its input is the
    # model input, input_bytes = 8 x 64 floats, and its weights are parameters); dense_1's ReLU output
    # (8 x 8; its input, dense_0's output, is counted in dense_0); the head's softmax cross-entropy
    # gradient (8 x 10), computed in the forward.
    assert kept == [8 * 16 * 4, 8 * 8 * 4, 8 * 10 * 4]
    assert profile.layers[0].input_bytes == 8 * 64 * 4
    params = sum(layer.parameter_bytes for layer in profile.layers)
    # The step peak holds the weights, their gradients and more (BFC allocator statistics).
    assert profile.step_peak_bytes > 2 * params
    assert ModelProfile.from_proto(profile).memory_source == "step"


def test_profile_memory_records_the_unrolled_lstm_backward_buffers(tmp_path):
    # GNMT (tiny: hidden 16, 6 steps) at batch 8. An LSTM layer's backward sums the gradients of its
    # 6 per-step slices gates_x[:, t] of the gate tensor [8, 6, 64]: each slice gradient is a dense
    # buffer of the whole gate tensor (8 x 6 x 64 floats), all alive until they are added. This is
    # what the decoder stage held beyond its kept bytes (the 2-stage estimate was 0.68 of measured).
    from planner.planning.memory_model import stage_working_bytes
    from planner.formats.model_profile import ModelProfile

    out = tmp_path / "gnmt-pbs-8.pbtxt"
    result = _run("--model=gnmt", "--batch_size=8", "--runs=1", "--warmup=0", "--profile_memory", f"--output={out}")
    assert result.returncode == 0, result.stderr
    profile = profiler.read_profile(str(out))
    working = {layer.name: layer.backward_working_bytes for layer in profile.layers}
    params = {layer.name: layer.parameter_bytes for layer in profile.layers}
    buffers = 6 * (8 * 6 * 64 * 4)
    for name in ("encoder_lstm_1", "decoder_lstm_1"):
        # the layer's weight gradients are subtracted, though they are computed after the slices' sum
        assert buffers - params[name] <= working[name] <= 2 * buffers, working
    assert working["decoder_embedding"] < 8 * 6 * 16 * 4  # a gather's gradient is its output gradient
    model = ModelProfile.from_proto(profile)
    # the decoder stage (layers 3..6) needs one micro-batch of its largest backward's buffers
    assert stage_working_bytes(model.working_bytes, 3, 7, 8) >= buffers - params["decoder_lstm_1"]
