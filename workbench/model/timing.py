"""Timing records: what one forward step cost, per layer and per part, and the bytes and
floating-point operations it had to do, so every step can be set against both the measured
bandwidth and the FMA peak.

    PARTS         the parts a layer's time is split into; every table and figure iterates
                  over this tuple (the tensor-parallel layer adds communication here)
    StepRecord    one prefill or decode step
    Timings       the records of one generation, with the summaries people ask for

One definition per quantity, used by every summary, table, report and figure:

    decode step ms        the median over decode steps of a step's forward pass
                          (StepRecord.total_s): a slow first step or a stray one moves it little
    per-layer / per-part  the median over steps of each layer's (or part's) time
    decode tokens/s       tokens after the first, all sequences, over the wall time of all
                          decode steps, sampling and streaming included (a throughput)
    GB/s, GFLOP/s         total bytes (or FLOPs) over total step time, never a mean of
                          per-step rates
    thread wake-up        the median over steps of waking the thread pool before layer 0
                          (the fused step does it apart, so it is not booked to layer 0)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Part:
    name: str  # key in StepRecord.parts_s and the "<name>_ms" columns of per_layer()
    label: str  # for people
    color: str  # for figures


PARTS: tuple[Part, ...] = (
    Part("attention", "attention (QKV, RoPE, cache append, attention, o_proj)", "#636efa"),
    Part("mlp", "MLP (gate/up, SiLU, down)", "#ef553b"),
    Part("other", "norms and residual adds", "#00cc96"),
    # Tensor parallel only (workbench.distributed.tp): the all-reduces after o_proj and
    # down_proj, taken out of the attention and MLP times they happen in. 0 in one process.
    Part("comm", "communication (all-reduce after o_proj and down_proj)", "#ab63fa"),
)
PART_NAMES = tuple(p.name for p in PARTS)


@dataclass
class StepRecord:
    """One forward step (a prefill or one decode step) of all sequences."""

    phase: str  # "prefill" or "decode"
    tokens: int  # tokens processed (all sequences)
    parts_s: dict[str, list[float]]  # part name -> seconds per layer
    head_s: float  # embedding, final norm, LM head
    # Bytes the step must read: each layer's weights (norms included), the KV cache its
    # attention reads (scales included; 0 in prefill, whose attention reads fresh K and V),
    # and the head's: embedding rows gathered, final norm, LM head weights.
    weight_bytes: list[int]
    kv_bytes: list[int]
    head_bytes: int
    total_s: float
    # Per layer: 2 x tokens x the layer's linear weights, plus attention's Q K^T and P V
    # over the (query, key) pairs it computes (causal prefill: n (n + 1) / 2 per sequence).
    flops: list[int] = field(default_factory=list)
    head_flops: int = 0  # the LM head over the rows it projects
    # Tensor parallel: the head's collectives (token broadcast, LM-head exchange; part of
    # head_s) and the payload bytes this rank sent in all of the step's collectives.
    head_comm_s: float = 0.0
    comm_bytes: int = 0
    # Tensor parallel: every rank's comm_s of this step, by rank (this record is rank 0's, so
    # rank_comm_s[0] == comm_s). They differ: a rank whose part of a layer is smaller waits
    # for the others at the all-reduce that ends it, and that wait counts as its communication.
    rank_comm_s: list[float] = field(default_factory=list)
    # Tensor parallel: of comm_s, the time this rank waited in its collectives for the other
    # ranks to arrive (the ranks' imbalance, not the collectives' own cost), where the backend
    # can tell (shm); None where it cannot (gloo, oneCCL) and in one process.
    comm_wait_s: float | None = None
    # Tensor parallel: every rank's comm_wait_s of this step, by rank (rank 0's first): the
    # rank with the lighter share of a layer is the one that waits.
    rank_comm_wait_s: list[float | None] = field(default_factory=list)
    # Waking the thread pool before the first layer (the fused step does it apart, outside
    # the layers' times; part of head_s): after an idle gap between steps the workers sleep.
    wake_s: float = 0.0
    # Which path ran a decode step: "fused" (every layer in one C++ call, LlamaModel.decode)
    # or "reference" (the Python loop over the same kernels); "" for a prefill.
    path: str = ""
    # A mixture of experts: per layer, the tokens the step routed to each expert ([] for a
    # dense model); on a rank of a cluster, every token's routing (each rank routes them all).
    expert_tokens: list[list[int]] = field(default_factory=list)

    @property
    def comm_s(self) -> float:
        """All communication of the step: the layers' all-reduces and the head's collectives."""
        return sum(self.parts_s.get("comm", ())) + self.head_comm_s

    @property
    def bytes_read(self) -> int:
        """Every byte the step had to read: layers' weights, KV cache, head."""
        return sum(self.weight_bytes) + sum(self.kv_bytes) + self.head_bytes

    @property
    def total_flops(self) -> int:
        return sum(self.flops) + self.head_flops

    @property
    def n_layers(self) -> int:
        return len(self.weight_bytes)

    def gbps(self) -> float:
        return self.bytes_read / self.total_s / 1e9 if self.total_s else 0.0

    def gflops(self) -> float:
        return self.total_flops / self.total_s / 1e9 if self.total_s else 0.0


