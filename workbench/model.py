"""A Llama-family decoder whose attention and KV cache are the workbench's C++ kernels.

RMSNorm, rotary position embeddings (rotate-half layout, the config's theta and scaling),
grouped-query attention, a SwiGLU MLP, tied or untied embeddings. Two entry points:

    prefill(tokens, seq_lens, cache)   packed prompt tokens [T] of several sequences
    decode(tokens, cache)              one new token per sequence [B]

Linear layers run on the packed tokens of all sequences at once; attention runs per
sequence in prefill (ragged prompts need no padding) and batched in decode. Which
attention kernel and which KV-cache dtype are used is decided per call (`Switches`), so
they can change between generations without touching the weights.

Every forward step can record, per layer, the time spent in attention, in the MLP and in
the rest, and the bytes it had to read (`StepRecord`); see workbench.timing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workbench import kernels
from workbench.config import ModelConfig

ATTENTION_BACKENDS = ("slim", "flash", "sdpa", "naive")
KV_DTYPES = {"int8": torch.int8, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Switches:
    attention: str = "slim"
    kv_cache: str = "fp32"

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
        if self.kv_cache not in KV_DTYPES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_DTYPES)}, got {self.kv_cache!r}")


# -- timing ------------------------------------------------------------------------------

@dataclass
class StepRecord:
    """One forward step (a prefill or one decode step): per-layer seconds, bytes read and
    floating-point operations, so a step can be set against both the machine's bandwidth and
    its FMA peak (which of the two bounds it)."""

    phase: str  # "prefill" or "decode"
    tokens: int  # tokens processed in this step (all sequences)
    attention_s: list[float]
    mlp_s: list[float]
    other_s: list[float]  # norms and residual adds of each layer
    head_s: float  # embedding, final norm, LM head
    weight_bytes: list[int]  # per layer
    kv_bytes: list[int]  # per layer: KV cache bytes read by attention
    total_s: float = 0.0
    # Per layer: 2 x tokens x the layer's linear weights, plus attention's Q K^T and P V over
    # the (query, key) pairs it must compute (causal prefill: n (n + 1) / 2 per sequence).
    flops: list[int] = field(default_factory=list)
    head_flops: int = 0  # the LM head over the rows it projects

    @property
    def bytes_read(self) -> int:
        """Weight and KV-cache bytes the layers had to read."""
        return sum(self.weight_bytes) + sum(self.kv_bytes)

    @property
    def total_flops(self) -> int:
        """The layers' floating-point operations and the LM head's."""
        return sum(self.flops) + self.head_flops


class _Clock:
    """Accumulates per-layer section times when enabled; does nothing otherwise."""

    def __init__(self, enabled: bool, n_layers: int):
        self.enabled = enabled
        self.t = time.perf_counter
        if enabled:
            self.attention = [0.0] * n_layers
            self.mlp = [0.0] * n_layers
            self.other = [0.0] * n_layers


# -- building blocks ---------------------------------------------------------------------

class Linear:
    """y = x W^T with W [out, in] in fp32 or bf16: our matrix-vector kernel for decode's few
    rows, a GEMM for prefill (workbench.kernels.linear)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x.contiguous(), self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)  # one fused op: x / rms(x) * weight, in fp32


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] for the rotate-half layout, with HF-style rope scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {scaling!r} (supported: linear, llama3)")
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


# -- KV cache ----------------------------------------------------------------------------

