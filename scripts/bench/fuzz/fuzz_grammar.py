"""The random equivalence harness's cases as plain data (no TensorFlow here): a model drawn from a small grammar
of layers and a plan drawn from what the runtime supports, both from one seed, and the smaller cases a failing one
shrinks to.

A model is a list of layers over one of four inputs: `flat` ([batch, 12] floats), `image` ([batch, 6, 6, 3]),
`tokens` ([batch, 5] ids) or `time_tokens` (the same ids, the model time-major). Layer kinds, by the rank they work on (fuzz_models.py builds them):
- flat: dense, layer_norm, batch_norm (tf.nn.moments over the batch, moving statistics in UPDATE_OPS),
  keras_dense, skip (adds an earlier flat output of the same width), shape_rows (reshapes with the batch size the
  first layer read from tf.shape, to [batch * 2, width / 2] and back);
- image: conv, batch_norm4d (a training-mode fused batch norm), then flatten;
- tokens: embedding, attention (one head, masked by id != 0), rows (a dense layer on [batch * seq, width] rows,
  which it leaves in that shape: 5 rows a sample cross the next boundary), then mean over the sequence;
- time_tokens: time_embedding (the ids transposed, looked up: [seq, batch, width]), time_attention (einsums over
  [seq, batch, width], masked by a [q, k, batch] mask made from the ids), then time_pool (mean over the sequence):
  what crosses a boundary before the pool has its batch on axis 1. Half the token cases are drawn time-major (a
  draw of its own, so the other cases of a seed stay what they were).
Every model ends with a `head` layer (dense to 3 classes, softmax cross-entropy).

A plan cuts the layers into 1-4 stages, replicates each on 1-3 devices (at most 8 in all), picks M (1-8, each
replica getting a sample), a schedule, re-computation, stage functions, batch norm mode and, for some cases, a
cluster of worker processes (gRPC) instead of one process's virtual devices (three in four of those built per
host: one graph per worker task).
"""

import dataclasses
import json
import random
from typing import Dict, Iterator, List, Optional, Tuple

MAX_DEVICES = 8
SCHEDULES = ("dapple", "gpipe", "zb-h1", "zb-h2", "dapple-batched-w")
FLAT_KINDS = ("dense", "layer_norm", "batch_norm", "keras_dense", "skip", "shape_rows")
IMAGE_KINDS = ("conv", "batch_norm4d")
TOKEN_KINDS = ("attention", "rows")
BATCH_NORMS = ("batch_norm", "batch_norm4d")


