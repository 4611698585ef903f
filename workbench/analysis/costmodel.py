"""A cost model for any model, batch, context, KV format and rank count: the roofline
(bytes / memory bandwidth against FLOPs / FMA peak, the larger one bounds) per layer and
per part, plus communication from an alpha-beta fit of the backend's all-reduce. It follows
"Efficiently Scaling Transformer Inference" (Pope et al.): at batch 1 a decode step reads
every weight once, so its floor is bytes / bandwidth; prefill is FLOPs / FMA peak.

    import workbench as wb
    p = wb.predict("smollm2-135m", batch=1, prompt_len=64, new_tokens=32, kv_cache="int8")
    print(p)                            # per part: bytes, FLOPs, time, which roof bounds it
    p.step_ms("decode")                 # one decode step, all layers and the head
    rows = p.compare(result.timings)    # predicted vs measured per part, ratio, and why if > 1.5x

What it counts is exactly what StepRecord counts (workbench/model/timing.py), from the
configuration alone (no weights needed, so Llama-2-70B works on a laptop):
    attention   q, k, v, o weights; in decode the KV cache at the step's length, scales
                included; FLOPs 2 x tokens x those weights + 4 x heads x head_dim per
                (query, key) pair (Q K^T and P V)
    mlp         gate, up, down weights; FLOPs 2 x tokens x weights. A mixture of experts: its
                fp32 router and each distinct expert the step's tokens choose (the expected
                count under the routing given, measured by wb.expert_routing, or uniform:
                workbench.analysis.experts); FLOPs 2 x tokens x (top_k experts + the router)
    other       the two norms' fp32 weights: almost nothing, so the roofline predicts almost
                nothing; what is measured there is per-call overhead
    comm        tensor parallel: two all-reduces of tokens x dim fp32 per layer, each the
                faster of a ring and recursive doubling built from the fitted alpha and
                beta (at 2 ranks exactly the fitted alpha + bytes / beta)
    ranks > 1   each part at the largest share any rank holds (the ranks meet at the
                all-reduce that ends it, so the busiest rank sets its pace): the shard
                plan's, workbench.distributed.shard
    head        embedding rows, final norm, the LM head (its vocabulary slice per rank),
                FLOPs over the rows it projects; with ranks > 1 two more collectives (token
                ids out, top-k pairs back), alpha each
Decode is predicted at the mean KV length of the generation's decode steps, prompt_len +
new_tokens / 2, which is what the measured steps average over.

`Hardware` says what one rank has. `Hardware.this_machine(ranks)` takes the measured peaks
(shared by the ranks: each gets 1 / ranks of the triad and FMA peak) and, for ranks > 1,
the backend's all-reduce fit last measured on this machine (cached by
workbench.distributed.allreduce.measure_allreduce, `wb.measure_allreduce`). Predicting never
measures: with no fit cached it says how to measure one. `Hardware.from_socket(...)` builds one from a socket's
stated parameters, for projections (notebooks/05-cost-model.ipynb: the paper's Table 2).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

PHASES = ("prefill", "decode")
LAYER_PARTS = ("attention", "mlp", "other", "comm")
NORM_BYTES_PER_ELEM = 4  # as the model counts them: norm weights stay fp32
RATIO_FLAG = 1.5  # compare() explains every part whose measured / predicted is outside [1/1.5, 1.5]


@dataclass(frozen=True)
class Hardware:
    """What one rank has. bandwidth and FMA peak are the rank's share; comm_alpha_us and
    comm_beta_gbps are the all-reduce fit between the ranks (ignored at one rank)."""

    name: str
    bandwidth_gbps: float
    fma_gflops: float
    comm_alpha_us: float = 0.0
    comm_beta_gbps: float = math.inf
    cache_bytes: int = 0  # last-level cache a rank can reuse weights from (0: assume none)
    notes: str = ""
    # The bf16 unit's peak where the GEMM runs bf16 weights on one (AMX tiles, vdpbf16ps), else 0: the
    # linear layers' FLOPs of more rows than the matrix-vector kernel takes are set against it.
    matrix_gflops: float = 0.0
    # The AMX int8 peak (giga-ops) where the GEMM runs per-row int8 weights as W8A8 (engine
    # amx_int8), else 0: those weights' FLOPs of more rows are set against it instead.
    matrix_int8_gops: float = 0.0

    @classmethod
    def this_machine(cls, ranks: int = 1, backend: str | None = None, comm: tuple[float, float] | None = None):
        """The measured peaks of this machine split over `ranks` processes sharing it, and
        for ranks > 1 the all-reduce fit of `backend` cached by wb.measure_allreduce (or
        comm=(alpha_us, beta_gbps) as given). Starts no process: with no fit cached it raises
        a ValueError that says how to measure one."""
        from workbench.hw.machine import machine_info
        from workbench.kernels.peaks import measured_peaks

        _check_ranks(ranks)
        alpha, beta, how = 0.0, math.inf, ""
        if ranks > 1:
            if comm is None:
                if backend is None:
                    raise ValueError("predict: ranks > 1 needs backend= (shm, gloo or ccl) or comm=(alpha_us, beta_gbps)")
                fit = _cached_fit(backend, ranks)
                alpha, beta = fit["alpha_us"], fit["beta_gbps"]
                how = f"; all-reduce {backend}: {alpha:.1f} us + bytes / {beta:.2f} GB/s (fitted {fit['measured_at']})"
            else:
                alpha, beta = comm
                how = f"; all-reduce as given: {alpha:.1f} us + bytes / {beta:.2f} GB/s"
        peaks = measured_peaks()
        from workbench.kernels import gemm_engine_for

        engine = gemm_engine_for("bfloat16")  # the bf16 GEMMs' engine (amx_int8 runs them on amx_bf16)
        matrix = peaks.compute_peak_gflops(engine) / ranks if engine != "fma" else 0.0
        if matrix:
            how += f"; bf16 GEMMs on {engine}: {peaks.compute_peak_gflops(engine):.0f} GFLOP/s measured"
        w8a8 = peaks.amx_int8_gops / ranks if gemm_engine_for("int8") == "amx_int8" else 0.0
        if w8a8:
            how += f"; int8 GEMMs W8A8 on amx_int8: {peaks.amx_int8_gops:.0f} GOP/s measured"
        l3 = machine_info().cache_bytes(3) or 0
        return cls(name=f"this machine / {ranks} rank(s)", bandwidth_gbps=peaks.triad_gbps / ranks,
                   fma_gflops=peaks.fma_gflops / ranks, comm_alpha_us=alpha, comm_beta_gbps=beta,
                   matrix_gflops=matrix, matrix_int8_gops=w8a8,
                   cache_bytes=int(l3) // ranks,
                   notes=f"measured peaks ({peaks.measured_at}): triad {peaks.triad_gbps:.1f} GB/s, fp32 FMA "
                         f"{peaks.fma_gflops:.0f} GFLOP/s on {peaks.threads} threads, shared by {ranks} rank(s){how}")

    @classmethod
    def from_socket(cls, name: str, *, channels: int, mts: float, bandwidth_efficiency: float, cores: int,
                    ghz: float, flops_per_cycle_per_core: float, compute_efficiency: float,
                    link_alpha_us: float, link_gbps: float, llc_bytes: int = 0):
        """One rank per socket from its stated parameters: DDR channels x MT/s x 8 bytes
        times the fraction a stream kernel reaches, and cores x GHz x FLOPs per cycle times
        the fraction a GEMM reaches; the link's all-reduce alpha and bandwidth."""
        bw = channels * mts * 8 / 1e3 * bandwidth_efficiency
        fma = cores * ghz * flops_per_cycle_per_core * compute_efficiency
        return cls(name=name, bandwidth_gbps=bw, fma_gflops=fma, comm_alpha_us=link_alpha_us,
                   comm_beta_gbps=link_gbps, cache_bytes=llc_bytes,
                   notes=f"{channels} channels x {mts:.0f} MT/s x 8 B x {bandwidth_efficiency:.0%} = {bw:.0f} GB/s; "
                         f"{cores} cores x {ghz} GHz x {flops_per_cycle_per_core:g} FLOP/cycle x "
                         f"{compute_efficiency:.0%} = {fma / 1e3:.1f} TFLOP/s; all-reduce {link_alpha_us:g} us + "
                         f"bytes / {link_gbps:g} GB/s")