class KVCache:
    """Preallocated K/V for every layer: [B, Hkv, max_len, D] of the chosen dtype, plus one
    fp32 scale per head per token for int8; `lengths` [B] counts each sequence's tokens."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: str):
        if dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")
        self.dtype_name = dtype
        self.max_len = max_len
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=KV_DTYPES[dtype]) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=KV_DTYPES[dtype]) for _ in range(cfg.n_layers)]
        self.int8 = dtype == "int8"
        if self.int8:
            self.k_scale = [torch.zeros(shape[:3]) for _ in range(cfg.n_layers)]
            self.v_scale = [torch.zeros(shape[:3]) for _ in range(cfg.n_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.int64)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] written at positions[b] .. positions[b] + T."""
        kernels.kv_cache_append(self.k[layer], k, positions, scales=self.k_scale[layer] if self.int8 else None)
        kernels.kv_cache_append(self.v[layer], v, positions, scales=self.v_scale[layer] if self.int8 else None)

    def append_sequence(self, layer: int, b: int, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor) -> None:
        """k, v [1, Hkv, T, D] of sequence b written at positions[0] .. + T (prefill, one prompt)."""
        kernels.kv_cache_append(self.k[layer][b:b + 1], k, positions,
                                scales=self.k_scale[layer][b:b + 1] if self.int8 else None)
        kernels.kv_cache_append(self.v[layer][b:b + 1], v, positions,
                                scales=self.v_scale[layer][b:b + 1] if self.int8 else None)

    def scales(self, layer: int) -> dict:
        return dict(k_scale=self.k_scale[layer], v_scale=self.v_scale[layer]) if self.int8 else {}

    def dequantized(self, layer: int, batch_index: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K, V [Hkv, length, D] of one sequence (for the sdpa and naive backends)."""
        k = self.k[layer][batch_index, :, :length].float()
        v = self.v[layer][batch_index, :, :length].float()
        if self.int8:
            k = k * self.k_scale[layer][batch_index, :, :length, None]
            v = v * self.v_scale[layer][batch_index, :, :length, None]
        return k, v

    def bytes_read(self, lengths: torch.Tensor, n_kv_heads: int, head_dim: int) -> int:
        """KV bytes one layer's decode attention reads for these sequence lengths."""
        per_token = 2 * n_kv_heads * (head_dim * self.k[0].element_size() + (4 if self.int8 else 0))
        return int(lengths.sum()) * per_token

    @property
    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.k + self.v)
        if self.int8:
            total += sum(t.numel() * 4 for t in self.k_scale + self.v_scale)
        return total


# -- attention backends ------------------------------------------------------------------

