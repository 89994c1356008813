"""The pipeline program (planner/formats/program.py): a 2:1 plan over two tasks printed, lowered for one graph and
for each task's graph, and what a per-host build makes agreeing with its lowering."""

import re

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from planner.formats import program as program_lib
from planner.formats.schedule import build_schedule
from tests.programs import run_program
from tests.shared_profiles import PROFILES

T0, T1 = "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"
STAGES = [[f"{T0}/device:CPU:0", f"{T1}/device:CPU:0"], [f"{T1}/device:CPU:1"]]  # 2:1, stage 0 over both tasks


def _program(num_micro_batches=2, global_batch_size=8):
    return program_lib.build_program(STAGES, global_batch_size, build_schedule(2, num_micro_batches, "dapple"),
                                     [["dense0", "dense1"], ["head"]])


def test_a_two_to_one_plan_over_two_tasks_prints_what_runs_where():
    assert str(_program()) == """\
pipeline program: 2 stages, M=2 micro-batches of 4 samples (global batch 8), schedule dapple, 3 devices in 2 task(s)
stage 0: layers dense0..dense1, 2 replica(s)
  s0r0 on /job:worker/replica:0/task:0/device:CPU:0: rows 0-1 of each micro-batch
  s0r1 on /job:worker/replica:0/task:1/device:CPU:0: rows 2-3 of each micro-batch
stage 1: layer head, 1 replica(s)
  s1r0 on /job:worker/replica:0/task:1/device:CPU:1: rows 0-3 of each micro-batch
tasks per device, in order:
  task:0/CPU:0: F0.s0r0 F1.s0r0 B0.s0r0 B1.s0r0
  task:1/CPU:0: F0.s0r1 F1.s0r1 B0.s0r1 B1.s0r1
  task:1/CPU:1: F0.s1r0 B0.s1r0 F1.s1r0 B1.s1r0
transfers of micro-batch 0 (each of the 2 moves the same rows):
  activation mb0 s0r0 -> s1r0: rows 0-1, task:0/CPU:0 -> task:1/CPU:1  [crosses tasks]
  activation mb0 s0r1 -> s1r0: rows 2-3, task:1/CPU:0 -> task:1/CPU:1
  gradient mb0 s1r0 -> s0r0: rows 0-1, task:1/CPU:1 -> task:0/CPU:0  [crosses tasks]
  gradient mb0 s1r0 -> s0r1: rows 2-3, task:1/CPU:1 -> task:1/CPU:0
gradient reductions, after each stage's last backward:
  stage 0: sum over task:0/CPU:0, task:1/CPU:0
apply: the optimizer's step on every device, on its copy of its stages' weights"""


def test_lowered_for_each_task_an_edge_to_the_other_task_is_a_queue_and_one_within_a_tensor():
    program = _program()
    assert str(program_lib.lower(program, T0)) == """\
lowered for task /job:worker/replica:0/task:0 (per-host graph): devices task:0/CPU:0
  queue: activation mb0 s0r0 -> s1r0: rows 0-1, task:0/CPU:0 -> task:1/CPU:1
  queue: gradient mb0 s1r0 -> s0r0: rows 0-1, task:1/CPU:1 -> task:0/CPU:0
  (the same for micro-batch 1)
  stage 0 gradients: exchange: pieces summed on owners over task:0/CPU:0, task:1/CPU:0"""
    task1 = program_lib.lower(program, T1)
    assert [(t.kind, str(t.source), str(t.target), how) for t, how in task1.edges if t.micro_batch == 1] == [
        ("activation", "s0r0", "s1r0", "queue"), ("activation", "s0r1", "s1r0", "tensor"),
        ("gradient", "s1r0", "s0r0", "queue"), ("gradient", "s1r0", "s0r1", "tensor")]
    whole = program_lib.lower(program)
    assert {how for _, how in whole.edges} == {"tensor"} and len(whole.edges) == len(program.transfers) == 8
    assert whole.devices == program.devices and whole.reductions[0][1] == program_lib.EXCHANGE_PIECES


