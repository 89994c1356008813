"""Cost-model formulas on hand-computed small cases."""

import pytest

from planner.planning import cost_model as cm
from planner.formats.cluster import make_cluster
from planner.planning.dapple_planner import place
from planner.planning.plan_eval import Options, evaluate
from planner.formats.model_profile import ModelProfile
from planner.formats.profile import parse_pipedream

NODE = "{} -- x -- forward_compute_time={}, backward_compute_time={}, activation_size={}, parameter_size={}\n"
# 2 servers x 2 devices; intra 1e9 B/s, inter 1e8 B/s; 100 B of memory per device
CLUSTER = make_cluster("t", 2, 2, 1000.0, 1e9, 1e8)


def tiny():
    text = (NODE.format("a", 1, 2, 10, 5) + NODE.format("b", 2, 4, 20, 0) + NODE.format("c", 3, 6, 30, 10)
            + "\ta -- b\n\tb -- c\n\ta -- c\n")
    return ModelProfile.from_proto(parse_pipedream(text, batch_size=1))


def test_cut_bytes_include_skip_edges():
    p = cm.Prefix(tiny())
    assert p.cut == [0.0, 10.0, 30.0, 0.0]  # cut before c carries a (skip edge) and b
    assert cm.cut_bytes(p, 2, samples=4) == 120.0


def test_slices_and_stage_times():
    assert cm.slice_sizes(16, 15) == (2,) + (1,) * 14
    p = cm.Prefix(tiny())
    assert cm.stage_forward_ms(p, 0, 2, 5, 2, overhead_ms=0.5) == pytest.approx(3 * 3 + 0.5)
    assert cm.stage_backward_ms(p, 1, 3, 4, 3, overhead_ms=0.0) == pytest.approx(2 * 10)


def test_pivot_algorithm_1():
    # stage 0 is heavy: (M-1)(F0+B0) = 3*10 = 30 > 3*2 + (F1+B1) = 6 + 1
    assert cm.pivot_stage([4, 0.5, 1], [6, 0.5, 1], 4) == 0
    assert cm.pivot_stage([1, 0.5, 1], [1, 0.5, 1], 4) == 2
    # with M = 1 no steady phase: the last stage stays pivot
    assert cm.pivot_stage([4, 1], [6, 1], 1) == 1


def test_pipeline_latency_parts():
    f, b, ar = [1.0, 0.5, 2.0], [2.0, 0.5, 4.0], [3.0, 0.0, 1.0]
    latency, tw, ts, te, q = cm.pipeline_latency(f, b, ar, 4)
    assert q == 2
    assert tw == pytest.approx(3.5)
    assert ts == pytest.approx(3 * 6.0)
    # Te = max(AR2 + B2, AR1 + B1 + B2, AR0 + B0 + B1 + B2) = max(5, 4.5, 9.5)
    assert te == pytest.approx(9.5)
    assert latency == pytest.approx(3.5 + 18 + 9.5)


def test_pivot_wait():
    # Stage 0 (F 2, B 4) is the pivot; the round trip after it (comm 0, stage 1: F 1, B 2) is 3.
    f, b = [2.0, 0.0, 1.0], [4.0, 0.0, 2.0]
    assert cm.pivot_wait_ms(f, b, 0, 2, warmup=2) == pytest.approx(1.0)  # 3 - 1 x F0: first backward only
    assert cm.pivot_wait_ms(f, b, 0, 4, warmup=2) == pytest.approx(1.0)  # the last backward's 3 - B0 < 0
    # K = 1: every micro-batch waits the whole trip, and the last backward once more.
    assert cm.pivot_wait_ms(f, b, 0, 4, warmup=1) == pytest.approx(3.0 + 3 * 3.0 + 3.0)
    assert cm.pivot_wait_ms(f, b, 2, 4) == 0.0  # nothing after the last stage
    # The first stage heavier than the second: L counts one micro-batch through both stages plus
    # (M-1) pivot cycles: 2 + 3 x 6 + 1 (wait, policy A's K = 2) + 4 (Te = B0).
    latency, tw, ts, te, q = cm.pipeline_latency(f, b, [0.0, 0.0, 0.0], 4)
    assert q == 0 and (tw, ts, te) == (2.0, 19.0, 4.0) and latency == 25.0
    assert latency >= sum(f) + sum(b)


def test_allreduce_flat_and_hierarchical():
    assert cm.allreduce_ms(CLUSTER, [0], 1e9) == 0.0
    assert cm.allreduce_ms(CLUSTER, [0, 1], 1e6) == pytest.approx(1e3 * 1e6 / 1e9)  # 2*(1/2)*B/intra
    # 2 servers x 2: intra 2*(1/2)*1e6/1e9 + inter 2*(1/2)*1e6/1e8 seconds
    assert cm.allreduce_ms(CLUSTER, [0, 1, 2, 3], 1e6) == pytest.approx(1e3 * (1e-3 + 1e-2))


def test_transfer_split_concat_per_pair_links():
    # The paper's model: every device pair has its own link; the largest share over its link.
    # 1:1 same device is free; 1:2 split inside a server: 2 of 4 samples leave device 0
    assert cm.transfer_ms(CLUSTER, [0], [0], 1e6, 4) == 0.0
    assert cm.transfer_ms(CLUSTER, [0], [0, 1], 1e6, 4) == pytest.approx(1e3 * 2e6 / 1e9)
    # 2:1 concat across servers: 2 samples from each of devices 0 and 1, in parallel
    assert cm.transfer_ms(CLUSTER, [0, 1], [2], 1e6, 4) == pytest.approx(1e3 * 2e6 / 1e8)
    # N:M with uneven slices, 5 samples from [0, 1] (0-2, 3-4) to [1, 2, 3] (0-1, 2-3, 4):
    # 0->1 2 samples over NVLink; 0->2, 1->2, 1->3 one sample each over Ethernet
    assert cm.transfer_ms(CLUSTER, [0, 1], [1, 2, 3], 1.0, 5) == pytest.approx(1e3 * 1 / 1e8)
    assert cm.moved_samples([0, 1], [1, 2, 3], 5) == [(0, 1, 2), (0, 2, 1), (1, 2, 1), (1, 3, 1)]


