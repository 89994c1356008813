"""DAPPLE's cost model (paper section 4.1), as pure functions shared by the planners and by
planner/simulation/simulator.py.

Conventions:
- A stage covers layers [first, end) of the profile's topological order (end exclusive; the
  Plan proto stores last_layer = end - 1). `ModelProfile` holds per-sample costs.
- Compute scales linearly with samples: a replica holding a slice of b samples takes
  b * (per-sample time) + PASS_OVERHEAD_MS per forward or backward pass. Replication need not
  divide the micro-batch: slices differ by at most one sample and the largest one is costed.
- The cut before layer c carries every tensor produced by a layer < c and consumed by a
  layer >= c (activations forward, their gradients backward: same bytes).
- Transfers between stages (split 1:N, concat N:1, N:M, paper section 5.2.2): each sample goes
  from the device holding it in the sender's slicing to the device holding it in the receiver's
  slicing; samples on the same device move for free. Paper model (the default): every pair of
  devices has its own link (NVLink inside a server, the inter-server bandwidth across servers)
  and all pairs move their share in parallel, so the transfer takes as long as the largest share
  over its link: (largest share of the micro-batch) x bytes / bandwidth. This is what the paper's
  ACR values imply (Table 4: GNMT-16 8:8 has ACR 0.10 on both config A, where the 8 pairs share
  one server pair, and config B, 8 separate servers; VGG-19's ACR is 0.16 on config A (Table 3,
  section 6.4) and 0.40 on config C: exactly the 25/10 Gbps bandwidth ratio, which a 15:1 concat
  limited by the receiver's port would not give). `contention=True` costs the stricter model
  instead: each device's NVLink port and each server's NIC carries all of its bytes at the
  cluster's bandwidth, and the transfer takes as long as the busiest port.
- AllReduce: ring inside one server, 2 (n-1)/n * bytes / intra; across servers hierarchical:
  intra-server reduce-scatter + all-gather (2 (c-1)/c * bytes / intra, c = most devices on one
  server) plus a ring between servers over the NICs (2 (k-1)/k * bytes / inter, k servers; inter is
  the cluster's measured allreduce_bandwidth where it has one). It runs in buckets during the last
  micro-batch's backward (allreduce_tail_ms): L counts what is left after; on clusters whose devices'
  own cores communicate (CPU workers: communication_uses_compute) all of it counts.
- Pipeline latency L = Tw + Ts + Te (paper formula 2) over computation and communication stages,
  pivot Q from the paper's Algorithm 1 (formula 3).
- ACR (activation communication ratio, sections 5.3 and 6.2): the forward + backward transfer time
  of a boundary over the average of one forward and one backward pass of its two neighbouring
  stages, (F + B) / 2, averaged over the boundaries. On the paper's own plans this gives BERT-48
  0.058 / 0.47 / 1.17 for configs A / B / C at micro-batch 8 (paper 0.06 / 0.50 / 1.25);
  tests/test_planner_table4.py has the other rows.

PASS_OVERHEAD_MS = 0.2: a fixed cost per stage per forward or backward micro-batch pass
(executor step, kernel launches, split/concat ops). Without it the linear model would make the
smallest micro-batch always best.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

from planner.planning.memory_model import stage_working_bytes
from planner.formats.model_profile import ModelProfile
from planner.formats.program import slice_sizes  # how a stage's replicas split a micro-batch, as the runtime does
from planner.formats.constants import ALLREDUCE_BUCKET_BYTES  # gradients are all-reduced in such buckets

PASS_OVERHEAD_MS = 0.2
DEFAULT_OPTIMIZER_MULTIPLIER = 2.0  # Adam: two extra copies (m, v) of every weight
# Policy B (more warm-up forwards) when the activation-communication ratio is at least this:
# the paper picks B for VGG-19 (ACR 0.16) and GNMT-16 (0.10), A for BERT-48 (0.06), XLNet (0.03)
# (section 6.4; activation_communication_ratio follows the paper's definition and scale).
ACR_POLICY_B_THRESHOLD = 0.08


class Prefix:
    """Prefix sums over a ModelProfile for O(1) stage costs."""

    def __init__(self, model: ModelProfile):
        self.model = model
        n = model.num_layers
        self.fwd = [0.0] * (n + 1)
        self.bwd = [0.0] * (n + 1)
        self.params = [0.0] * (n + 1)
        self.kept = [0.0] * (n + 1)
        self.inputs = [0.0] * (n + 1)
        self.bwd_input = [0.0] * (n + 1) if model.backward_input_ms else None
        self._largest = {}
        self._working = {}
        for i in range(n):
            self.fwd[i + 1] = self.fwd[i] + model.forward_ms[i]
            self.bwd[i + 1] = self.bwd[i] + model.backward_ms[i]
            self.params[i + 1] = self.params[i] + model.parameter_bytes[i]
            self.kept[i + 1] = self.kept[i] + model.kept_bytes[i]
            self.inputs[i + 1] = self.inputs[i] + model.input_bytes[i]
            if self.bwd_input is not None:
                self.bwd_input[i + 1] = self.bwd_input[i] + model.backward_input_ms[i]
        # cut[c] = per-sample bytes crossing the boundary before layer c
        diff = [0.0] * (n + 2)
        for i in range(n):
            if model.last_use[i] > i:
                diff[i + 1] += model.activation_bytes[i]
                diff[model.last_use[i] + 1] -= model.activation_bytes[i]
        self.cut = [0.0] * (n + 1)
        running = 0.0
        for c in range(n + 1):
            running += diff[c]
            self.cut[c] = running

    def forward_per_sample(self, first: int, end: int) -> float:
        return self.fwd[end] - self.fwd[first]

    def backward_per_sample(self, first: int, end: int) -> float:
        return self.bwd[end] - self.bwd[first]

    def backward_input_per_sample(self, first: int, end: int) -> Optional[float]:
        """The part of the backward the stage's input gradients need; None when the profile does not split it."""
        return None if self.bwd_input is None else self.bwd_input[end] - self.bwd_input[first]

    def parameter_bytes(self, first: int, end: int) -> float:
        return self.params[end] - self.params[first]

    def kept_per_sample(self, first: int, end: int) -> float:
        """Bytes layers [first, end) keep for their backward, per sample (planner/formats/memory_figures.py)."""
        return self.kept[end] - self.kept[first]

    def largest_layer_parameters(self, first: int, end: int) -> float:
        """Parameter bytes of the largest layer in [first, end) (cached per range)."""
        key = (first, end)
        v = self._largest.get(key)
        if v is None:
            v = self._largest[key] = max(self.model.parameter_bytes[first:end], default=0.0)
        return v

    def largest_working_per_sample(self, first: int, end: int) -> float:
        """Backward working bytes per sample a stage of layers [first, end) holds beyond one slice's
        kept bytes (cached per range; memory_model.stage_working_bytes)."""
        key = (first, end)
        v = self._working.get(key)
        if v is None:
            v = self._working[key] = stage_working_bytes(self.model.working_bytes, first, end, 1,
                                                             self.model.kept_bytes)
        return v

    def input_per_sample(self, first: int, end: int) -> float:
        """Bytes of model inputs layers [first, end) read directly, per sample."""
        return self.inputs[end] - self.inputs[first]