def test_reductions_follow_the_runtimes_rule():
    cpu = [f"{T0}/device:CPU:0", f"{T0}/device:CPU:1"]
    assert program_lib.reduction_means(cpu, per_host=False) == program_lib.COLLECTIVE  # one process: TF's ring
    assert program_lib.reduction_means(cpu, per_host=True) == program_lib.EXCHANGE_PIECES
    assert program_lib.reduction_means(cpu + [f"{T1}/device:CPU:0"], False) == program_lib.EXCHANGE_HALVING
    gpus = [f"{T0}/device:GPU:0", f"{T1}/device:GPU:0"]
    assert program_lib.reduction_means(gpus, per_host=True) == program_lib.COLLECTIVE  # NCCL


PIECES, RING = program_lib.EXCHANGE_PIECES, program_lib.COLLECTIVE


@pytest.mark.parametrize("stages, means", [
    (STAGES, [PIECES, PIECES, PIECES]),  # one graph, task 0, task 1: CPUs of two processes
    ([[f"{T0}/device:CPU:0", f"{T0}/device:CPU:1"], [f"{T1}/device:CPU:0"]], [RING, PIECES]),  # task 1 takes no part
    ([[f"{T0}/device:GPU:0", f"{T1}/device:GPU:0"], [f"{T1}/device:GPU:1"]], [RING, RING, RING])])  # NCCL
def test_the_runtimes_lowering_builds_the_devices_and_reductions_its_program_lowers_to(stages, means):
    """The object build_pipeline's builders get (dapple_tf/rewrite/hosts/lowering.py) is made from the lowered
    program: it builds the devices the lowering lists, its stage boundaries, and sums each reduction by the means the
    lowering names."""

    # pylint: disable=import-outside-toplevel
    from dapple_tf.rewrite.hosts import boundary_exchange, lowering as lowering_lib
    from dapple_tf.rewrite.stages import boundaries

    program = program_lib.build_program(stages, 8, build_schedule(2, 2, "dapple"))
    devices = [d for replicas in stages for d in replicas]
    found = []
    for own_task in (None, T0, T1):
        part = lowering_lib.lowering(program, own_task, devices)
        assert part.lowered == program_lib.lower(program, own_task)
        assert part.built(part.lowered.program.devices) == list(part.devices)
        assert [d for _, d in part.replicas(stages[0])] == [d for d in stages[0] if d in part.devices]
        # the stage boundaries it builds: one graph's tensors, or a per-host graph's, with queues to other tasks
        kind = boundaries.Boundaries if own_task is None else boundary_exchange.BoundaryExchange
        assert type(part.boundaries(None, [], None)) is kind
        for reduction, how in part.lowered.reductions:
            assert part.exchanges(reduction.devices) == (how != program_lib.COLLECTIVE), (own_task, how)
            found.append(how)
    assert found == means


def test_uneven_slices_move_the_overlapping_rows():
    program = program_lib.build_program([["a", "b", "c"], ["d", "e"]], 7, build_schedule(2, 1, "gpipe"))
    assert [(r.first_row, r.rows) for r in program.stages[0]] == [(0, 3), (3, 2), (5, 2)]
    moves = [(str(t.source), str(t.target), t.first_row, t.rows) for t in program.transfers if t.kind == "activation"]
    assert moves == [("s0r0", "s1r0", 0, 3), ("s0r1", "s1r0", 3, 1), ("s0r1", "s1r1", 4, 1), ("s0r2", "s1r1", 5, 2)]


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match=r"own_task /job:worker/replica:0/task:5 runs none of the plan's devices; "
                                         r"the plan's tasks: \['/job:worker/replica:0/task:0', "):
        program_lib.lower(_program(), "/job:worker/replica:0/task:5")
    with pytest.raises(ValueError, match="the global batch size 9 is not divisible by 2 micro-batches"):
        _program(global_batch_size=9)
    with pytest.raises(ValueError, match="the schedule has 3 stages, the plan 2"):
        program_lib.build_program(STAGES, 8, build_schedule(3, 2, "dapple"))


def _model_fn(x, y):
    h = x
    for i, name in enumerate(["dense0", "dense1", "head"]):
        with dapple_tf.layer(name):
            w = tf.compat.v1.get_variable(f"w{i}", [4, 4], initializer=tf.compat.v1.random_normal_initializer())
            h = tf.nn.relu(tf.matmul(h, w)) + h
            if name == "head":
                return tf.reduce_mean(tf.square(h - y))


