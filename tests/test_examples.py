"""examples/keras_classifier.py (plain Keras layers, no markers, a numpy input_fn) runs as written, and
dapple_train trains the same module from the command line (run from its folder)."""

import os
import re
import subprocess
import sys

import pytest

from planner.formats import plan_pb2, write_message
from dapple_tf.model import user_model
from scripts.cli import requested_verbosity
from tests.programs import ROOT, run_program

EXAMPLES = os.path.join(ROOT, "examples")


def losses(output):
    return [float(v) for v in re.findall(r"step \d+/\d+\s+loss ([0-9.]+)", output)]


# ~4 s (10 s on a loaded machine): profile, plan and 60 steps in a fresh interpreter
def test_keras_example_runs_as_written():
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "keras_classifier.py")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    profiled = re.search(r"profiled: (.*)", result.stdout).group(1)
    assert [item.split()[0] for item in profiled.split(", ")][:2] == ["dense", "layer_normalization"]
    assert len(profiled.split(", ")) == 4  # one layer per Keras layer (Keras 3 too), the loss in the last
    assert "trained 60 steps" in result.stdout
    seen = losses(result.stdout)
    assert len(seen) == 3 and seen[-1] < seen[0] - 0.2


def two_stage_plan(path):
    """Layers 0..1 replicated on 2 devices, layers 2..3 on a third, M=2, global batch 32."""
    plan = plan_pb2.Plan(num_micro_batches=2, global_batch_size=32)
    plan.cluster.device_names.extend([f"/device:CPU:{i}" for i in range(3)])
    plan.stages.add(first_layer=0, last_layer=1, device_ids=[0, 1])
    plan.stages.add(first_layer=2, last_layer=3, device_ids=[2])
    write_message(plan, str(path))
    return path


def one_device_plan(path):
    """Every layer on one device, M=1: the single-device training the pipelined runs must equal."""
    plan = plan_pb2.Plan(num_micro_batches=1, global_batch_size=32)
    plan.cluster.device_names.append("/device:CPU:0")
    plan.stages.add(first_layer=0, last_layer=3, device_ids=[0])
    write_message(plan, str(path))
    return path


def train_example(tmp_path, name, *args):
    result = run_program("dapple_train", "--model_fn=keras_classifier:model_fn", "--input_fn=keras_classifier:input_fn",
                         "--scope_depth=1", "--global_batch_size=32", "--steps=30", "--log_every=10",
                         "--learning_rate=0.05", f"--model_dir={tmp_path / name}", *args, cwd=EXAMPLES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: step 30" in result.stdout
    return result


# ~3-4 s per run (up to 17 s on a loaded machine)
def test_dapple_train_trains_a_marker_free_keras_module_with_a_numpy_input_fn(tmp_path):
    """Profiled and planned from the command line, and with a 2:1 plan (M=2): both log the losses of the same
    module trained on one device, M=1 (the printed 4 decimals)."""
    single = losses(train_example(tmp_path, "single", f"--plan={one_device_plan(tmp_path / 'one.json')}",
                                  "--num_devices=1").stdout)
    assert len(single) == 3 and single[-1] < single[0]
    two = train_example(tmp_path, "two", f"--plan={two_stage_plan(tmp_path / 'plan.json')}", "--num_devices=3")
    assert "2 stages (2:1 devices), M=2, global batch 32" in two.stdout
    assert losses(two.stdout) == single
    planned = train_example(tmp_path, "planned", "--num_devices=2")
    assert losses(planned.stdout) == single


TF_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] |[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] )",
                         re.M)  # TensorFlow's C++ log lines: TF 2.15's format, then absl's (TF 2.16 and later)
# TF 2.16 and later print this at import whatever the level: absl logs it before TF initializes its logging
IMPORT_NOTICE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called .*|"
                           r"I0000 [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on.*)\n", re.M)


# ~8 s: profile, plan, 20 steps (traced at each logged one), then one step with --verbosity=0
def test_dapple_train_prints_only_its_own_lines_unless_verbosity_asks(tmp_path):
    """Without TF_CPP_MIN_LOG_LEVEL in the environment (a user's shell): no TensorFlow log line on either stream
    (it printed 14 on stderr, five profiler_session lines per logged step among them); --verbosity=0 shows them."""
    common = ("--model_fn=keras_classifier:model_fn", "--input_fn=keras_classifier:input_fn", "--scope_depth=1",
              "--global_batch_size=32", "--num_devices=2")
    quiet = run_program("dapple_train", *common, "--steps=20", f"--model_dir={tmp_path / 'quiet'}", cwd=EXAMPLES,
                        env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert IMPORT_NOTICE.sub("", quiet.stderr) == ""
    assert not TF_LOG_LINE.search(quiet.stdout)
    lines = quiet.stdout.splitlines()
    assert lines[0].startswith("profiling keras_classifier:model_fn") and lines[-1].startswith("done: step 20")
    # profiling, the plan (10 lines, and a line of ties where the profile's noise makes some), training, 2 logged
    # steps, done
    assert len([line for line in lines if not line.startswith("  ties:")]) == 15
    verbose = run_program("dapple_train", *common, "--steps=1", f"--model_dir={tmp_path / 'verbose'}",
                          f"--plan={one_device_plan(tmp_path / 'one.json')}", "--verbosity=0", cwd=EXAMPLES,
                          env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "done: step 1" in verbose.stdout
    assert TF_LOG_LINE.search(IMPORT_NOTICE.sub("", verbose.stderr))


@pytest.mark.parametrize("args, level", [
    ([], -1), (["--steps=3"], -1), (["--verbosity=0"], 0), (["--verbosity", "1"], 1), (["-v", "0"], 0), (["-v=2"], 2),
    (["-verbosity=0"], 0), (["--v=1"], 1), (["--verbosity=x"], -1), (["--verbosity"], -1)])
def test_requested_verbosity_reads_absl_spellings(args, level):
    assert requested_verbosity(args) == level


def test_a_module_that_cannot_be_imported_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        user_model.load_function("keras_classifier_elsewhere:model_fn", "model_fn")
    assert str(error.value).startswith(
        f"--model_fn=keras_classifier_elsewhere:model_fn: cannot import keras_classifier_elsewhere (No module named "
        f"'keras_classifier_elsewhere'). Python looks for it in the current directory ({tmp_path}) and on PYTHONPATH")
    assert str(error.value).endswith(
        "run from the folder that holds keras_classifier_elsewhere/ or keras_classifier_elsewhere.py, or add that "
        "folder to PYTHONPATH (export PYTHONPATH=/path/to/folder)")
    (tmp_path / "broken_dependency.py").write_text("import no_such_package_here\n")
    with pytest.raises(ValueError, match=r"--input_fn=broken_dependency:f: importing broken_dependency failed: "
                                         r"No module named 'no_such_package_here'"):
        user_model.load_function("broken_dependency:f", "input_fn")