def largest_slice(samples: int, replicas: int) -> int:
    return -(-samples // replicas)


def stage_forward_ms(prefix: Prefix, first: int, end: int, micro_batch_size: int, replicas: int,
                     overhead_ms: float = PASS_OVERHEAD_MS) -> float:
    """Forward time of layers [first, end) for one micro-batch on the largest replica slice."""
    return largest_slice(micro_batch_size, replicas) * prefix.forward_per_sample(first, end) + overhead_ms


def stage_backward_ms(prefix: Prefix, first: int, end: int, micro_batch_size: int, replicas: int,
                      overhead_ms: float = PASS_OVERHEAD_MS) -> float:
    """Backward time of layers [first, end) for one micro-batch on the largest replica slice."""
    return largest_slice(micro_batch_size, replicas) * prefix.backward_per_sample(first, end) + overhead_ms


def stage_backward_input_ms(prefix: Prefix, first: int, end: int, micro_batch_size: int, replicas: int,
                            overhead_ms: float = PASS_OVERHEAD_MS, first_stage_splits: bool = False) -> Optional[float]:
    """How long into a backward the input gradients of layers [first, end) are ready (the runtime
    computes them before the weight gradients on every stage but the first, and on the first too with
    `first_stage_splits`: schedule dapple-batched-w); None: not profiled."""
    per_sample = prefix.backward_input_per_sample(first, end)
    if per_sample is None or (first == 0 and not first_stage_splits):
        return None
    return largest_slice(micro_batch_size, replicas) * per_sample + overhead_ms


def cut_bytes(prefix: Prefix, cut: int, samples: int = 1) -> float:
    """Bytes crossing the boundary before layer `cut` for `samples` samples."""
    return prefix.cut[cut] * samples


def transfer_ms(cluster, src_devices: Sequence[int], dst_devices: Sequence[int], bytes_per_sample: float,
                samples: int, contention: bool = False) -> float:
    """Time to move a micro-batch's boundary tensors from one stage's devices to the next's.

    Handles 1:1, split (1:N), concat (N:1) and N:M; samples on the same device move for free.
    Per-pair links (the paper's model) unless `contention` (shared ports; module docstring).
    """
    if bytes_per_sample <= 0 or samples <= 0:
        return 0.0
    return bytes_per_sample * transfer_ms_per_byte(cluster, tuple(src_devices), tuple(dst_devices), samples,
                                                   contention)


def moved_samples(src: Sequence[int], dst: Sequence[int], samples: int):
    """[(source device, destination device, samples)] of a re-slicing, in sample order (the
    sender's and the receiver's slices are contiguous, larger slices first)."""
    a = slice_sizes(samples, len(src))
    b = slice_sizes(samples, len(dst))
    out = []
    i = j = 0
    ra, rb = a[0], b[0]
    while i < len(a) and j < len(b):
        n = min(ra, rb)
        if n > 0:
            out.append((src[i], dst[j], n))
        ra -= n
        rb -= n
        if ra == 0:
            i += 1
            ra = a[i] if i < len(a) else 0
        if rb == 0:
            j += 1
            rb = b[j] if j < len(b) else 0
    return out


def transfer_ms_per_byte(cluster, src: Tuple[int, ...], dst: Tuple[int, ...], samples: int,
                         contention: bool = False) -> float:
    """transfer_ms for 1 byte per sample (the transfer time is linear in the bytes)."""
    per_server = cluster.devices_per_server
    intra_bw, inter_bw = cluster.intra_server_bandwidth, cluster.inter_server_bandwidth
    if not contention:
        worst = 0.0
        for s, d, n in moved_samples(src, dst, samples):
            if s != d:
                worst = max(worst, n / (intra_bw if s // per_server == d // per_server else inter_bw))
        return 1e3 * worst
    dev_out, dev_in, nic_out, nic_in = {}, {}, {}, {}
    for s, d, n in moved_samples(src, dst, samples):
        if s == d:
            continue
        ss, ds = s // per_server, d // per_server
        if ss == ds:
            dev_out[s] = dev_out.get(s, 0) + n
            dev_in[d] = dev_in.get(d, 0) + n
        else:
            nic_out[ss] = nic_out.get(ss, 0) + n
            nic_in[ds] = nic_in.get(ds, 0) + n
    intra = max(list(dev_out.values()) + list(dev_in.values()) + [0])
    inter = max(list(nic_out.values()) + list(nic_in.values()) + [0])
    return 1e3 * max(intra / intra_bw, inter / inter_bw)


def allreduce_ms(cluster, devices: Sequence[int], nbytes: float) -> float:
    """Gradient AllReduce time of `nbytes` over `devices` (hierarchical across servers)."""
    if nbytes <= 0 or len(devices) <= 1:
        return 0.0
    return nbytes * allreduce_ms_per_byte(cluster, devices)


def allreduce_ms_per_byte(cluster, devices: Sequence[int]) -> float:
    counts = {}
    for d in devices:
        s = d // cluster.devices_per_server
        counts[s] = counts.get(s, 0) + 1
    k = len(counts)
    c = max(counts.values())
    intra = 2.0 * (c - 1) / c / cluster.intra_server_bandwidth if c > 1 else 0.0
    inter = 2.0 * (k - 1) / k / (cluster.allreduce_bandwidth or cluster.inter_server_bandwidth) if k > 1 else 0.0
    return 1e3 * (intra + inter)


def compute_scale(cluster, stages) -> float:
    """Cluster.concurrent_compute_slowdown for plans that compute on several devices at once, else 1."""
    devices = {d for _, _, devs in stages for d in devs}
    slowdown = cluster.concurrent_compute_slowdown
    return slowdown if len(devices) > 1 and slowdown > 1 else 1.0


def overlaps_allreduce(cluster, overlap: bool = True) -> bool:
    """Whether gradient AllReduce runs during the last backward on this cluster (not where the devices' own
    cores do the communication: Cluster.communication_uses_compute)."""
    return overlap and not cluster.communication_uses_compute


def allreduce_tail_ms(model: ModelProfile, first: int, end: int, slice_samples: int, ar_ms_per_byte: float,
                      bucket_bytes: float = ALLREDUCE_BUCKET_BYTES) -> float:
    """AllReduce time left after the stage's last backward pass when gradients are reduced in buckets
    as soon as the last micro-batch's backward produces them (what dapple_tf/rewrite/update/gradients.py does).

    Layers run backward from end-1 down to first; a bucket closes once it holds `bucket_bytes` of
    parameters (the last one may hold less) and is ready when the backward of its first layer ends;
    the link reduces one bucket at a time. Returns the end of the last bucket's AllReduce minus the
    end of the backward pass (0 if it finished before).
    """
    done = 0.0       # time since the last backward began: end of the backward computed so far
    link_free = 0.0  # when the link finishes the buckets closed so far
    bucket = 0.0
    for k in range(end - 1, first - 1, -1):
        done += model.backward_ms[k] * slice_samples
        bucket += model.parameter_bytes[k]
        if bucket >= bucket_bytes or k == first:
            if bucket > 0:
                link_free = max(link_free, done) + bucket * ar_ms_per_byte
            bucket = 0.0
    return max(0.0, link_free - done)


def memory_bytes(prefix: Prefix, first: int, end: int, slice_samples: int, in_flight: int,
                 optimizer_multiplier: float = DEFAULT_OPTIMIZER_MULTIPLIER, extra_bytes: float = 0.0,
                 num_micro_batches: int = 1, recompute: bool = False) -> float:
    """Peak memory of one device of a stage (planner/planning/memory_model.py):
    - weights, gradients and optimizer state: (2 + optimizer_multiplier) x parameters; when
      gradients accumulate over micro-batches (num_micro_batches > 1) the runtime adds each
      variable's micro-batch gradient into its running sum as it is produced, so one more layer's
      gradient (the largest) is alive with the sums;
    - what the stage keeps for backward for each of its `in_flight` micro-batch slices (kept bytes
      per sample x slice);
    - the model inputs its layers read, for all its slices of the global batch
      (num_micro_batches x slice: the runtime splits the global batch it is given);
    - one slice of its largest layer's backward working memory (one backward runs at a time).
    With `recompute` (re-computation, GPipe's): per in-flight slice only the stage's boundary
    inputs (the bytes crossing the cut before `first`), plus one slice's kept bytes while its
    backward recomputes the forward."""
    params = prefix.parameter_bytes(first, end)
    transient = prefix.largest_layer_parameters(first, end) if num_micro_batches > 1 else 0.0
    if recompute:
        activations = in_flight * slice_samples * prefix.cut[first] + slice_samples * prefix.kept_per_sample(first, end)
    else:
        activations = in_flight * slice_samples * prefix.kept_per_sample(first, end)
    working = slice_samples * prefix.largest_working_per_sample(first, end)
    return (params * (2.0 + optimizer_multiplier) + transient + activations + working
            + num_micro_batches * slice_samples * prefix.input_per_sample(first, end) + extra_bytes)


def pivot_stage(forward: Sequence[float], backward: Sequence[float], num_micro_batches: int) -> int:
    """The paper's Algorithm 1: start from Q = S-1 and move Q to an earlier stage s whenever its
    bubble-free steady phase (M-1)(F_s+B_s) exceeds Q's plus the F+B of stages between them."""
    m1 = num_micro_batches - 1
    q = len(forward) - 1
    between = 0.0  # sum of F+B over stages s+1 .. q-1
    for s in range(q - 1, -1, -1):
        if s + 1 < q:
            between += forward[s + 1] + backward[s + 1]
        if m1 * (forward[s] + backward[s]) > m1 * (forward[q] + backward[q]) + between:
            q = s
            between = 0.0
    return q


def pivot_wait_ms(forward: Sequence[float], backward: Sequence[float], q: int, num_micro_batches: int,
                  warmup: Optional[int] = None) -> float:
    """How long the pivot Q waits for the stages after it (the 'internal bubbles' formula 2 leaves out).

    RT = sum_{s>Q} (F_s + B_s) is one micro-batch's round trip from the end of Q's forward to its
    gradient's arrival. With K = min(K_Q, M) warm-up forwards, Q's first backward waits
    RT - (K-1) F_Q (the other warm-up forwards fill the rest). With M > K there is more: each of the
    M - K steady cycles waits RT / (K-1) - (F_Q + B_Q) (a micro-batch's forward and backward on Q are
    K-1 cycles apart, which must cover its round trip: slow links under policy A), and the last
    backward waits RT - (K-1) B_Q (only the K-1 backwards before it fill the trip). None is negative.
    K_Q defaults to policy A's: the number of computation stages from Q on (computation and
    communication stages alternate). A communication stage as pivot has its sender's K (what the
    sender has in flight is what the link can move while one micro-batch is away).
    """
    trip = sum(forward[q + 1:]) + sum(backward[q + 1:])
    if trip <= 0.0:
        return 0.0
    k = warmup if warmup is not None else (len(forward) - (q - q % 2) + 1) // 2
    k = max(1, min(k, num_micro_batches))
    f, b = forward[q], backward[q]
    wait = max(0.0, trip - (k - 1) * f)
    if num_micro_batches > k:
        cycle_wait = trip if k == 1 else max(0.0, trip / (k - 1) - (f + b))
        wait += (num_micro_batches - k) * cycle_wait + max(0.0, trip - (k - 1) * b)
    return wait


def pipeline_latency(forward: Sequence[float], backward: Sequence[float], allreduce: Sequence[float],
                     num_micro_batches: int, warmup: Optional[Sequence[int]] = None
                     ) -> Tuple[float, float, float, float, int]:
    """(L, Tw, Ts, Te, Q) of paper formula 2 over all stages (communication stages included,
    with allreduce 0). `allreduce[s]` is what stage s's gradient sync adds after its last backward;
    `warmup[i]` is computation stage i's K_i (default: policy A).

    Tw = sum_{s<=Q} F_s. Ts = (M-1)(F_Q+B_Q) + pivot_wait_ms: the wait is ours. The paper's Ts
    leaves out the pivot's waits for the stages after it (it calls them the pivot's internal bubbles);
    they are zero when Q is the last stage (the paper's Fig. 4), but with Q earlier and few
    micro-batches they are most of the pipeline's fill: without them formula 2 prefers M=2..4 with
    the heaviest stage first, plans that simulate 23-114% slower than their L (WORKSPACE_NOTES.md,
    "Planner fidelity").
    Te = max over s of: s <= Q: AR_s + sum_{a=s..Q} B_a; s > Q: AR_s - sum_{a=Q+1..s-1} B_a
    (a stage after Q finished its last backward that long before Q's last backward began; the
    paper prints the sum from Q to s, which subtracts B_Q and B_s as well).
    """
    q = pivot_stage(forward, backward, num_micro_batches)
    tw = sum(forward[: q + 1])
    k = warmup[q // 2] if warmup is not None else None  # a communication stage: its sender's
    ts = (num_micro_batches - 1) * (forward[q] + backward[q]) + pivot_wait_ms(forward, backward, q, num_micro_batches, k)
    te = 0.0
    acc = 0.0
    for s in range(q, -1, -1):
        acc += backward[s]
        te = max(te, allreduce[s] + acc)
    acc = 0.0
    for s in range(q + 1, len(forward)):
        te = max(te, allreduce[s] - acc)
        acc += backward[s]
    return tw + ts + te, tw, ts, te, q


def activation_communication_ratio(compute_ms: Sequence[float], comm_ms: Sequence[float]) -> float:
    """ACR (paper sections 5.3, 6.2): mean over stage boundaries of the boundary's forward +
    backward transfer time `comm_ms[i]` over the average forward/backward pass time of its two
    neighbouring stages, (F + B) / 2 with `compute_ms` = F + B per stage; 0 for one stage."""
    if len(compute_ms) < 2:
        return 0.0
    ratios = []
    for i, c in enumerate(comm_ms):
        denom = 0.25 * (compute_ms[i] + compute_ms[i + 1])
        ratios.append(c / denom if denom > 0 else math.inf)
    return sum(ratios) / len(ratios)