class Clock:
    """Accumulates per-layer part times when enabled; costs one branch per part otherwise."""

    def __init__(self, enabled: bool, n_layers: int):
        self.enabled = enabled
        self.t = time.perf_counter
        self.parts_s = {name: [0.0] * n_layers for name in PART_NAMES} if enabled else {}

    def add(self, part: str, layer: int, seconds: float) -> None:
        self.parts_s[part][layer] += seconds


def _rate(steps: list[StepRecord], amount) -> float:
    seconds = sum(s.total_s for s in steps)
    return sum(amount(s) for s in steps) / seconds / 1e9 if seconds else 0.0


@dataclass
class Timings:
    """Per-step records of one generation."""

    steps: list[StepRecord] = field(default_factory=list)
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0  # wall time of all decode steps
    decode_tokens: int = 0  # tokens produced by decode steps (all sequences)

    @property
    def prefill(self) -> StepRecord | None:
        return next((s for s in self.steps if s.phase == "prefill"), None)

    @property
    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.phase == "decode"]

    def phase_steps(self, phase: str) -> list[StepRecord]:
        return [s for s in self.steps if s.phase == phase]

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first, all sequences of the batch, wall time."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def step_ms(self, phase: str = "decode") -> float:
        """The median over the phase's steps of a step's forward pass, in ms (0 without steps)."""
        steps = self.phase_steps(phase)
        return 1e3 * statistics.median(s.total_s for s in steps) if steps else 0.0

    @property
    def wake_ms(self) -> float:
        """The median over decode steps of waking the thread pool before layer 0, in ms."""
        steps = self.decode_steps
        return 1e3 * statistics.median(s.wake_s for s in steps) if steps else 0.0

    def gbps(self, phase: str = "decode") -> float:
        """Achieved bandwidth of the phase: all bytes its steps read / their total time."""
        return _rate(self.phase_steps(phase), lambda s: s.bytes_read)

    def gflops(self, phase: str = "decode") -> float:
        """Achieved arithmetic rate of the phase: all FLOPs / total time (set it against the
        FMA peak as gbps against the bandwidth: the one nearer its peak bounds the phase)."""
        return _rate(self.phase_steps(phase), lambda s: s.total_flops)

    def per_layer(self, phase: str = "decode") -> list[dict]:
        """Milliseconds of each part, for each layer: the median over the phase's steps."""
        steps = self.phase_steps(phase)
        if not steps:
            return []
        return [{"layer": i, **{f"{p}_ms": 1e3 * statistics.median(s.parts_s[p][i] for s in steps)
                                for p in PART_NAMES}}
                for i in range(steps[0].n_layers)]

    def expert_load(self, phase: str | None = None) -> list[list[int]]:
        """A mixture of experts' tokens per expert per layer ([layers][experts]), summed over
        the phase's steps (None: every step); [] for a dense model."""
        steps = [s for s in (self.steps if phase is None else self.phase_steps(phase)) if s.expert_tokens]
        if not steps:
            return []
        return [[sum(col) for col in zip(*(s.expert_tokens[i] for s in steps))] for i in range(len(steps[0].expert_tokens))]

    def per_part_ms(self, phase: str = "decode") -> dict[str, float]:
        """Each part's milliseconds per step, all layers: the median over steps of the part's
        per-step total."""
        steps = self.phase_steps(phase)
        if not steps:
            return {}
        return {p: 1e3 * statistics.median(sum(s.parts_s[p]) for s in steps) for p in PART_NAMES}

    def summary(self) -> dict:
        return {
            "prefill_ms": 1e3 * self.prefill.total_s if self.prefill else 0.0,
            "time_to_first_token_ms": 1e3 * self.time_to_first_token_s,
            "decode_step_ms": self.step_ms("decode"),
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "decode_gbps": self.gbps("decode"),
            "decode_gflops": self.gflops("decode"),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (f"<Timings: {len(self.decode_steps)} decode steps | prefill {s['prefill_ms']:.1f} ms, first token "
                f"{s['time_to_first_token_ms']:.1f} ms | decode {s['decode_tokens_per_s']:.1f} tokens/s "
                f"(all sequences), {s['decode_gbps']:.2f} GB/s, {s['decode_gflops']:.1f} GFLOP/s>")

    def _repr_html_(self) -> str:
        s = self.summary()
        rows = [("prefill", f"{s['prefill_ms']:.1f} ms"), ("time to first token", f"{s['time_to_first_token_ms']:.1f} ms"),
                ("decode step", f"{s['decode_step_ms']:.2f} ms (median of {len(self.decode_steps)} steps)"),
                ("decode", f"{s['decode_tokens_per_s']:.1f} tokens/s (all sequences, over the wall time)"),
                ("decode bandwidth", f"{s['decode_gbps']:.2f} GB/s (bytes read / step time)"),
                ("decode arithmetic", f"{s['decode_gflops']:.1f} GFLOP/s")]
        for phase in ("prefill", "decode"):
            totals = self.per_part_ms(phase)
            if totals:
                split = ", ".join(f"{p.label.split(' (')[0]} {totals[p.name]:.2f} ms" for p in PARTS)
                rows.append((f"{phase} step, all layers (median)", split))
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{v}</td></tr>"
                       for k, v in rows)
        return f"<table>{body}</table>"

    def per_part_text(self, phase: str = "decode") -> str:
        """'per decode step (median of N), all L layers: attention x ms (a% of the step), ...':
        the split of a step, each part's share of the median step."""
        layers = self.per_layer(phase)
        if not layers:
            return ""
        totals = self.per_part_ms(phase)
        step = self.step_ms(phase) or 1.0
        shown = [p for p in PARTS if totals[p.name] or p.name != "comm"]  # no empty comm line in one process
        parts = ", ".join(f"{p.label.split(' (')[0]} {totals[p.name]:.2f} ms ({100 * totals[p.name] / step:.0f}%)"
                          for p in shown)
        n = len(self.phase_steps(phase))
        rest = step - sum(totals.values())
        wake = f", of which thread wake-up {self.wake_ms:.2f} ms" if phase == "decode" and self.wake_ms else ""
        slowest = max(layers, key=lambda r: sum(r[f"{p}_ms"] for p in PART_NAMES))
        return (f"per {phase} step ({step:.2f} ms, median of {n}), all {len(layers)} layers: {parts}; outside the "
                f"layers (embedding, LM head{', collectives' if totals.get('comm') else ''}) {rest:.2f} ms{wake}\n"
                f"slowest layer {slowest['layer']}: {sum(slowest[f'{p}_ms'] for p in PART_NAMES):.3f} ms (median)")