def test_transfer_split_concat_with_contention():
    # Shared ports: each device's NVLink port and each server's NIC carries all of its bytes.
    assert cm.transfer_ms(CLUSTER, [0], [0, 1], 1e6, 4, contention=True) == pytest.approx(1e3 * 2e6 / 1e9)
    # 2:1 concat across servers: all 4 samples cross server 0's NIC
    assert cm.transfer_ms(CLUSTER, [0, 1], [2], 1e6, 4, contention=True) == pytest.approx(1e3 * 4e6 / 1e8)
    # samples 2, 3, 4 cross server 0's NIC -> 3 samples
    assert cm.transfer_ms(CLUSTER, [0, 1], [1, 2, 3], 1.0, 5, contention=True) == pytest.approx(1e3 * 3 / 1e8)
    # Options.link_contention reaches the plan's boundary cost
    model = tiny()
    p = cm.Prefix(model)
    stages = [(0, 1, (0, 1)), (1, 3, (2,))]
    free = evaluate(model, p, CLUSTER, stages, 4, 4, Options(overhead_ms=0.0))
    shared = evaluate(model, p, CLUSTER, stages, 4, 4, Options(overhead_ms=0.0, link_contention=True))
    assert free.comm == [pytest.approx(1e3 * 2 * 10 / 1e8)] and shared.comm == [pytest.approx(1e3 * 4 * 10 / 1e8)]


def test_acr_is_transfer_over_average_pass():
    # Paper: (forward + backward transfer) / average FW/BW time, (F + B) / 2, of the two neighbours.
    assert cm.activation_communication_ratio([4.0, 8.0], [3.0]) == pytest.approx(3.0 / 3.0)
    assert cm.activation_communication_ratio([4.0, 8.0, 4.0], [3.0, 0.0]) == pytest.approx(0.5)
    assert cm.activation_communication_ratio([4.0], []) == 0.0


def test_allreduce_tail_overlap():
    m = tiny()
    # per-byte AR 1 ms; layers a (5 B), b (0), c (10 B), slice 1 sample; backward c=6, b=4, a=2
    # k=a: AR 5 - 0; k=b: 5 - 2; k=c: 15 - 6 -> tail 9
    assert cm.allreduce_tail_ms(m, 0, 3, 1, 1.0, bucket_bytes=0) == pytest.approx(9.0)  # a bucket per layer
    assert cm.allreduce_tail_ms(m, 0, 3, 1, 1.0) == pytest.approx(15.0)  # one 25 MiB bucket: after the backward


def test_memory_and_pruning():
    p = cm.Prefix(tiny())
    # params 15 B x (2 + 2) + 2 in flight x 3 samples x 60 B
    assert cm.memory_bytes(p, 0, 3, 3, 2, 2.0) == pytest.approx(60 + 360)
    # With 4 micro-batches: + the largest layer's gradient (c: 10 B, accumulation) + the inputs the
    # layers read for all 4 slices (none here).
    assert cm.memory_bytes(p, 0, 3, 3, 2, 2.0, num_micro_batches=4) == pytest.approx(60 + 10 + 360)
    est = evaluate(tiny(), p, CLUSTER, [(0, 3, (0,))], 40, 20, Options(overhead_ms=0.0))
    assert est.violation.startswith("stage 0 (layers 0..2) needs")  # 60 + 20*60 > 1000 B
    assert not est.feasible


@pytest.mark.parametrize("used,count,policy,expected", [
    ((0, 0), 2, "fresh", (2, 0)),
    ((1, 0), 2, "fresh", (0, 2)),
    ((1, 0), 2, "append", (1, 1)),
    ((0, 0), 2, "scatter", (1, 1)),
    ((1, 0), 1, "scatter", (1, 0)),
    ((2, 2), 1, "fresh", None),
])
def test_placement_policies(used, count, policy, expected):
    assert place(used, count, 2, policy) == expected


def test_input_nodes_cost_nothing_and_their_bytes_are_held_for_the_global_batch():
    # `x` (an Input node: 7 ms, 100 B per sample) feeds a and c: no compute, no cut bytes, not
    # kept; its bytes count on its first consumer's stage for all of the stage's slices (M x slice).
    text = (NODE.format("x", 7, 0, 100, 0).replace("-- x --", "-- Input0 --") + NODE.format("a", 1, 2, 10, 5)
            + NODE.format("c", 3, 6, 30, 10) + "\tx -- a\n\ta -- c\n\tx -- c\n")
    m = ModelProfile.from_proto(parse_pipedream(text, batch_size=1))
    assert m.is_input == [True, False, False] and m.forward_ms[0] == 0 and m.kept_bytes[0] == 0
    p = cm.Prefix(m)
    assert p.cut == [0.0, 0.0, 10.0, 0.0]
    assert m.input_bytes == [0.0, 100.0, 0.0]
    assert cm.memory_bytes(p, 0, 2, 3, 2, 0.0, num_micro_batches=4) == pytest.approx(2 * 5 + 5 + 2 * 3 * 10 + 4 * 3 * 100)