@dataclass(frozen=True)
class PartCost:
    """One part of one layer (or the head) in one phase, on one rank."""

    bytes: int
    flops: int
    memory_s: float  # bytes / bandwidth
    compute_s: float  # FLOPs / the peak of the unit each runs on (FMA, matrix engine)
    comm_s: float = 0.0  # collectives (their own roof: alpha + bytes / beta)

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s

    @property
    def bound(self) -> str:
        if self.comm_s and self.comm_s >= max(self.memory_s, self.compute_s):
            return "communication"
        if not self.bytes and not self.flops:
            return "-"
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass
class Prediction:
    config: object  # ModelConfig
    hardware: Hardware
    batch: int
    prompt_len: int
    new_tokens: int
    kv_cache: str
    weight_dtype: str
    ranks: int
    decode_kv_len: float
    layers: dict[str, dict[str, PartCost]] = field(default_factory=dict)  # phase -> part -> one layer's cost
    head: dict[str, PartCost] = field(default_factory=dict)  # phase -> cost
    experts: dict[str, float] = field(default_factory=dict)  # a mixture's: phase -> distinct experts a layer's step reads
    routing: str = ""  # what the expected experts assume (a mixture's)

    def layer_ms(self, phase: str) -> dict[str, float]:
        """Predicted milliseconds of each part of one layer."""
        return {part: 1e3 * c.seconds for part, c in self.layers[phase].items()}

    def per_layer(self, phase: str) -> list[dict]:
        """Timings.per_layer's shape: one row per layer with "<part>_ms" columns."""
        ms = self.layer_ms(phase)
        return [{"layer": i, **{f"{p}_ms": ms[p] for p in LAYER_PARTS}} for i in range(self.config.n_layers)]

    def per_layer_ms(self) -> dict[str, list[dict]]:
        """per_layer of both phases, the shape the figures and reports take."""
        return {phase: self.per_layer(phase) for phase in PHASES}

    def step_ms(self, phase: str) -> float:
        """One step on one rank: every layer and the head."""
        return sum(self.layer_ms(phase).values()) * self.config.n_layers + 1e3 * self.head[phase].seconds

    def step_bytes(self, phase: str) -> int:
        return sum(c.bytes for c in self.layers[phase].values()) * self.config.n_layers + self.head[phase].bytes

    def step_flops(self, phase: str) -> int:
        return sum(c.flops for c in self.layers[phase].values()) * self.config.n_layers + self.head[phase].flops

    def decode_tokens_per_s(self) -> float:
        return self.batch * 1e3 / self.step_ms("decode")

    def rows(self) -> list[dict]:
        """One row per phase and part, all layers summed: bytes, FLOPs, ms, the bound."""
        out = []
        n = self.config.n_layers
        for phase in PHASES:
            parts = [(p, c, n) for p, c in self.layers[phase].items()] + [("head", self.head[phase], 1)]
            for part, c, times in parts:
                if part == "comm" and self.ranks == 1:
                    continue
                out.append({"phase": phase, "part": part, "MB": times * c.bytes / 1e6,
                            "GFLOP": times * c.flops / 1e9, "predicted_ms": times * 1e3 * c.seconds,
                            "bound": c.bound})
        return out

    def compare(self, timings) -> list[dict]:
        """Predicted vs measured per phase and part (all layers; decode: the median over steps,
        as every summary of the workbench: workbench.model.timing), the ratio measured /
        predicted, and where it is outside 1.5x either way, why."""
        out = []
        n = self.config.n_layers
        for phase in PHASES:
            steps = timings.phase_steps(phase)
            if not steps:
                continue
            totals = timings.per_part_ms(phase)  # median over steps of each part's per-step total
            measured = {p: totals[p] for p in LAYER_PARTS}
            measured["head"] = 1e3 * statistics.median(s.head_s for s in steps)
            measured["step"] = timings.step_ms(phase)
            predicted = {p: n * 1e3 * c.seconds for p, c in self.layers[phase].items()}
            predicted["head"] = 1e3 * self.head[phase].seconds
            predicted["step"] = self.step_ms(phase)
            for part in (*LAYER_PARTS, "head", "step"):
                if part == "comm" and self.ranks == 1:
                    continue
                p, m = predicted[part], measured[part]
                ratio = m / p if p > 0 else math.inf
                cost = self.head[phase] if part == "head" else self.layers[phase].get(part)
                out.append({"phase": phase, "part": part, "predicted_ms": p, "measured_ms": m, "ratio": ratio,
                            "bound": cost.bound if cost else "", "why": self._why(phase, part, cost, p, m, ratio)})
        return out

    def _why(self, phase, part, cost, predicted_ms, measured_ms, ratio) -> str:
        if 1 / RATIO_FLAG <= ratio <= RATIO_FLAG:
            return ""
        n = self.config.n_layers
        hw = self.hardware
        if part == "other":
            return ("the roofline counts only the norms' weights; the time is per-call overhead of the small "
                    "ops (two RMSNorms, two residual adds per layer)")
        if part == "comm":
            return ("slower than the all-reduce fit: in a step the collective also waits for the slower rank "
                    "(skew) and shares the cores with compute" if ratio > 1 else
                    "faster than the fit (which was measured with its own timing loop)")
        if ratio < 1:
            step_bytes = self.step_bytes(phase)
            if hw.cache_bytes and step_bytes <= hw.cache_bytes:
                return (f"faster than the bandwidth roofline: the step's {step_bytes / 2**20:.0f} MiB fit in the "
                        f"{hw.cache_bytes / 2**20:.0f} MiB last-level cache, which the triad (3 x 256 MiB) does "
                        f"not, so weights are reread from cache")
            return "faster than predicted: the peak used is lower than what this part reaches"
        per_call_us = 1e3 * predicted_ms / (1 if part in ("head", "step") else n)
        if part != "step" and per_call_us < 30:
            return (f"per-call overhead: the roofline time of this part is {per_call_us:.1f} us per layer, "
                    f"comparable to a kernel call's launch and threading cost")
        scale = 1 if part in ("head", "step") else n
        if part == "step":
            return "the parts above, and work between them (Python between layers, the step's own bookkeeping)"
        if cost is not None and cost.bound == "memory":
            achieved = cost.bytes * scale / (measured_ms / 1e3) / 1e9
            return (f"below the bandwidth roofline: {achieved:.1f} of {hw.bandwidth_gbps:.1f} GB/s at these shapes "
                    f"(call overhead, matrix-vector products at K = {self.config.dim} short of the bandwidth, or "
                    f"other load on the machine)")
        if cost is not None and cost.bound == "compute":
            achieved = cost.flops * scale / (measured_ms / 1e3) / 1e9
            return (f"below the compute roofline: {achieved:.0f} of {hw.fma_gflops:.0f} GFLOP/s (fp32 FMA peak; "
                    f"softmax, RoPE, packing and threading are not FMAs)")
        return ""

    def utilisation(self, timings, phase: str = "decode") -> dict:
        """Measured bandwidth utilisation and MFU of the phase against this hardware."""
        return {"bandwidth_utilisation": timings.gbps(phase) / self.hardware.bandwidth_gbps,
                "mfu": timings.gflops(phase) / self.hardware.fma_gflops}

    def __repr__(self) -> str:
        from workbench.analysis.tables import format_table

        cfg = self.config
        head = (f"<Prediction {cfg.name}: batch {self.batch}, prompt {self.prompt_len}, {self.new_tokens} new "
                f"tokens (decode at KV length {self.decode_kv_len:g}), KV {self.kv_cache}, weights "
                f"{self.weight_dtype}, {self.ranks} rank(s) on {self.hardware.name}\n"
                f"  {self.hardware.notes}\n"
                f"  prefill {self.step_ms('prefill'):.2f} ms, decode {self.step_ms('decode'):.3f} ms per step "
                f"({self.decode_tokens_per_s():.1f} tokens/s)")
        if self.experts:
            head += (f"\n  experts read a layer's step: prefill {self.experts['prefill']:.1f}, decode "
                     f"{self.experts['decode']:.1f} of {cfg.n_experts} (routing: {self.routing})")
        head += ">\n"
        return head + format_table(self.rows(), ["phase", "part", "MB", "GFLOP", "predicted_ms", "bound"],
                                   {"MB": "{:.2f}", "GFLOP": "{:.3f}", "predicted_ms": "{:.3f}"})


