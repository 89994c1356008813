"""DAPPLE's early backward keeps peak memory flat in M; GPipe's grows (TF's BFC allocator figures).

Runs scripts/bench_pipeline_memory.py in a fresh process (the BFC CPU allocator must be chosen
before TensorFlow starts).
"""

import json

import pytest
from tests.programs import run_program


@pytest.mark.slow
def test_dapple_peak_memory_is_flat_and_below_gpipe(tmp_path):
    out = tmp_path / "memory.json"
    result = run_program("bench_pipeline_memory", "--micro_batches=4,16", f"--json={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    (m4, m16) = json.loads(out.read_text())
    assert (m4["M"], m16["M"]) == (4, 16)
    assert m16["gpipe"] > 3.0 * m16["dapple"], result.stdout
    assert m16["dapple"] < 1.3 * m4["dapple"], result.stdout
    assert m16["gpipe"] > 2.5 * m4["gpipe"], result.stdout
