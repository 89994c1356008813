"""bench_schedule_memory: the DAPPLE paper's Table 5 in simulation (GPipe vs DAPPLE memory).

BERT-48 (shared/profiles/bert-48-pbs-2.txt), 2-stage pipeline (24:24 encoder layers) on two
devices of config B (16 servers x 1 V100, 25 Gbps), micro-batch size 2, M micro-batches:
throughput and per-device peak memory of GPipe (all forwards first: M micro-batches of
activations in flight) and DAPPLE (early backward, policy A: K = [2, 1]).

Stashed activations: the profile records only each layer's output (4.3 MB per encoder layer at
batch 2), but backward needs every intermediate tensor of the layer. For a BERT-large layer
(sequence s=512, hidden h=1024, a=16 heads, fp32) that is about 65 s h bytes (16 tensors of s x h
plus 3 dropout masks) + 9 a s^2 bytes (attention scores, softmax, mask) per sample
(Korthikanti et al., "Reducing activation recomputation", with 4-byte floats), i.e.
(65 + 9 a s / h) / 4 = 34.25 x the layer output: the default --activation_multiplier. With it a
micro-batch stashes 3.5 GB per stage; the paper's Table 5 implies about 3 GB
((GPipe 12.1 GB - DAPPLE 10.6 GB) / (2 - 1.5) micro-batches on average).

With --recompute=off,on the rows are repeated with re-computation on both stages (GPipe + RC,
DAPPLE + RC): each stage keeps only its boundary input per micro-batch in flight and runs its
forward again before each backward.

    python -m scripts.bench.memory.schedule_memory [--micro_batches=2,3,5,8,16] [--activation_multiplier=1]
        [--png=docs/bert48_pipeline.png --png_micro_batches=8]
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from absl import flags

from scripts.bench import harness
from scripts.cli import run_main

BERT_STASH_MULTIPLIER = (65 + 9 * 16 * 512 / 1024) / 4  # 34.25, see the module docstring
GIB = float(1 << 30)
# Paper Table 5: (throughput samples/s, average peak memory GB), None = OOM.
PAPER = {("gpipe", 2): (5.10, 12.1), ("gpipe", 3): None, ("dapple", 2): (5.10, 10.6),
         ("dapple", 8): (7.60, 10.6), ("dapple", 16): (8.18, 10.6),
         ("gpipe+RC", 2): (4.00, 9.9), ("gpipe+RC", 5): (5.53, 13.2), ("gpipe+RC", 8): None,
         ("dapple+RC", 2): (4.24, 8.5), ("dapple+RC", 8): (6.23, 8.5), ("dapple+RC", 16): (6.77, 8.5)}

FLAGS = flags.FLAGS
flags.DEFINE_string("profile", None, "BERT-48 profile (default: ../shared/profiles/bert-48-pbs-2.txt).")
flags.DEFINE_list("micro_batches", ["2", "3", "5", "8", "16"], "Numbers of micro-batches M.")
flags.DEFINE_float("activation_multiplier", BERT_STASH_MULTIPLIER,
                   "Stashed activation bytes per byte of layer output in the profile.")
flags.DEFINE_integer("micro_batch_size", 2, "Samples per micro-batch.")
flags.DEFINE_string("png", None, "Also draw GPipe vs DAPPLE (Gantt + memory) at --png_micro_batches here.")
flags.DEFINE_integer("png_micro_batches", 8, "M of the drawing.")
flags.DEFINE_list("recompute", ["off"], "Re-computation settings (off, on): rows for each.")


def _bert_profile() -> str:
    return harness.profile_path("bert-48-pbs-2")


def table5_rows(profile_path: Optional[str] = None, micro_batches: Sequence[int] = (2, 3, 5, 8, 16),
                activation_multiplier: float = BERT_STASH_MULTIPLIER, micro_batch_size: int = 2,
                recompute: Sequence[bool] = (False,)) -> List[Dict]:
    """One row per (RC, schedule, M): throughput, peak memory per device (bytes), OOM flag."""
    from planner.planning import cost_model as cm
    from planner.formats.cluster import preset_cluster
    from planner.planning.plan_eval import Options, evaluate, to_plan
    from planner.simulation.sim_adapter import model_profile, simulate_plan

    model = model_profile(profile_path or _bert_profile())
    prefix, cluster, n = cm.Prefix(model), preset_cluster("paper_b"), model.num_layers
    encoder = [i for i in range(n) if model.descriptions[i].startswith("layer_")]
    cut = encoder[len(encoder) // 2]  # first layer of stage 1
    stages = [(0, cut, (0,)), (cut, n, (1,))]
    rows = []
    for rc in recompute:
        for kind in ("gpipe", "dapple"):
            for m in micro_batches:
                # With RC the plan's backward includes the recomputed forward (plan_eval), and every
                # stage is marked: the simulator runs it as an R box before B.
                est = evaluate(model, prefix, cluster, stages, m * micro_batch_size, micro_batch_size,
                               Options(recompute=rc), schedule=kind, policy="A")
                plan = to_plan(est, model, cluster, m * micro_batch_size, kind)
                r = simulate_plan(plan, model, schedule=kind, policy=None if kind == "gpipe" else "A",
                                  activation_multiplier=activation_multiplier)
                peaks = [r.peak_memory_bytes[d] for d in r.devices]
                name = kind + ("+RC" if rc else "")
                rows.append({"schedule": name, "recompute": rc, "M": m, "K": list(r.schedule.warmup),
                             "throughput": r.throughput, "iteration_ms": r.iteration_ms, "peak_bytes": peaks,
                             "average_peak_bytes": sum(peaks) / len(peaks), "oom": r.out_of_memory,
                             "capacity_bytes": cluster.device_memory_bytes, "paper": PAPER.get((name, m), "-"),
                             "result": r})
    return rows


def format_table(rows: Sequence[Dict]) -> str:
    lines = [f"{'schedule':9} {'M':>3} {'K':>9} {'samples/s':>9} {'peak GiB (dev0, dev1)':>22} "
             f"{'avg GiB':>7} {'fits':>5}  paper (samples/s, avg GB)"]
    for r in rows:
        peaks = ", ".join(f"{p / GIB:.1f}" for p in r["peak_bytes"])
        paper = r["paper"]
        paper_text = "OOM" if paper is None else ("-" if paper == "-" else f"{paper[0]:.2f}, {paper[1]:.1f}")
        lines.append(f"{r['schedule']:9} {r['M']:3d} {str(r['K']):>9} {r['throughput']:9.2f} {peaks:>22} "
                     f"{r['average_peak_bytes'] / GIB:7.1f} {'OOM' if r['oom'] else 'yes':>5}  {paper_text}")
    if rows:
        lines.append(f"device memory usable: {rows[0]['capacity_bytes'] / GIB:.1f} GiB (16 GiB V100 less 1 GiB)")
    return "\n".join(lines)


def main(argv):
    del argv
    recompute = [{"off": False, "on": True}[r] for r in FLAGS.recompute]
    rows = table5_rows(FLAGS.profile or _bert_profile(), [int(m) for m in FLAGS.micro_batches],
                       FLAGS.activation_multiplier, FLAGS.micro_batch_size, recompute)
    print("BERT-48, 2 stages (24:24 encoder layers) on 2 devices of config B, micro-batch size "
          f"{FLAGS.micro_batch_size}, activation multiplier {FLAGS.activation_multiplier:.2f}")
    print(format_table(rows))
    if FLAGS.png:
        from planner.simulation.gantt import draw_gantt

        drawn = [r for r in table5_rows(FLAGS.profile or _bert_profile(), [FLAGS.png_micro_batches],
                                        FLAGS.activation_multiplier, FLAGS.micro_batch_size)]
        titles = [f"BERT-48, 2 stages, config B, {r['schedule']}: M={r['M']}, K={r['K']}, "
                  f"{r['throughput']:.2f} samples/s, peak {max(r['peak_bytes']) / GIB:.1f} GiB"
                  + (" (OUT OF MEMORY)" if r["oom"] else "") for r in drawn]
        info = draw_gantt([r["result"] for r in drawn], FLAGS.png, titles=titles)
        print(f"wrote {FLAGS.png} ({sum(info.rows)} rows, {info.total_boxes} boxes)")
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()