_KEY = re.compile(r"^dapple/(activation|gradient)/.*/s(\d+)r(\d+)-s(\d+)r(\d+)/mb(\d+)$")


def _queues_built(task: str, num_micro_batches: int):
    """(kind, source, target, micro-batch) of each boundary queue `task`'s per-host graph builds."""
    graph = tf.Graph()
    with graph.as_default():
        plan = dapple_tf.Plan.from_stages([(0, 1, STAGES[0]), (2, 2, STAGES[1])], num_micro_batches)
        dapple_tf.build_pipeline(_model_fn, tf.constant(np.ones([8, 4], np.float32)),
                                 tf.constant(np.zeros([8, 4], np.float32)),
                                 tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                 dapple_tf.PipelineOptions(own_task=task))
    built = set()
    for op in graph.get_operations():
        match = op.type == "FIFOQueueV2" and _KEY.match(op.get_attr("shared_name").decode())
        if match:
            kind, ps, pr, cs, cr, mb = match.groups()
            producer, consumer = f"s{ps}r{pr}", f"s{cs}r{cr}"  # a gradient goes from the consumer to the producer
            built.add((kind, producer, consumer, int(mb)) if kind == "activation" else (kind, consumer, producer,
                                                                                         int(mb)))
    return built


@pytest.mark.parametrize("task", [T0, T1])
def test_a_per_host_build_makes_the_queues_its_lowering_lists(task):
    lowered = program_lib.lower(_program(num_micro_batches=2), task)
    expected = {(t.kind, str(t.source), str(t.target), t.micro_batch) for t, how in lowered.edges
                if how == program_lib.QUEUE}
    assert len(expected) == 4
    assert _queues_built(task, 2) == expected


def test_dapple_plan_explain_prints_the_program_and_each_tasks_part():
    r = run_program("dapple_plan", f"--profile={PROFILES}vgg-19-pbs-32.txt", "--global_batch_size=64",
                    "--cluster=local:2x2", "--explain")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^pipeline program: \d+ stages, M=\d+ micro-batches of \d+ samples \(global batch 64\)", out,
                     re.M), out
    assert "lowered for one graph for every task: devices task:0/CPU:0, task:0/CPU:1, task:1/CPU:0, task:1/CPU:1" in out
    for task in (T0, T1):
        assert f"lowered for task {task} (per-host graph)" in out


@pytest.mark.parametrize("batch_major", [True, False])
def test_each_side_of_a_boundary_lists_the_same_pairs(batch_major):
    """The row pairing's one-pass inverses (what a producer's task builds) list exactly the pairs the consumers' tasks
    build, for replications 1-5 with uneven slices."""
    for rows in (7, 12, 13):
        for producers in range(1, 6):
            for consumers in range(1, 6):
                p_sizes, c_sizes = program_lib.slice_sizes(rows, producers), program_lib.slice_sizes(rows, consumers)
                starts = program_lib.offsets(c_sizes)
                reads = {(i, j) for j in range(consumers)
                         for i in program_lib.producers_read(batch_major, p_sizes, starts[j], c_sizes[j])}
                assert reads == {(i, j) for i in range(producers)
                                 for j in program_lib.consumers_reading(batch_major, p_sizes, c_sizes, i)}
                pieces = {(i, j, first + starts[j] - (program_lib.offsets(p_sizes)[i] if batch_major else starts[j]),
                           count)
                          for j in range(consumers)
                          for i, first, count in program_lib.gradient_pieces(batch_major, p_sizes, starts[j], c_sizes[j])}
                assert pieces == {(i, j, first, count) for i in range(producers)
                                  for j, first, count in program_lib.gradient_pieces_for(batch_major, p_sizes, c_sizes, i)}
                if batch_major:  # the program's transfers are these pairs: every row of the micro-batch once
                    built = program_lib.build_program(
                        [[f"p{i}" for i in range(producers)], [f"c{j}" for j in range(consumers)]], rows,
                        build_schedule(2, 1, "gpipe"))
                    moved = {(t.source.index, t.target.index, t.first_row - t.source.first_row, t.rows)
                             for t in built.transfers if t.kind == program_lib.ACTIVATION}
                    assert moved == pieces and sum(n for *_, n in moved) == rows