def _naive_prefill(q, k, v):
    """Plain PyTorch reference: q [1, H, N, D], k/v [1, Hkv, N, D], causal."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    n = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def prefill_attention(backend: str, q, k, v):
    if backend == "slim":
        return kernels.slim_attention(q, k, v, causal=True)
    if backend == "flash":
        return kernels.flash_attention(q, k, v, causal=True)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return _naive_prefill(q, k, v)


def decode_attention(backend: str, q, cache: KVCache, layer: int, lengths: torch.Tensor):
    """q [B, H, D] against the cache of `layer`, sequence b seeing lengths[b] tokens."""
    if backend in ("slim", "flash"):  # both prefill algorithms share the decode kernel
        return kernels.decode_attention(q, cache.k[layer], cache.v[layer], lengths, **cache.scales(layer))
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(lengths[b])
        k, v = cache.dequantized(layer, b, n)  # [Hkv, n, D]
        qb = q[b].unsqueeze(1)  # [H, 1, D]
        if backend == "sdpa":
            out[b] = F.scaled_dot_product_attention(qb.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                    enable_gqa=k.shape[0] != q.shape[1])[0, :, 0]
        else:
            group = q.shape[1] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            p = torch.softmax((qb @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)
            out[b] = (p @ v)[:, 0]
    return out


# -- the model ---------------------------------------------------------------------------

class Layer:
    """One decoder layer's weights. Q, K and V are stored as one [q; k; v] matrix and the
    MLP's gate and up as one [gate; up] matrix: one matrix product each instead of three
    and two, which matters in decode where every product is a separate pass over memory."""

    def __init__(self, w: dict[str, torch.Tensor], head_dim: int):
        self.attn_norm = w["attn_norm"]
        self.head_dim = head_dim
        self.q_dim, self.kv_dim = w["wq"].shape[0], w["wk"].shape[0]
        self.wqkv = Linear(torch.cat([w["wq"], w["wk"], w["wv"]]))
        self.wo = Linear(w["wo"])
        self.mlp_norm = w["mlp_norm"]
        self.ffn_dim = w["w_gate"].shape[0]
        self.w_gate_up = Linear(torch.cat([w["w_gate"], w["w_up"]]))
        self.w_down = Linear(w["w_down"])
        # Fixed once the weights are: counted here, not on every recorded step.
        linears = (self.wqkv, self.wo, self.w_gate_up, self.w_down)
        self.weight_bytes = sum(lin.nbytes for lin in linears) + 4 * (self.attn_norm.numel() + self.mlp_norm.numel())
        self.linear_params = sum(lin.weight.numel() for lin in linears)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> q [T, q_dim], k, v [T, kv_dim], RoPE applied to q and k (cos / sin
        [T, head_dim], each token's row): one fused product, then one in-place rotation of the
        q and k heads, which sit side by side at the start of each output row."""
        qkv = self.wqkv(x)
        kernels.rope_(qkv, cos, sin, heads=(self.q_dim + self.kv_dim) // self.head_dim, head_dim=self.head_dim)
        return qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split([self.ffn_dim, self.ffn_dim], dim=-1)
        return self.w_down(F.silu(gate) * up)


class LlamaModel:
    """Weights and the forward pass. Create through workbench.load_model()."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], weight_dtype: str = "fp32"):
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
        self.cfg = cfg
        self.weight_dtype = weight_dtype
        self.embedding = weights["embedding"]  # [vocab, dim], fp32 or bf16 (rows widened on lookup)
        # Entries are popped as each layer fuses them, so the unfused copies are freed layer by
        # layer: a 7B model never exists twice in memory.
        self.layers = []
        for i in range(cfg.n_layers):
            prefix = f"layers.{i}."
            keys = [k for k in weights if k.startswith(prefix)]
            self.layers.append(Layer({k[len(prefix):]: weights.pop(k) for k in keys}, cfg.head_dim))
        self.final_norm = weights["final_norm"]
        self.lm_head = Linear(weights["lm_head"] if "lm_head" in weights else self.embedding)
        self.rope_cos, self.rope_sin = rope_tables(cfg, cfg.max_seq_len)

    @property
    def weight_bytes(self) -> int:
        total = sum(layer.weight_bytes for layer in self.layers) + self.lm_head.nbytes
        if self.lm_head.weight is not self.embedding:
            total += self.embedding.numel() * self.embedding.element_size()
        return total

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding[tokens].float()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(x, self.final_norm, self.cfg.norm_eps))

    def _layers(self, x: torch.Tensor, attend, clock: _Clock) -> torch.Tensor:
        """The decoder stack: x += attend(i, layer, norm(x)); x += mlp(norm(x)), timing each part."""
        eps = self.cfg.norm_eps
        for i, layer in enumerate(self.layers):
            t0 = clock.t()
            h = rms_norm(x, layer.attn_norm, eps)
            t1 = clock.t()
            o = attend(i, layer, h)
            t2 = clock.t()
            x = x + o
            h = rms_norm(x, layer.mlp_norm, eps)
            t3 = clock.t()
            m = layer.mlp(h)
            t4 = clock.t()
            x = x + m
            if clock.enabled:
                clock.attention[i] += t2 - t1
                clock.mlp[i] += t4 - t3
                clock.other[i] += (t1 - t0) + (t3 - t2) + (clock.t() - t4)
        return x

    def _record(self, clock: _Clock, phase: str, tokens: int, t_start: float, layers_s: float,
                kv_bytes: int, attention_pairs: int, head_rows: int) -> StepRecord | None:
        if not clock.enabled:
            return None
        total = clock.t() - t_start
        cfg = self.cfg
        attention_flops = 4 * cfg.n_heads * cfg.head_dim * attention_pairs  # Q K^T and P V
        return StepRecord(phase, tokens, clock.attention, clock.mlp, clock.other, total - layers_s,
                          [layer.weight_bytes for layer in self.layers], [kv_bytes] * cfg.n_layers,
                          total_s=total,
                          flops=[2 * tokens * layer.linear_params + attention_flops for layer in self.layers],
                          head_flops=2 * head_rows * self.lm_head.weight.numel())

    def prefill(self, tokens: torch.Tensor, seq_lens: list[int], cache: KVCache, switches: Switches,
                record: bool = False, all_logits: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        """tokens [T] packed prompts (sequence b has seq_lens[b] tokens, starting at position 0)
        -> logits of each sequence's last token [B, vocab], or of every token [T, vocab] with
        all_logits (and the step's record)."""
        cfg = self.cfg
        clock = _Clock(record, cfg.n_layers)
        t_start = clock.t()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        offsets = [0]
        for n in seq_lens:
            offsets.append(offsets[-1] + n)
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        start = torch.zeros(1, dtype=torch.int64)

        def attend(i: int, layer: Layer, h: torch.Tensor) -> torch.Tensor:
            q, k, v = layer.qkv(h, cos, sin)
            q, k, v = q.reshape(-1, H, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
            out = torch.empty(q.shape[0], H, D)
            for b in range(len(seq_lens)):  # attention per sequence: ragged prompts need no padding
                s = slice(offsets[b], offsets[b + 1])
                qb, kb, vb = (t[s].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))  # [1, heads, n, D]
                cache.append_sequence(i, b, kb, vb, start)
                out[s] = prefill_attention(switches.attention, qb, kb, vb)[0].transpose(0, 1)
            return layer.wo(out.view(-1, H * D))

        x = self._embed(tokens)  # [T, dim]
        t_layers = clock.t()
        x = self._layers(x, attend, clock)
        layers_s = clock.t() - t_layers
        last = torch.tensor([o - 1 for o in offsets[1:]])
        logits = self._head(x if all_logits else x[last])
        cache.lengths = torch.tensor(seq_lens, dtype=torch.int64)
        return logits, self._record(clock, "prefill", int(tokens.numel()), t_start, layers_s, 0,
                                    sum(n * (n + 1) // 2 for n in seq_lens), logits.shape[0])

    def decode(self, tokens: torch.Tensor, cache: KVCache, switches: Switches,
               record: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        """tokens [B], one per sequence, at positions cache.lengths -> logits [B, vocab]."""
        cfg = self.cfg
        clock = _Clock(record, cfg.n_layers)
        t_start = clock.t()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        positions = cache.lengths.clone()
        if int(positions.max()) >= cache.max_len:
            raise ValueError(f"the KV cache is full ({cache.max_len} tokens); generate fewer tokens or "
                             f"allocate a longer cache")
        lengths = positions + 1
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, D]

        def attend(i: int, layer: Layer, h: torch.Tensor) -> torch.Tensor:
            q, k, v = layer.qkv(h, cos, sin)
            cache.append(i, k.reshape(-1, Hkv, 1, D), v.reshape(-1, Hkv, 1, D), positions)  # [B, Hkv, 1, D]
            attn = decode_attention(switches.attention, q.reshape(-1, H, D).contiguous(), cache, i, lengths)
            return layer.wo(attn.reshape(-1, H * D))

        x = self._embed(tokens)  # [B, dim]
        t_layers = clock.t()
        x = self._layers(x, attend, clock)
        layers_s = clock.t() - t_layers
        logits = self._head(x)
        cache.lengths = lengths
        kv_bytes = cache.bytes_read(lengths, Hkv, D) if record else 0
        return logits, self._record(clock, "decode", int(tokens.numel()), t_start, layers_s, kv_bytes,
                                    int(lengths.sum()), logits.shape[0])