class CaseError(ValueError):
    """A case that cannot be drawn or run as given (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    index: int
    input: str  # flat, image, tokens or time_tokens
    layers: Tuple[str, ...]  # kinds, in order; the last is "head"
    batch: int
    stages: Tuple[Tuple[int, int, int], ...]  # (first layer, last layer, replicas)
    micro_batches: int
    schedule: str
    recompute: Tuple[int, ...]  # stage indices
    stage_functions: bool
    batch_norm: str  # per_slice or sync
    cluster: bool  # stages on worker processes (gRPC) instead of this process's virtual devices

    @property
    def devices(self) -> int:
        return sum(r for _, _, r in self.stages)

    @property
    def per_host(self) -> bool:
        """Three cluster cases in four (index not a multiple of 4) build one graph per worker task
        (PipelineOptions.own_task) where the runtime allows the case per host, the others one graph for the
        cluster."""
        return self.cluster and self.index % 4 != 0

    @property
    def has_batch_norm(self) -> bool:
        return any(k in BATCH_NORMS for k in self.layers)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Case":
        try:
            fields = json.loads(text)
            case = cls(**{k: tuple(map(tuple, v)) if k == "stages" else tuple(v) if isinstance(v, list) else v
                          for k, v in fields.items()})
        except (TypeError, ValueError) as e:
            raise CaseError(f"not a fuzz case: {text[:200]!r} ({e})") from None
        check(case)
        return case

    def describe(self) -> str:
        shape = ":".join(str(r) for _, _, r in self.stages)
        options = [self.schedule, f"M={self.micro_batches}"]
        if self.recompute:
            options.append(f"recompute {list(self.recompute)}")
        if self.stage_functions:
            options.append("functions")
        if self.has_batch_norm:
            options.append(f"bn {self.batch_norm}")
        if self.cluster:
            options.append("cluster per host" if self.per_host else "cluster")
        return f"{self.input} [{', '.join(self.layers)}] batch {self.batch}, stages {shape}, {', '.join(options)}"


def parse_seed(text: str) -> int:
    """A seed: a non-negative integer (decimal or 0x hex)."""
    try:
        seed = int(text, 0)
    except (TypeError, ValueError):
        raise CaseError(f"--seed={text!r}: a seed is a non-negative integer (e.g. 7 or 0x1f)") from None
    if seed < 0:
        raise CaseError(f"--seed={text!r}: a seed is a non-negative integer")
    return seed


def numpy_seed(*parts: int) -> int:
    """A seed for numpy's RandomState (0 <= seed < 2**32) from any non-negative integers: the parts mixed as before
    (seed * 7919 + index), folded into numpy's range, so a seed like a date (20261207) or any larger one works; the
    seeds of every earlier run are unchanged."""
    mixed = 0
    for part in parts:
        mixed = mixed * 7919 + part
    return mixed % 2**32


def _layers(rng: random.Random, kind: str) -> List[str]:
    if kind == "image":
        body = [rng.choice(IMAGE_KINDS) for _ in range(rng.randint(1, 3))]
        return ["conv"] + body + ["flatten"] + [rng.choice(FLAT_KINDS[:4]) for _ in range(rng.randint(0, 2))]
    if kind == "tokens":
        return ["embedding"] + [rng.choice(TOKEN_KINDS) for _ in range(rng.randint(1, 3))] + ["pool"]
    return ["dense"] + [rng.choice(FLAT_KINDS) for _ in range(rng.randint(1, 5))]


_TIME_MAJOR = {"embedding": "time_embedding", "attention": "time_attention", "rows": "time_attention",
               "pool": "time_pool"}


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw(seed: int, index: int, cluster_share: float = 0.1) -> Case:
    """Case `index` of `seed`: the same every time."""
    rng = random.Random(f"{seed}/{index}")
    kind = rng.choice(("flat", "flat", "image", "tokens"))
    layers = _layers(rng, kind) + ["head"]
    if kind == "tokens" and random.Random(f"{seed}/{index}/time-major").random() < 0.5:
        kind, layers = "time_tokens", [_TIME_MAJOR.get(layer, layer) for layer in layers]
    num_stages = rng.randint(1, min(4, len(layers)))
    cuts = sorted(rng.sample(range(1, len(layers)), num_stages - 1))
    bounds = list(zip([0] + cuts, [c - 1 for c in cuts] + [len(layers) - 1]))
    replicas = [rng.choice((1, 1, 2, 3)) for _ in bounds]
    while sum(replicas) > MAX_DEVICES:
        replicas[replicas.index(max(replicas))] -= 1
    batch = rng.choice((6, 8, 10, 12, 16))
    ms = [m for m in _divisors(batch) if m <= 8 and batch // m >= max(replicas)]
    micro_batches = rng.choice(ms)
    schedule = rng.choice(SCHEDULES)
    recompute = tuple(s for s in range(num_stages) if schedule != "dapple-batched-w" and rng.random() < 0.2)
    case = Case(seed=seed, index=index, input=kind, layers=tuple(layers), batch=batch,
                stages=tuple((a, b, r) for (a, b), r in zip(bounds, replicas)), micro_batches=micro_batches,
                schedule=schedule, recompute=recompute, stage_functions=rng.random() < 0.3,
                batch_norm=rng.choice(("per_slice", "sync")), cluster=rng.random() < cluster_share)
    check(case)
    return case


def check(case: Case, max_devices: int = MAX_DEVICES) -> None:
    """A CaseError naming what the runtime cannot run (more devices than there are, an uneven cut)."""
    if case.devices > max_devices:
        raise CaseError(f"case {case.seed}/{case.index} needs {case.devices} devices; the harness has {max_devices}")
    if not case.layers or case.layers[-1] != "head":
        raise CaseError(f"case {case.seed}/{case.index}: the last layer must be the head")
    covered = [i for a, b, _ in case.stages for i in range(a, b + 1)]
    if covered != list(range(len(case.layers))):
        raise CaseError(f"case {case.seed}/{case.index}: stages {case.stages} do not cover layers 0..{len(case.layers) - 1}")
    if case.batch % case.micro_batches or case.batch // case.micro_batches < max(r for _, _, r in case.stages):
        raise CaseError(f"case {case.seed}/{case.index}: {case.micro_batches} micro-batches of a batch of "
                        f"{case.batch} leave a replica without samples")
    if case.schedule not in SCHEDULES:
        raise CaseError(f"case {case.seed}/{case.index}: unknown schedule {case.schedule!r}")


def _valid(case: Case) -> Optional[Case]:
    try:
        check(case)
    except CaseError:
        return None
    return case


def smaller(case: Case) -> Iterator[Case]:
    """Cases one step simpler than `case` (fewer options, devices, micro-batches, stages, layers), simplest
    changes first; each still valid."""
    r = dataclasses.replace
    candidates = [r(case, cluster=False), r(case, stage_functions=False), r(case, recompute=()),
                  r(case, schedule="dapple"), r(case, micro_batches=1)]
    if case.has_batch_norm:
        candidates.append(r(case, batch_norm="per_slice"))
    for s, (a, b, n) in enumerate(case.stages):
        if n > 1:
            candidates.append(r(case, stages=case.stages[:s] + ((a, b, n - 1),) + case.stages[s + 1:]))
    for s in range(len(case.stages) - 1):  # two stages merged
        (a, _, n), (_, b, m) = case.stages[s], case.stages[s + 1]
        merged = case.stages[:s] + ((a, b, max(n, m)),) + case.stages[s + 2:]
        candidates.append(r(case, stages=merged, recompute=tuple(x - (x > s) for x in case.recompute if x != s + 1)))
    for i, kind in enumerate(case.layers[:-1]):  # a layer dropped (not the input's first, nor a shape change)
        if i == 0 or kind in ("flatten", "pool", "embedding", "time_embedding", "time_pool"):
            continue
        layers = case.layers[:i] + case.layers[i + 1:]
        stages = tuple((a - (a > i), b - (b >= i), n) for a, b, n in case.stages if not (a == b == i))
        candidates.append(r(case, layers=layers, stages=stages))
    seen = set()
    for candidate in candidates:
        if candidate != case and candidate not in seen and _valid(candidate) is not None:
            seen.add(candidate)
            yield candidate


def summary(cases: List[Case]) -> Dict[str, int]:
    """How often each feature was drawn, for the harness's closing line."""
    counts: Dict[str, int] = {}
    for case in cases:
        for key in [case.input, case.schedule, f"{len(case.stages)} stages"] + list(case.layers):
            counts[key] = counts.get(key, 0) + 1
    return counts
