"""examples/seq2seq_tf1: a TF1 GNMT-style script (time-major dynamic_rnn LSTMs with the sentences' lengths, a
decoder started from the encoder's state and fed the target, Luong attention with plain ops, NMT's loss, tf.cond
warmup and decay, tf.gradients + clipping + Adam, TF1 behavior), ported by the user guide's 3-line diff with nothing
changed in its model_fn, trains pipelined at M=4 (straight inside the decoder, 2:1 between the encoder and the
decoder) as the unported script does on one device: every checkpointed variable, the learning rate and the loss
summaries."""

import os

import numpy as np
import pytest

from tests import ported_examples
from tests.programs import ROOT

pytestmark = [pytest.mark.primary_only, pytest.mark.slow]  # tf.estimator, tf.compat.v1.nn.rnn_cell; ~100 s

EXAMPLE = os.path.join(ROOT, "examples", "seq2seq_tf1")
STEPS = 4
# two warmup steps, then the rate halves each step from step 2: 1e-4, 1e-3, 1e-2, 5e-3; clipping at 0.1 acts
FLAGS = (f"--train_steps={STEPS}", "--num_cpu_devices=3", "--warmup_steps=2", "--decay_start=2", "--decay_steps=1",
         "--max_gradient_norm=0.1")
# 6 layers: dynamic_seq2seq/embeddings, encoder/bidirectional_rnn, encoder/rnn, decoder/rnn, decoder/attention,
# decoder/output_projection. Between the encoder and the decoder, the decoder's dynamic_rnn reads the target's
# embeddings from the stage before; inside the decoder, the attention's output [tgt_time, batch, units] crosses.
STRAIGHT_IN_DECODER = [(0, 4, [0]), (5, 5, [1])]
TWO_ONE = [(0, 2, [0, 1]), (3, 5, [2])]


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """The example with the guide's diff applied (git apply, as a user would patch it)."""
    return ported_examples.ported("seq2seq_tf1", tmp_path_factory.mktemp("ported"))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("one_device")
    return (ported_examples.run_script(os.path.join(EXAMPLE, "nmt.py"), model_dir, *FLAGS),
            ported_examples.scalar_summaries(model_dir))


def test_the_port_is_three_lines_none_in_model_fn():
    changed = ported_examples.changed_lines(ported_examples.port_diff("seq2seq_tf1"))
    assert len(changed) <= 3 and all(line.startswith("+") for line in changed), changed
    assert not any("minimize" in line or "model_fn(" in line for line in changed)


@pytest.mark.parametrize("stages", [pytest.param(STRAIGHT_IN_DECODER, marks=pytest.mark.long), TWO_ONE],
                         ids=["straight-in-decoder", "2:1"])  # CI: 2:1, which cuts a replicated stage too
def test_ported_script_trains_as_on_one_device(ported, one_device, tmp_path, stages):
    want, want_summaries = one_device
    assert min(want_summaries["grad_norm"].values()) > 0.1  # clipping acts at every step
    plan = ported_examples.plan_file(tmp_path / "plan.json", stages, 4)  # M=4, global batch 16
    got = ported_examples.run_script(os.path.join(ported, "nmt.py"), tmp_path / "run", *FLAGS, f"--plan={plan}")
    assert sorted(want) == sorted(got)  # the single-device variables, Adam's slots included: no copies
    assert int(want["global_step"]) == int(got["global_step"]) == STEPS
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=2e-6, err_msg=name)
    summaries = ported_examples.scalar_summaries(tmp_path / "run")
    for tag in ("lr", "train_loss"):
        assert sorted(summaries[tag]) == list(range(1, STEPS + 1)), tag
        np.testing.assert_allclose([summaries[tag][s] for s in range(1, STEPS + 1)],
                                   [want_summaries[tag][s] for s in range(1, STEPS + 1)], rtol=1e-5, err_msg=tag)
    assert len(set(summaries["lr"].values())) == STEPS  # two warmup steps, then decay
    assert "grad_norm" not in summaries and "clipped_gradient" not in summaries  # they read the gradients: left out
