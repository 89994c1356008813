"""examples/bert_tf1: a TF1 BERT fine-tuning script, ported by the user guide's diff ("Porting a training
script"), trains pipelined inside its encoder (2:1) as the unported script does on one device: through its own
Estimator and through dapple_train --scope_patterns."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tests import ported_examples
from tests.programs import ROOT, run_program

pytestmark = [pytest.mark.primary_only, pytest.mark.slow]  # tf.estimator; ~80 s: two Estimator and two CLI runs

EXAMPLE = os.path.join(ROOT, "examples", "bert_tf1")
LAYERS = "bert/embeddings,bert/encoder/layer_*,bert/pooler,loss"  # 7 layers: embeddings, 4 encoder layers, ...


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """The example with the guide's diff applied (git apply, as a user would patch it)."""
    return ported_examples.ported("bert_tf1", tmp_path_factory.mktemp("ported"))


def test_the_port_is_three_lines_none_in_model_fn():
    changed = ported_examples.changed_lines(ported_examples.port_diff("bert_tf1"))
    assert len(changed) <= 3 and all(line.startswith("+") for line in changed), changed
    assert not any("minimize" in line or "model_fn(" in line for line in changed)


def assert_same_training(want, got):
    assert sorted(want) == sorted(got)  # the single-device variables, AdamW's slots included: no copies
    assert int(want["global_step"]) == int(got["global_step"]) == 4
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=2e-6, err_msg=name)


def initial_checkpoint(path) -> float:
    """Pre-trained weights, larger than the example's initializer gives (so that clipping at 1.0 acts); returns
    the first batch's global gradient norm there."""
    modeling, run_classifier = ported_examples.example_modules("bert_tf1", "modeling", "run_classifier")
    x, y = run_classifier.examples(0, 16)
    return ported_examples.saved_initial_weights(path, lambda: run_classifier.create_model(
            {k: tf.constant(v) for k, v in x.items()}, tf.constant(y), dict(modeling.CONFIG, initializer_range=0.2))[0])


def run_script(folder, model_dir, *args):
    return ported_examples.run_script(os.path.join(folder, "run_classifier.py"), model_dir, "--train_steps=4",
                                      "--learning_rate=0.01", "--warmup_steps=1", "--num_cpu_devices=3", *args)


def test_ported_script_trains_pipelined_inside_the_encoder_as_on_one_device(ported, tmp_path):
    norm = initial_checkpoint(tmp_path / "init" / "model.ckpt")
    assert norm > 1.0  # clipping at 1.0 acts
    init = f"--init_checkpoint={tmp_path / 'init' / 'model.ckpt'}"
    want = run_script(EXAMPLE, tmp_path / "single", init)
    plan = ported_examples.plan_file(tmp_path / "plan.json", [(0, 2, [0, 1]), (3, 6, [2])], 2)  # after layer_1, 2:1
    got = run_script(str(ported), tmp_path / "pipelined", init, f"--plan={plan}")
    assert_same_training(want, got)


def test_ported_model_fn_trains_through_dapple_train(ported, tmp_path):
    def train(name, plan, devices):
        result = run_program("dapple_train", "--model_fn=run_classifier:model_fn",
                             "--input_fn=run_classifier:input_fn", f"--scope_patterns={LAYERS}", f"--plan={plan}",
                             "--steps=4", "--log_every=2", f"--num_devices={devices}", "--save_checkpoints_steps=4",
                             f"--model_dir={tmp_path / name}", cwd=str(ported), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "done: step 4" in result.stdout
        return ported_examples.checkpoint(tmp_path / name)

    plan_file = ported_examples.plan_file
    want = train("one", plan_file(tmp_path / "one.json", [(0, 6, [0])], 1), 1)
    got = train("two", plan_file(tmp_path / "two.json", [(0, 2, [0, 1]), (3, 6, [2])], 2), 3)
    assert_same_training(want, got)


@pytest.mark.long  # per host in CI: tests/test_per_host_estimator.py; BERT per host: the probe's script-bert-hybrid
def test_ported_model_fn_trains_per_host_as_the_one_graph(ported, tmp_path):
    """Per host (dapple_launch --per_host), every task builds only its part, and the script's own
    tf.clip_by_global_norm runs on the loss's task from every task's gradients
    (dapple_tf/rewrite/hosts/host_transform.py): the checkpoint is the one graph's for the same cluster. Weights 10x
    the example's initializer, so that clipping at 1.0 acts."""
    from planner.formats import plan_pb2, write_message  # pylint: disable=import-outside-toplevel
    from planner.formats.cluster import local_task_cluster  # pylint: disable=import-outside-toplevel

    with open(os.path.join(ported, "bert_clipped.py"), "w") as f:
        f.write(
            "import numpy as np\nimport tensorflow as tf\nimport modeling\nimport run_classifier\n\n"
            "model_fn = run_classifier.model_fn_builder(dict(modeling.CONFIG, initializer_range=0.2), learning_rate=0.01,\n"
            "                                           num_train_steps=100, num_warmup_steps=1, init_checkpoint=None)\n\n\n"
            "def input_fn(step, batch_size):  # the example's batches of steps 0-3, as tensors (a cluster's workers run them)\n"
            "    batches = [run_classifier.examples(s, batch_size) for s in range(4)]\n"
            "    features = {k: tf.gather(tf.constant(np.stack([b[0][k] for b in batches])), step % 4) for k in batches[0][0]}\n"
            "    return features, tf.gather(tf.constant(np.stack([b[1] for b in batches])), step % 4)\n")
    plan = plan_pb2.Plan(num_micro_batches=2, global_batch_size=16)
    plan.cluster.CopyFrom(local_task_cluster(3, 1, memory_bytes=1e9))
    plan.stages.add(first_layer=0, last_layer=2, device_ids=[0, 1])  # embeddings and layers 0-1 on tasks 0 and 1
    plan.stages.add(first_layer=3, last_layer=6, device_ids=[2])  # the rest and the loss on task 2
    write_message(plan, str(tmp_path / "plan.json"))

    def train(name, *flags):
        result = run_program("dapple_launch", "--cluster=local:3x1", *flags, "--", "dapple_train",
                             "--model_fn=bert_clipped:model_fn", "--input_fn=bert_clipped:input_fn",
                             f"--scope_patterns={LAYERS}", f"--plan={tmp_path / 'plan.json'}", "--steps=4",
                             "--log_every=2", "--save_checkpoints_steps=4", f"--model_dir={tmp_path / name}",
                             cwd=str(ported), timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return ported_examples.checkpoint(tmp_path / name)

    assert_same_training(train("one_graph", "--noper_host"), train("per_host", "--per_host"))
