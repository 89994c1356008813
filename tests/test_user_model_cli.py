"""A user's own model (tests/cli_user_model.py, no markers) through the programs: dapple_profile
--model_fn, dapple_plan on that profile, then build_pipeline with the plan, equal to single-device."""

import pytest
import tensorflow as tf

import dapple_tf
import profiler
from tests import cli_user_model
from tests.pipeline_harness import assert_close_dicts, train_pipelined, train_single
from dapple_tf.model import user_model
from tests.programs import run_program

NAMES = ["mine/hidden1", "mine/hidden2", "mine/logits"]
SGD = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731


@pytest.mark.slow
def test_profile_plan_train_a_users_model(tmp_path):
    profile_path, plan_path = tmp_path / "mine.txt", tmp_path / "plan.json"
    result = run_program("dapple_profile", "--model_fn=tests.cli_user_model:model_fn",
                         "--input_fn=tests.cli_user_model:input_fn", "--scope_depth=2", "--model_name=my-net",
                         "--batch_size=8", "--runs=1", "--warmup=0", f"--output={profile_path}")
    assert result.returncode == 0, result.stderr
    profile = profiler.read_profile(str(profile_path))  # no -pbs- in the name: the file holds it
    assert (profile.model_name, profile.batch_size) == ("my-net", 8)
    assert [layer.name for layer in profile.layers] == NAMES
    assert profile.layers[0].parameter_bytes == cli_user_model.IN * cli_user_model.HIDDEN * 4

    result = run_program("dapple_plan", f"--profile={profile_path}", "--global_batch_size=16", "--cluster=local",
                         "--num_devices=3", f"--output={plan_path}")
    assert result.returncode == 0, result.stderr

    x, y = cli_user_model.input_fn(16, seed=1)
    want_grads, want_weights, _ = train_single(cli_user_model.model_fn, x, y, SGD, 2)
    plan = dapple_tf.Plan.from_file(str(plan_path))
    grads, weights, _, handle, _ = train_pipelined(
        cli_user_model.model_fn, x, y, SGD, plan, None, 2, layers=dapple_tf.layers_by_scope(depth=2)
    )
    assert [name for stage in handle.stages for name in stage.layer_names] == NAMES
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)


@pytest.mark.slow
def test_profile_from_shape_flags_and_a_clear_error(tmp_path):
    out = tmp_path / "flags-pbs-4.pbtxt"
    result = run_program("dapple_profile", "--model_fn=tests.cli_user_model:model_fn", "--features=float32:12",
                         "--labels=int32::4", "--scope_depth=2", "--batch_size=4", "--runs=1", "--warmup=0",
                         f"--output={out}")
    assert result.returncode == 0, result.stderr
    assert [layer.name for layer in profiler.read_profile(str(out)).layers] == NAMES
    result = run_program("dapple_profile", "--model_fn=tests.cli_user_model:model_fn", f"--output={tmp_path / 'x.txt'}")
    assert result.returncode == 1 and "error: --model_fn needs --input_fn, or both --features and --labels" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("spec, message", [
    ("tests.cli_user_model", "--model_fn=tests.cli_user_model: expected package.module:function"),
    ("tests.cli_user_model:nope", "--model_fn=tests.cli_user_model:nope: tests.cli_user_model has no function 'nope'"),
    ("tests.no_such_module:f", "--model_fn=tests.no_such_module:f: cannot import tests.no_such_module"),
])
def test_bad_model_fn_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        user_model.load_function(spec, "model_fn")


def test_shape_flags_make_random_inputs():
    features, labels = user_model.input_values(5, features="float32:3,2", labels="int32::4")
    assert features.shape == (5, 3, 2) and features.dtype.name == "float32"
    assert labels.shape == (5,) and labels.dtype.name == "int32" and set(labels) <= {0, 1, 2, 3}
    with pytest.raises(ValueError, match=r"--labels=int32: expected DTYPE:SHAPE\[:MAX\]"):
        user_model.input_values(5, features="float32:3", labels="int32")
