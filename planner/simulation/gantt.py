"""PNG Gantt charts of simulated iterations, like Fig. 3/4 of the DAPPLE paper.

One row per device: forward (blue), re-computation (light blue), backward (green) and weight-gradient
(dark green, where the backward is split) boxes with
micro-batch ids, the optimizer step (grey), and below them two thin strips: transfers the device sends (activations orange,
gradients purple) and its stage's AllReduce (red). Under each chart, the memory of every stage's
devices over time (parameters + optimizer state + live activations), with the device capacity.

`draw_gantt` accepts several results (e.g. GPipe and DAPPLE) and draws them on one time scale.
It returns a `GanttInfo` with what it drew, so tests can check the picture's content.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, Optional, Sequence, Union

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from planner.simulation.simulator import (  # noqa: E402
    KIND_ALLREDUCE,
    KIND_BACKWARD,
    KIND_FORWARD,
    KIND_WEIGHT,
    KIND_OPTIMIZER,
    KIND_RECOMPUTE,
    KIND_SEND_ACTIVATION,
    KIND_SEND_GRADIENT,
    SimulationResult,
)

COLORS = {
    KIND_FORWARD: "#4a90d9",
    KIND_RECOMPUTE: "#a9cdf0",
    KIND_BACKWARD: "#5cb85c",
    KIND_WEIGHT: "#2e7d32",
    KIND_OPTIMIZER: "#9e9e9e",
    KIND_SEND_ACTIVATION: "#f0a030",
    KIND_SEND_GRADIENT: "#9b59b6",
    KIND_ALLREDUCE: "#d9534f",
}
# (bottom, height) inside a row of height 1, drawn top-down.
_BANDS = {
    KIND_FORWARD: (0.36, 0.58),
    KIND_BACKWARD: (0.36, 0.58),
    KIND_WEIGHT: (0.36, 0.58),
    KIND_RECOMPUTE: (0.36, 0.58),
    KIND_OPTIMIZER: (0.36, 0.58),
    KIND_SEND_ACTIVATION: (0.19, 0.14),
    KIND_SEND_GRADIENT: (0.19, 0.14),
    KIND_ALLREDUCE: (0.03, 0.14),
}
_MIN_LABEL_PX = 9.0  # a micro-batch id is written in a box at least this wide per character


@dataclasses.dataclass
class GanttInfo:
    """What `draw_gantt` drew: rows (devices) per chart, boxes per kind, ids written, image size."""

    rows: list = dataclasses.field(default_factory=list)  # per chart
    boxes: Dict[str, int] = dataclasses.field(default_factory=lambda: collections.Counter())
    labels: int = 0
    width_px: int = 0
    height_px: int = 0

    @property
    def total_boxes(self) -> int:
        return sum(self.boxes.values())


def _draw_chart(ax, result: SimulationResult, x_max: float, info: GanttInfo, width_px: float) -> None:
    devices = result.devices
    row_of = {d: i for i, d in enumerate(devices)}
    by_stage = {s: result.stage_devices(s) for s in range(result.num_stages)}
    px_per_ms = width_px / x_max if x_max > 0 else 0.0
    for e in result.events:
        if e.duration_ms <= 0:
            continue
        bottom, height = _BANDS[e.kind]
        for d in by_stage[e.stage]:
            y = len(devices) - 1 - row_of[d]
            ax.broken_barh([(e.start_ms, e.duration_ms)], (y + bottom, height),
                           facecolors=COLORS[e.kind], edgecolors="black", linewidth=0.3)
            info.boxes[e.kind] += 1
            if e.kind in (KIND_FORWARD, KIND_RECOMPUTE, KIND_BACKWARD, KIND_WEIGHT):
                text = str(e.micro_batch) if not result.schedule.lanes else f"{e.micro_batch}.{e.stage}"
                if e.duration_ms * px_per_ms >= _MIN_LABEL_PX * len(text):
                    ax.text(e.start_ms + e.duration_ms / 2, y + bottom + height / 2, text,
                            ha="center", va="center", fontsize=7, color="white")
                    info.labels += 1
    ax.set_ylim(0, len(devices))
    ax.set_yticks([len(devices) - 1 - i + 0.5 for i in range(len(devices))])
    ax.set_yticklabels([f"dev {d} (s{','.join(map(str, result.device_stages(d)))})" for d in devices], fontsize=7)
    ax.set_xlim(0, x_max)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    info.rows.append(len(devices))


def _draw_memory(ax, result: SimulationResult, x_max: float) -> None:
    for s, timeline in enumerate(result.memory_timeline):  # per device group: stage s and those sharing its devices
        devs = result.stage_devices(s)
        times = [t for t, _ in timeline] + [result.iteration_ms]
        values = [b / 2**30 for _, b in timeline]
        values.append(values[-1])
        name = f"dev {devs[0]}" if len(devs) == 1 else f"devs {devs[0]}-{devs[-1]}"
        stages = result.schedule.lane_stages(s)
        label = f"stage {s}" if len(stages) == 1 else "stages " + ",".join(map(str, stages))
        ax.step(times, values, where="post", linewidth=1.2, label=f"{label} ({name})")
    if result.device_memory_bytes:
        ax.axhline(result.device_memory_bytes / 2**30, color="red", linestyle="--", linewidth=1,
                   label="device memory")
    ax.set_xlim(0, x_max)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("GiB", fontsize=8)
    ax.tick_params(labelsize=7)
    if len(result.memory_timeline) <= 8:
        ax.legend(fontsize=6, loc="upper right", ncol=2)


def draw_gantt(
    results: Union[SimulationResult, Sequence[SimulationResult]],
    path: str,
    titles: Optional[Sequence[str]] = None,
    memory: bool = True,
    width_in: float = 12.0,
    dpi: int = 100,
) -> GanttInfo:
    """Draws one Gantt chart (and memory plot) per result into the PNG `path`."""
    if isinstance(results, SimulationResult):
        results = [results]
    results = list(results)
    if not results:
        raise ValueError("draw_gantt needs at least one simulation result")
    if titles is None:
        titles = [_default_title(r) for r in results]
    if len(titles) != len(results):
        raise ValueError(f"got {len(titles)} titles for {len(results)} charts")
    x_max = max(r.iteration_ms for r in results) * 1.02 or 1.0
    ratios = []
    for r in results:
        ratios.append(max(1.2, 0.45 * len(r.devices)))
        if memory:
            ratios.append(1.6)
    height_in = sum(ratios) + 0.6 * len(results) + 0.8
    fig, axes = plt.subplots(len(ratios), 1, figsize=(width_in, height_in), dpi=dpi,
                             gridspec_kw={"height_ratios": ratios}, squeeze=False)
    axes = axes[:, 0]
    info = GanttInfo()
    plot_width_px = width_in * dpi * 0.8  # axes span about 80% of the figure width
    step = 2 if memory else 1
    for i, r in enumerate(results):
        ax = axes[i * step]
        _draw_chart(ax, r, x_max, info, plot_width_px)
        ax.set_title(titles[i], fontsize=9)
        if memory:
            _draw_memory(axes[i * step + 1], r, x_max)
    axes[-1].set_xlabel("time (ms)", fontsize=8)
    legend = [Patch(facecolor=COLORS[k], edgecolor="black", label=k.replace("_", " ")) for k in COLORS]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    info.width_px, info.height_px = (int(round(v)) for v in fig.get_size_inches() * dpi)
    plt.close(fig)
    return info


def _default_title(r: SimulationResult) -> str:
    s = r.schedule
    return (f"{s.kind}: S={s.num_stages}, M={s.num_micro_batches}, K={list(s.warmup)}; "
            f"iteration {r.iteration_ms:.1f} ms, {r.throughput:.2f} samples/s")