def _check_ranks(ranks) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")


def _config(model):
    from workbench.model.config import ModelConfig, preset

    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str):
        return preset(model)
    cfg = getattr(model, "config", None)
    if isinstance(cfg, ModelConfig):
        return cfg
    raise ValueError(f"model must be a preset name, a ModelConfig or a loaded model, got {type(model).__name__}")


def _allreduce_s(nbytes: int, ranks: int, hw: Hardware) -> float:
    """The faster of a ring ((p - 1) alpha + 2 (p - 1) / p x bytes / beta: best for large
    payloads) and recursive doubling (log2 p x (alpha + bytes / beta): best for small ones);
    at 2 ranks both are the fitted alpha + bytes / beta."""
    if ranks == 1:
        return 0.0
    alpha, beta = hw.comm_alpha_us * 1e-6, hw.comm_beta_gbps * 1e9
    ring = (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes / beta
    doubling = math.ceil(math.log2(ranks)) * (alpha + nbytes / beta)
    return min(ring, doubling)


@dataclass
class _WeightBytes:
    """What the roofline needs of the weights' formats: the bytes of a [rows, cols] matrix of a
    tensor group ("qkv", "o", "gate_up", "down", "lm_head"), the embedding's bytes a row, the
    weight kernel whose measured crossover applies, and whether the GEMM runs on the matrix
    engine."""

    nbytes: object  # (group, rows, cols) -> bytes
    embed_row: float
    kernel: str
    matrix_engine: bool

    @classmethod
    def of(cls, model, cfg: ModelConfig, weight_dtype: str) -> _WeightBytes:
        from workbench.model.weights import AS_FILE, weight_format

        if weight_dtype != AS_FILE:
            # bytes a weight in each group at the model's own widths (a block format's fallback
            # where a row is not whole blocks), applied to a rank's share of the rows and columns
            w = weight_format(weight_dtype)
            widths = {"qkv": cfg.dim, "o": cfg.n_heads * cfg.head_dim, "gate_up": cfg.dim, "down": cfg.ffn_dim,
                      "lm_head": cfg.dim}
            group_fmt = {g: w.for_cols(k) for g, k in widths.items()}  # a block format's fallback where it takes one

            def nbytes(group: str, rows: int, cols: int) -> float:
                f = group_fmt[group]
                if f.fits(cols):
                    return f.nbytes(rows, cols)
                return f.nbytes(64, widths[group]) / (64 * widths[group]) * rows * cols  # a split inside a block

            embed_row = w.nbytes(1, cfg.dim) if w.blocks else cfg.dim * w.embedding_dtype().itemsize
            return cls(nbytes, lambda d: embed_row, w.kernel, w.matrix_engine)
        # a model loaded as its file holds it: each group's mean bytes per weight over the layers
        # (a tensor-parallel model's: its first rank's shard, as the cluster reported it)
        llama = getattr(model, "llama", None)
        per_weight = llama.bytes_per_weight() if llama is not None else model.bytes_per_weight
        main = weight_format(per_weight["format"])
        return cls(lambda group, rows, cols: per_weight[group] * rows * cols, lambda d: per_weight["embed_row"],
                   main.kernel, main.matrix_engine)


def predict(model="smollm2-135m", batch: int = 1, prompt_len: int = 64, new_tokens: int = 32,
            kv_cache: str = "fp16", weight_dtype: str | None = None, ranks: int = 1, backend: str | None = None,
            hardware: Hardware | None = None, comm: tuple[float, float] | None = None,
            kv_handoff: bool = False, routing=None, expert_split: str = "expert") -> Prediction:
    """The roofline prediction of one rank's prefill and decode steps, per layer and part.

    model: a preset name, a ModelConfig or a loaded model (whose weight dtype and KV cache
    switch are then the defaults); hardware: default this machine's measured peaks shared by
    `ranks` processes, with `backend`'s all-reduce fit (or comm=(alpha_us, beta_gbps));
    kv_handoff: a KV head two ranks hold is computed by one of them in decode (the fused
    step over shm, workbench.distributed.tp); routing: a mixture of experts' ExpertRouting
    (wb.expert_routing), whose expected distinct experts a step's tokens choose set the MLP's
    bytes (default: uniform routing); expert_split: a mixture's on ranks > 1 ("expert": the
    busiest rank's whole experts, its run of them as the shard plan splits them; "tensor":
    every expert read, each rank its FFN slice)."""
    from workbench.model.kv_formats import kv_format

    cfg = _config(model)
    if weight_dtype is None:
        weight_dtype = getattr(model, "weight_dtype", "fp32")
    wfmt = _WeightBytes.of(model, cfg, weight_dtype)
    fmt = kv_format(kv_cache)
    _check_ranks(ranks)
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    hw = hardware or Hardware.this_machine(ranks, backend, comm)

    d, hd = cfg.dim, cfg.head_dim
    whole_experts = bool(cfg.n_experts) and expert_split == "expert"
    f = cfg.ffn_dim if whole_experts else _busiest_ffn(cfg, ranks)
    mlp_params = 3 * d * f
    # Bytes of a rank's matrices in the weight format, scales included.
    mlp_bytes = wfmt.nbytes("gate_up", round(2 * f), d) + wfmt.nbytes("down", d, round(f))
    experts = _experts_read(cfg, routing, ranks, batch, prompt_len, expert_split)  # {} for a dense model
    if experts:  # mlp_bytes is one expert's; the router (fp32) and the distinct experts are added per phase
        mlp_params = cfg.experts_per_token * 3 * d * f + cfg.n_experts * d
    head_bytes = wfmt.nbytes("lm_head", round(cfg.vocab_size / ranks), d)
    embed_row = wfmt.embed_row(d)
    norm_bytes = 2 * d * NORM_BYTES_PER_ELEM
    kv_len = prompt_len + new_tokens / 2  # the mean KV length the decode steps read

    from workbench import kernels

    matvec_rows = kernels.matvec_max_rows(wfmt.kernel)  # the crossover measured on this host

    def cost(nbytes, flops, comm_s=0.0, linear_flops=0, rows=1) -> PartCost:
        """linear_flops of `flops` are matrix products of `rows` rows: on the matrix engine's
        roof where the GEMM runs them there (bf16 and int8 weights, more rows than the
        matrix-vector kernel takes; per-row int8 under W8A8 on the int8 tiles' roof), else on
        the FMA roof like the rest."""
        roof = hw.fma_gflops
        if wfmt.matrix_engine and rows > matvec_rows:
            w8a8 = wfmt.kernel == "int8" and hw.matrix_int8_gops > 0
            roof = hw.matrix_int8_gops if w8a8 else hw.matrix_gflops or hw.fma_gflops
        compute = ((flops - linear_flops) / hw.fma_gflops + linear_flops / roof) / 1e9
        return PartCost(int(nbytes), int(flops), nbytes / (hw.bandwidth_gbps * 1e9), compute, comm_s)

    layers, head = {}, {}
    for phase in PHASES:
        tokens = batch * prompt_len if phase == "prefill" else batch
        pairs = batch * prompt_len * (prompt_len + 1) / 2 if phase == "prefill" else batch * kv_len
        # the handoff is the fused decode step's: prefill computes every KV head a rank holds
        heads, kv_heads, kv_computed = _busiest_attention(cfg, ranks, kv_handoff and phase == "decode")
        attn_params = d * hd * (2 * heads + 2 * kv_computed)
        attn_bytes = wfmt.nbytes("qkv", round(hd * (heads + 2 * kv_computed)), d) + wfmt.nbytes("o", d, round(hd * heads))
        kv_bytes = 0 if phase == "prefill" else 2 * batch * kv_len * kv_heads * fmt.bytes_per_vector(hd, max(1, round(kv_heads)))
        layers[phase] = {
            "attention": cost(attn_bytes + kv_bytes, 2 * tokens * attn_params + 4 * heads * hd * pairs,
                              linear_flops=2 * tokens * attn_params, rows=tokens),
            "mlp": cost(4 * cfg.n_experts * d + experts[phase] * mlp_bytes if experts else mlp_bytes,
                        2 * tokens * mlp_params, linear_flops=2 * tokens * mlp_params,
                        rows=tokens / experts[phase] * cfg.experts_per_token if experts else tokens),
            "other": cost(norm_bytes, 0),
            "comm": PartCost(0, 0, 0.0, 0.0, 2 * _allreduce_s(4 * tokens * d, ranks, hw)),
        }
        vocab = cfg.vocab_size / ranks
        head_rows = batch  # the last position of each sequence (decode: its one token)
        head_comm = 2 * _allreduce_s(0, ranks, hw)  # token ids out, top-k pairs back: latency only
        head[phase] = cost(tokens * embed_row + d * NORM_BYTES_PER_ELEM + head_bytes,
                           2 * head_rows * vocab * d, head_comm, linear_flops=2 * head_rows * vocab * d, rows=head_rows)
    return Prediction(cfg, hw, batch, prompt_len, new_tokens, fmt.name, weight_dtype, ranks, kv_len, layers, head,
                      experts, routing.source if routing is not None else "uniform (assumed)" if experts else "")


def _experts_read(cfg, routing, ranks: int, batch: int, prompt_len: int, expert_split: str) -> dict[str, float]:
    """A mixture's distinct experts a layer's step reads on the busiest rank (mean over the
    layers), per phase, under `routing` (None: uniform); {} for a dense model. Expert parallel:
    the most any rank's run of experts expects; tensor parallel: every distinct expert (each
    rank its FFN slice of each)."""
    if not cfg.n_experts:
        if routing is not None:
            raise ValueError(f"routing: {cfg.name} is not a mixture of experts")
        return {}
    if expert_split not in ("expert", "tensor"):
        raise ValueError(f"expert_split must be 'expert' or 'tensor', got {expert_split!r}")
    from workbench.analysis.experts import ExpertRouting
    from workbench.distributed.shard import split

    routing = routing if routing is not None else ExpertRouting.uniform(cfg)
    if not isinstance(routing, ExpertRouting) or routing.load.shape[1] != cfg.n_experts:
        raise ValueError(f"routing must be an ExpertRouting of {cfg.n_experts} experts (wb.expert_routing(model)), "
                         f"got {routing!r:.80}")
    runs = [split(cfg.n_experts, ranks, r) for r in range(ranks)] if expert_split == "expert" else [(0, cfg.n_experts)]
    q = routing.inclusion().clamp(0.0, 1.0)
    out = {}
    for phase in PHASES:
        tokens = batch * (prompt_len if phase == "prefill" else 1)
        read = 1.0 - (1.0 - q) ** tokens  # [layers, experts]: the chance each expert is read
        out[phase] = max(read[:, lo:hi].sum(-1).mean().item() for lo, hi in runs)
    return out


def _busiest_attention(cfg, ranks: int, kv_handoff: bool = False) -> tuple[float, float, float]:
    """(query heads, KV heads, KV heads computed) of the rank that sets the attention part's
    pace: the ranks meet at the all-reduce that ends it, so where the shard plan splits unevenly
    (workbench.distributed.shard: the bundled model's 9 query heads over 2 ranks are 5 + 4,
    reading 2 KV heads each) every rank waits for the largest share of weights. With
    kv_handoff, a KV head a rank takes from the next rank (ShardPlan.kv_handoff) is read from
    its cache but not computed. Past one rank per KV head (no such model runs here;
    projections only) the mean share."""
    if ranks == 1 or ranks > cfg.n_kv_heads:
        return cfg.n_heads / ranks, cfg.n_kv_heads / ranks, cfg.n_kv_heads / ranks
    from workbench.distributed.shard import plan

    def shares(p):
        kv = p.kv_heads[1] - p.kv_heads[0]
        return p.q_heads[1] - p.q_heads[0], kv, kv - (1 if kv_handoff and p.kv_handoff[1] else 0)

    return max((shares(plan(cfg, r, ranks)) for r in range(ranks)), key=lambda s: s[0] + s[2])  # wq + wo, wk + wv


def _busiest_ffn(cfg, ranks: int) -> float:
    """The most FFN features a rank holds (the MLP part's pace, as attention's above); past one
    rank per KV head, the mean share."""
    if ranks > cfg.n_kv_heads:
        return cfg.ffn_dim / ranks
    from workbench.distributed.shard import ffn_split

    return max(hi - lo for lo, hi in (ffn_split(cfg, ranks, r) for r in range(ranks)))


def _cached_fit(backend: str, ranks: int) -> dict:
    from workbench.distributed.allreduce import cached_fit

    fit = cached_fit(backend, ranks)
    if fit is None:
        raise ValueError(f"no all-reduce fit of {backend} on {ranks} ranks is cached on this machine: measure one with "
                         f"wb.measure_allreduce({backend!r}, ranks={ranks}) (starts {ranks} engines, about 10 s), "
                         f"or pass comm=(alpha_us, beta_gbps)")
    return fit


def predict_run(model, result) -> Prediction:
    """The prediction for the settings a GenerationResult ran with: its batch, mean prompt
    length, new tokens, KV format, and the model's weights and ranks (a tensor-parallel
    model's backend fit as cached by wb.measure_allreduce: a ValueError saying how to measure
    one if there is none; nothing is measured here)."""
    lengths = [len(p) for p in result.prompt_token_ids]
    steps = result.timings.decode_steps
    cluster = getattr(model, "cluster", None)
    ranks = getattr(cluster, "n", 1)
    hardware = None
    if ranks > 1:
        fit = _cached_fit(cluster.backend, ranks)
        hardware = Hardware.this_machine(ranks, comm=(fit["alpha_us"], fit["beta_gbps"]))
    routing = None
    if getattr(model.config, "n_experts", 0) and ranks == 1:  # a mixture: the routing its layers counted so far
        from workbench.analysis.experts import ExpertRouting

        routing = ExpertRouting.of_model(model)
    return predict(model, batch=len(lengths), prompt_len=max(1, round(sum(lengths) / len(lengths))),
                   new_tokens=len(steps) + 1, kv_cache=result.switches.kv_cache, ranks=ranks, hardware=hardware,
                   routing=routing)


def tp_roofline_ratio(model, ranks: int, *, backend: str | None = None, comm: tuple[float, float] | None = None,
                      batch: int = 1, prompt_len: int = 64, new_tokens: int = 32, kv_cache: str = "fp16",
                      weight_dtype: str | None = None, kv_handoff: bool = False, expert_split: str = "expert",
                      routing=None) -> float:
    """The roofline's decode step on `ranks` ranks over one process's on the same machine:
    what a tensor-parallel run's "time / 1 rank" would be if both ran at their roofs. Each
    rank gets 1 / ranks of the measured triad and FMA peak, so an even split costs only the
    collectives, and an uneven one (the bundled model's 5 + 4 query heads) the busiest rank's
    extra share as well. Not a bound on a measurement: the two runs need not be equally far
    below their roofs, and the cached fit (timed from Python, a barrier before each call)
    overstates the fused step's small all-reduces where Python's overhead is most of a call
    (tp_ablation passes the step's own instead: distributed.allreduce.step_fit). backend's
    all-reduce fit as cached (a ValueError saying how to measure one if there is none), or
    comm=(alpha_us, beta_gbps). kv_handoff, expert_split (a mixture's), routing: predict's."""
    kw = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, kv_cache=kv_cache, weight_dtype=weight_dtype,
              routing=routing)
    many = predict(model, ranks=ranks, backend=backend, comm=comm, kv_handoff=kv_handoff, expert_split=expert_split,
                   **kw)
    one = predict(model, ranks=1, **kw)
    return many.step_ms("decode") / one.step_ms("decode")


def table2_projection(socket: Hardware, sockets=(2, 8), links: dict[int, tuple[float, float]] | None = None,
                      model: str = "llama2-70b", weight_dtype: str = "bf16", kv_cache: str = "fp16",
                      prompt_len: int = 1024, new_tokens: int = 128) -> list[dict]:
    """The paper's Table 2 setting on `sockets` ranks of `socket` (one rank per socket):
    predicted ms per decode token, split into memory / compute time and communication.
    links[n] = (alpha_us, beta_gbps) of the all-reduce at n sockets (default: the socket's)."""
    rows = []
    for n in sockets:
        hw = socket
        if links and n in links:
            hw = replace(socket, comm_alpha_us=links[n][0], comm_beta_gbps=links[n][1])
        p = predict(model, batch=1, prompt_len=prompt_len, new_tokens=new_tokens, kv_cache=kv_cache,
                    weight_dtype=weight_dtype, ranks=n, hardware=hw)
        comm_ms = 1e3 * (sum(c.comm_s for c in p.layers["decode"].values()) * p.config.n_layers
                         + p.head["decode"].comm_s)
        step = p.step_ms("decode")
        rows.append({"sockets": n, "predicted_ms_per_token": step, "memory_ms": step - comm_ms, "comm_ms": comm_ms,
                     "bytes_per_socket_GB": p.step_bytes("decode") / 1e9,
                     "bound": "memory" if step - comm_ms >= comm_ms else "communication",
                     "all_reduce": f"{hw.comm_alpha_us:g} us + bytes / {hw.comm_beta_gbps:g} GB/s",
                     "collectives_per_token": 2 * p.config.n_layers + 2})
    return rows


__all__ = ["Hardware", "PartCost", "Prediction", "predict", "predict_run", "table2_projection"]
