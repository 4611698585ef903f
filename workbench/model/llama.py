"""A Llama-family decoder whose attention, KV cache and linear layers are the workbench's C++
kernels.

RMSNorm, rotary position embeddings (rotate-half layout, the config's theta and scaling),
grouped-query attention, a SwiGLU MLP, tied or untied embeddings. Two entry points:

    prefill(tokens, seq_lens, cache)   packed prompt tokens [T] of several sequences
    decode(tokens, cache)              one new token per sequence [B]

Linear layers run on the packed tokens of all sequences at once; attention runs per
sequence in prefill (ragged prompts need no padding) and batched in decode. Which attention
backend and which KV-cache format are used is decided per call (`Switches`), so they can
change between generations without touching the weights.

Weights arrive unfused, one dict per layer (wq, wk, wv, wo, w_gate, w_up, w_down and the
two norms). A tensor-parallel rank is built at load with a `Parallel` (below; the one in
workbench.distributed.tp): it keeps its slice of each dict before Q/K/V and gate/up are
fused, and the forward pass calls it at the few places where a rank differs from one
process (embedding, the all-reduces after o_proj and down_proj, the LM head). Head counts
are read from the weights' shapes (the model's local heads), never from the config.

Every step can record, per layer and per part (workbench.model.timing.PARTS), the time
spent, the bytes read and the floating-point operations done (`StepRecord`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from workbench import kernels
from workbench.hw import memory
from workbench.model.attention import attention_backend
from workbench.model.config import ModelConfig
from workbench.model.kv_formats import KVCache, new_kv_cache, per_query_head
from workbench.model.switches import Switches
from workbench.model.weights import AS_FILE, WEIGHT_FORMATS, BlockTensor, WeightFormat, weight_format
from workbench.model.timing import Clock, StepRecord

NORM_BYTES_PER_ELEM = 4  # norm weights stay fp32


class Parallel(Protocol):
    """One rank of a tensor-parallel model, given to LlamaModel at load. One process has none.

        keep(cfg, layer, w)      the weights this rank keeps of one layer's unfused dict (layer
                                 None: the embedding / final norm / LM head dict; entries it adds
                                 there beyond those three land in LlamaModel.extras)
        attach(model)            once the shard is packed: sets model.collective (the all-reduce
                                 the fused decode step runs after o_proj and down_proj),
                                 model.head_map and model.kv_handoff
        embed(tokens)            token ids [T] -> [T, dim], the same on every rank
        head(x)                  the final norm, this rank's LM head and the exchange -> logits
                                 [rows, vocab] every rank agrees on
        reduce(linear, x, i, part)   o_proj or down_proj ("attention" / "mlp" of layer i) on this
                                 rank's slice, then the all-reduce of the partial sums
        begin(record), end(rec)  around every step: its communication accounting (end returns
                                 the step's record with its "comm" filled in)
    """

    def keep(self, cfg: ModelConfig, layer: int | None, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def attach(self, model: LlamaModel) -> None: ...
    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...
    def head(self, x: torch.Tensor) -> torch.Tensor: ...
    def reduce(self, linear: Linear, x: torch.Tensor, layer: int, part: str) -> torch.Tensor: ...
    def begin(self, record: bool) -> None: ...
    def end(self, rec: StepRecord | None) -> StepRecord | None: ...


@dataclass
class LinearPart:
    """Rows of a linear layer in one format: weight [rows, K] (uint8 block rows in the kernels'
    layout for a block format) and int8's scales."""

    fmt: WeightFormat
    weight: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.weight.numel() * self.weight.element_size() + scales


def convert_weight(w, fmt: WeightFormat | None) -> LinearPart:
    """One matrix (a tensor, or a BlockTensor as a file holds it) in format `fmt`, or with fmt
    None in its own (a BlockTensor's blocks; a float tensor in fp32). Block formats quantize
    with our quantizer (kernels.quantize_blocks), taking the format's fallback for rows that are
    not whole blocks; int8 ones with quantize_weight_int8. One matrix at a time, so a model
    never exists twice in memory in a wider dtype."""
    if fmt is None:
        if isinstance(w, BlockTensor):
            return LinearPart(w.fmt, w.to_kernel().data)
        fmt = WEIGHT_FORMATS["fp32"]
    if isinstance(w, BlockTensor):
        if w.fmt is fmt.for_cols(w.cols):
            return LinearPart(w.fmt, w.to_kernel().data)
        blocks, w = w, w.dequantize()
        blocks.drop()
    if fmt.blocks:
        fmt = fmt.for_cols(w.shape[1])
        gguf_order = kernels.quantize_blocks(w.float().contiguous(), fmt.kernel, search=fmt.search)
        return LinearPart(fmt, kernels.repack_blocks(gguf_order, fmt.kernel, w.shape[1]))
    if fmt.quantized:
        return LinearPart(fmt, *kernels.quantize_weight_int8(w, fmt.group))
    return LinearPart(fmt, w.to(fmt.storage).contiguous())


class Linear:
    """y = x W^T with W [out, in] in one or more row-wise parts (LinearPart), each fp32, bf16,
    int8 (one scale per output row or per 32 weights) or block-quantized (kernels/blocks.h):
    our matrix-vector kernel for decode's few rows, our packed GEMM for more
    (workbench.kernels.linear). Several parts when the stacked matrices (q, k, v; gate, up)
    come in different formats, as a Q4_K_M file's q and v do; their outputs are concatenated."""

    def __init__(self, weight, fmt: WeightFormat | None):
        self.parts: list[LinearPart] = []
        self.piece_rows: list[int] = []  # rows of each stacked matrix, in order (q, k, v; gate, up)
        for w in weight if isinstance(weight, list) else [weight]:
            w = materialize(w)
            self.in_features = w.cols if isinstance(w, BlockTensor) else w.shape[1]
            part = convert_weight(w, fmt)
            self.piece_rows.append(part.rows)
            last = self.parts[-1] if self.parts else None
            if last is not None and last.fmt is part.fmt:  # rows of one format stay one matrix
                last.weight = torch.cat([last.weight, part.weight])
                if part.scale is not None:
                    last.scale = torch.cat([last.scale, part.scale])
            else:
                self.parts.append(part)

    @property
    def weight(self) -> torch.Tensor:
        """The weights of a linear layer kept in one format (an AttributeError naming the
        formats where its rows come in several: see parts)."""
        if len(self.parts) != 1:
            raise AttributeError(f"this linear layer's rows are in {len(self.parts)} formats "
                                 f"({', '.join(p.fmt.name for p in self.parts)}): read .parts")
        return self.parts[0].weight

    @property
    def scale(self) -> torch.Tensor | None:
        return self.parts[0].scale if len(self.parts) == 1 else None

    @property
    def out_features(self) -> int:
        return sum(part.rows for part in self.parts)

    @property
    def params(self) -> int:
        return self.out_features * self.in_features

    @property
    def formats(self) -> list[WeightFormat]:
        return [part.fmt for part in self.parts]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        if len(self.parts) == 1:
            p = self.parts[0]
            return kernels.linear(x, p.weight, scale=p.scale, out=out,
                                  kernel=p.fmt.kernel if p.fmt.blocks else "")
        y = torch.cat([kernels.linear(x, p.weight, scale=p.scale, kernel=p.fmt.kernel if p.fmt.blocks else "")
                       for p in self.parts], dim=-1)
        if out is None:
            return y
        return out.copy_(y)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def materialize(w):
    """A weight a loader left lazy (a callable that makes it, read or converted only when its
    layer is built), made; anything else as it is."""
    return w() if callable(w) else w


def embed_rows(table, tokens: torch.Tensor) -> torch.Tensor:
    """The embedding rows of token ids [T] as fp32 [T, dim]: gathered from a tensor, or for a
    BlockTensor dequantized as they are gathered (kernels.dequantize_blocks)."""
    if isinstance(table, BlockTensor):
        return kernels.dequantize_blocks(table.data, table.fmt.kernel, table.cols, rows=tokens.reshape(-1).long().contiguous())
    return table[tokens].float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, dim] / rms(x) * weight, in fp32: our kernel, one pass over the rows in parallel,
    where torch's op runs several passes on one thread (a few percent of a prefill's time in a
    profile)."""
    return kernels.rms_norm(x.contiguous(), weight, eps)


def rope_tables(cfg: ModelConfig, max_len: int, theta: float | None = None,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, rotary dims] for the rotate-half layout (the head's first rotary dims:
    all of them but for partial rotary), base `theta` (default the config's) and rope scaling
    (default the config's; a local table passes {}): Hugging Face's "linear", "llama3" and
    "longrope" (Phi-3: the long factors where the model's context is longer than the trained
    one, as llama.cpp chooses), and "freq_factors" (a GGUF file's rope_freqs / rope_factors
    tensor: one divisor per frequency). "attention_factor" multiplies cos and sin."""
    d = cfg.rope_dims
    theta = theta if theta is not None else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling if scaling is None else scaling
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    attention_factor = scaling.get("attention_factor") or 1.0
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
    elif kind == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        long = cfg.max_seq_len > old_len
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        inv_freq = inv_freq / factors
        if not scaling.get("attention_factor"):  # Hugging Face's default from the context's growth
            factor = scaling.get("factor") or scaling.get("max_position_embeddings", old_len) / old_len
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(old_len)) if factor > 1 else 1.0
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {scaling!r} (supported: linear, llama3, longrope, freq_factors)")
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * attention_factor).float(), (angles.sin() * attention_factor).float()


class ExpertGroup:
    """A mixture's experts' matrices of one kind ([gate; up], or down) as one tensor group for
    the accounting a Linear offers (bytes, parameters, formats): what %workbench and the cost
    model read of a layer's groups."""

    def __init__(self, linears: list[Linear]):
        self.members = linears

    @property
    def nbytes(self) -> int:
        return sum(lin.nbytes for lin in self.members)

    @property
    def params(self) -> int:
        return sum(lin.params for lin in self.members)

    @property
    def formats(self) -> list[WeightFormat]:
        return [f for lin in self.members for f in lin.formats]


class _Mixture:
    """A layer's mixture of experts called as the MLP's last linear layer is (y = f(x), or into
    `out`), so a tensor-parallel rank's all-reduce applies to it alike."""

    def __init__(self, layer: Layer, activation: str):
        self.layer, self.activation = layer, activation
        self.out_features = layer.attn_norm.numel()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = self.layer.moe(x, self.activation)
        return y if out is None else out.copy_(y)


class Layer:
    """One decoder layer's weights. Q, K and V are stored as one [q; k; v] matrix and the
    MLP's gate and up as one [gate; up] matrix: one matrix product each instead of three
    and two, which matters in decode where every product is a separate pass over memory.
    What the family adds (workbench.model.arch) is None where it has none: q / k / v biases
    (one [q; k; v] vector), per-head q and k norms, norms after attention and the MLP."""

    # The vectors a family may add, as the loaders name them in a layer's dict.
    EXTRAS = ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")

    def __init__(self, w: dict[str, torch.Tensor], head_dim: int, fmt: WeightFormat | None):
        self.attn_norm, self.mlp_norm = materialize(w["attn_norm"]), materialize(w["mlp_norm"])
        for name in self.EXTRAS:
            setattr(self, name, materialize(w[name]).float().contiguous() if name in w else None)
        biases = [w.pop(b) for b in ("bq", "bk", "bv") if b in w]
        self.qkv_bias = torch.cat([materialize(b).float() for b in biases]).contiguous() if biases else None
        self.head_dim = head_dim
        self.window = 0  # set by the model: this layer's sliding window (0: none)
        self.rope = 0    # and which RoPE table it reads (1: the local layers')
        # each matrix read (a loader's lazy weight) and converted in turn, freed once stacked
        self.wqkv = Linear([w.pop("wq"), w.pop("wk"), w.pop("wv")], fmt)
        self.wo = Linear(w.pop("wo"), fmt)
        # A mixture of experts (arch.Architecture.moe): the router in fp32 and each expert's
        # [gate; up] and down in the format; top_k and norm_topk set by the model from its config.
        self.router, self.experts, self.top_k, self.norm_topk = None, [], 0, True
        self.last_experts: list[int] = []  # the experts the last forward ran (what it read)
        self.expert_load = None  # a mixture's: tokens routed to each expert since the load
        self.last_load: list[int] = []  # ... and in the last forward
        if "router" in w:
            router = materialize(w.pop("router"))
            router = router.dequantize() if isinstance(router, BlockTensor) else router
            self.router = Linear(router.float(), WEIGHT_FORMATS["fp32"])
            # expert e's pair, or None where another rank holds it (expert parallel: the shard
            # keeps some experts whole and drops the others' tensors)
            self.experts = [(Linear([w.pop(f"experts.{e}.w_gate"), w.pop(f"experts.{e}.w_up")], fmt),
                             Linear(w.pop(f"experts.{e}.w_down"), fmt)) if f"experts.{e}.w_gate" in w else None
                            for e in range(self.router.out_features)]
            self.w_gate_up, self.w_down = None, None
            self.ffn_dim = next(pair for pair in self.experts if pair)[0].piece_rows[0]
            self.expert_load = torch.zeros(len(self.experts), dtype=torch.int64)
        else:
            self.w_gate_up = Linear([w.pop("w_gate"), w.pop("w_up")], fmt)
            self.w_down = Linear(w.pop("w_down"), fmt)
            self.ffn_dim = self.w_gate_up.piece_rows[0]
        self.q_dim, self.kv_dim, _ = self.wqkv.piece_rows
        self.n_heads, self.n_kv_heads = self.q_dim // head_dim, self.kv_dim // head_dim  # this process's heads
        # Fixed once the weights are: counted here, not on every recorded step.
        linears = self.stream()
        vectors = [self.attn_norm, self.mlp_norm, self.qkv_bias, *(getattr(self, n) for n in self.EXTRAS)]
        norms = sum(v.numel() for v in vectors if v is not None)
        self.weight_bytes = sum(lin.nbytes for lin in linears) + NORM_BYTES_PER_ELEM * norms
        self.linear_params = sum(lin.params for lin in linears)
        # a step of a mixture reads the attention, the router and the experts it routes to
        self._shared_bytes = self.weight_bytes - sum(a.nbytes + b.nbytes for a, b in self.held_experts)
        self._shared_params = self.linear_params - sum(a.params + b.params for a, b in self.held_experts)

    @property
    def held_experts(self) -> list[tuple[Linear, Linear]]:
        """The ([gate; up], down) pairs of the experts this process holds (all, in one process)."""
        return [pair for pair in self.experts if pair is not None]

    def stream(self) -> list[Linear]:
        """Every matrix of the layer in the order a decode step reads them."""
        mlp = ([self.router] + [lin for pair in self.held_experts for lin in pair] if self.router is not None
               else [self.w_gate_up, self.w_down])
        return [self.wqkv, self.wo, *mlp]

    @property
    def linears(self) -> dict[str, Linear]:
        """The tensor groups: q / k / v, o, [gate; up], down; a mixture's router and its experts'
        [gate; up] and down as one group each (ExpertGroup: their bytes, parameters, formats)."""
        if self.router is not None:
            return {"qkv": self.wqkv, "o": self.wo, "router": self.router,
                    "gate_up": ExpertGroup([g for g, _ in self.held_experts]),
                    "down": ExpertGroup([d for _, d in self.held_experts])}
        return {"qkv": self.wqkv, "o": self.wo, "gate_up": self.w_gate_up, "down": self.w_down}

    def read_bytes(self) -> int:
        """Weight bytes the last step read: all of a dense layer's; of a mixture, the shared
        part and the experts its tokens were routed to (top_k of them before any step)."""
        if self.router is None:
            return self.weight_bytes
        used = [self.experts[e] for e in (self.last_experts or range(self.top_k))]
        return self._shared_bytes + sum(pair[0].nbytes + pair[1].nbytes for pair in used if pair)

    def step_flops(self, tokens: int) -> int:
        """The linear layers' FLOPs of a step of `tokens` tokens: 2 per token and weight of a
        dense layer; of a mixture, the shared part for every token and each expert this process
        holds for the tokens the step routed to it."""
        if self.router is None:
            return 2 * tokens * self.linear_params
        routed = sum(n * (pair[0].params + pair[1].params) for n, pair in zip(self.last_load, self.experts) if pair)
        return 2 * (tokens * self._shared_params + routed)

    def moe(self, x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """The mixture in place of the MLP, x [T, dim] -> [T, dim]: the router's softmax, each
        token's top_k experts (their weights renormalized to sum to 1 where norm_topk), and
        each expert run once on the rows routed to it (its weights read once), its output
        weighted and added into those rows."""
        probs = self.router(x).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        load = torch.bincount(chosen.flatten(), minlength=len(self.experts))
        self.expert_load += load
        self.last_load = load.tolist()
        self.last_experts = sorted(set(chosen.flatten().tolist()))
        for e in self.last_experts:
            if self.experts[e] is None:  # another rank's (expert parallel): its share comes in the all-reduce
                continue
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gate_up, down = self.experts[e]
            gu = gate_up(x[rows])
            gate, up = gu.split([self.ffn_dim, self.ffn_dim], dim=-1)
            act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
            out.index_add_(0, rows, down((act * up).contiguous()) * weights[rows, slot, None])
        return out

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> q [T, q_dim], k, v [T, kv_dim], RoPE applied to q and k (cos / sin
        [T, rotary dims], each token's row): one fused product (plus the biases), the per-head
        q / k norms where the family has them, then one in-place rotation of the q and k heads,
        which sit side by side at the start of each output row."""
        qkv = self.wqkv(x)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        D, T = self.head_dim, qkv.shape[0]
        for norm, lo, heads in ((self.q_norm, 0, self.n_heads), (self.k_norm, self.q_dim, self.n_kv_heads)):
            if norm is not None:  # each head's D values normalised on their own
                part = qkv[:, lo:lo + heads * D]
                part.copy_(rms_norm(part.reshape(T * heads, D), norm, eps).view(T, heads * D))
        kernels.rope_(qkv, cos, sin, heads=self.n_heads + self.n_kv_heads, head_dim=D)
        return qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)

    def mlp_input(self, x: torch.Tensor, activation: str = "silu", one_pass: bool = False) -> torch.Tensor:
        """act(gate(x)) * up(x), the input of down_proj (act: SiLU, or GELU's tanh form); with
        one_pass (prefill) one kernel pass over the [gate | up] rows (kernels.act_mul), else
        the torch expression (the reference)."""
        gate_up = self.w_gate_up(x)
        if one_pass:
            return kernels.act_mul(gate_up, activation)
        gate, up = gate_up.split([self.ffn_dim, self.ffn_dim], dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        return act * up


class LlamaModel:
    """Weights and the forward pass. Create through workbench.load_model()."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], weight_dtype_name: str = "fp32",
                 parallel: Parallel | None = None):
        # "file": every matrix as the loader gave it (a GGUF file's blocks as they are); else a
        # weight format, every matrix converted to it (a ValueError naming the accepted ones)
        fmt = None if weight_dtype_name == AS_FILE else weight_format(weight_dtype_name)
        self.cfg = cfg
        self.weight_dtype = weight_dtype_name
        self.format = fmt
        self.source: str | None = None  # the file or directory the weights came from (None: random)
        # A tensor-parallel rank keeps its slice of each layer (made first: the slicing needs the
        # tensors); one process passes the loader's lazy weights straight to the layer.
        keep = ((lambda cfg, layer, w: parallel.keep(cfg, layer, {k: materialize(v) for k, v in w.items()}))
                if parallel is not None else (lambda cfg, layer, w: w))
        # Entries are popped as each layer fuses them, so the unfused copies are freed layer by
        # layer: a 7B model never exists twice in memory.
        self.layers = []
        for i in range(cfg.n_layers):
            prefix = f"layers.{i}."
            unfused = {k[len(prefix):]: weights.pop(k) for k in [k for k in weights if k.startswith(prefix)]}
            self.layers.append(Layer(keep(cfg, i, unfused), cfg.head_dim, fmt))
            memory.trim_heap()  # the layer's transient copies (file view -> kernels' layout, stacking)
        embedding = materialize(weights["embedding"])
        lm_head = materialize(weights["lm_head"]) if "lm_head" in weights else embedding  # tied: the same tensor
        head = keep(cfg, None, {"embedding": embedding, "final_norm": materialize(weights["final_norm"]),
                                "lm_head": lm_head})
        embedding, lm_head = head.pop("embedding"), head.pop("lm_head")
        self.final_norm = head.pop("final_norm")
        self.lm_head = Linear(lm_head, fmt)
        # [vocab, dim]: in blocks where the weights are (rows dequantized as they are gathered; a
        # tied table is the LM head's own rows), else fp32 or bf16 (rows widened on lookup; int8: fp32)
        self.embedding = self._embedding_table(embedding, lm_head is embedding, fmt)
        self.extras = head
        self._pack_weights()
        self.n_heads, self.n_kv_heads = self.layers[0].n_heads, self.layers[0].n_kv_heads
        # RoPE tables: the global one, and the windowed layers' own where their base differs
        # (Gemma 3's local layers: 10,000 against 1,000,000)
        self.rope_cos, self.rope_sin = rope_tables(cfg, cfg.max_seq_len)
        local = cfg.windows is not None and cfg.rope_local_theta is not None
        self.rope_local = rope_tables(cfg, cfg.max_seq_len, cfg.rope_local_theta, {}) if local else None
        for i, layer in enumerate(self.layers):
            layer.window = cfg.window(i)
            layer.top_k, layer.norm_topk = cfg.experts_per_token, cfg.norm_topk
            layer.rope = 1 if layer.window and local else 0
        self._stacks = weakref.WeakKeyDictionary()  # cache -> its fused decode step (kernels.decode_stack)
        # Tensor parallel: the all-reduce the fused step runs after o_proj and down_proj (a
        # kernels StepCollective); None in one process.
        self.collective = None
        # ... and, where the rank's shard splits a group of query heads, which KV head each of
        # its query heads reads: (group, q_offset), see kernels.decode_attention. None: equal
        # groups, as in one process.
        self.head_map: tuple[int, int] | None = None
        # ... and whether its first KV head is also the previous rank's (it computes it and
        # hands it over) and its last also the next rank's (it takes it): (send, recv).
        self.kv_handoff = (False, False)
        self.parallel = parallel
        if parallel is not None:
            parallel.attach(self)

    def _embedding_table(self, source, tied: bool, fmt: WeightFormat | None):
        """The embedding table: a BlockTensor (kernels' layout) where the model keeps block
        formats (the file's, or fmt's), sharing the LM head's rows when tied; else a tensor in
        the format's embedding dtype (fp32 when the weights are the file's)."""
        in_blocks = fmt.blocks if fmt is not None else isinstance(source, BlockTensor)
        if in_blocks:
            head = self.lm_head.parts
            if tied and len(head) == 1 and head[0].fmt.blocks:
                return BlockTensor(head[0].weight, head[0].fmt, self.cfg.dim)
            part = convert_weight(source, fmt)
            return BlockTensor(part.weight, part.fmt, self.cfg.dim)
        head = self.lm_head.parts
        if tied and len(head) == 1 and not head[0].fmt.quantized:
            return head[0].weight  # fp32 / bf16 weights: the LM head is the table itself
        table = source.dequantize() if isinstance(source, BlockTensor) else source
        if fmt is not None and fmt.quantized:  # int8 weights: the table stays as the loader made it
            return table
        return table.to(fmt.embedding_dtype() if fmt is not None else torch.float32)

    def _pack_weights(self) -> None:
        """Move every matrix (and int8 scales) into one huge-page arena in the order a decode
        step reads them: layer by layer qkv, o, gate/up, down, then the LM head. A batch-1
        decode step then streams one long run of memory on 2 MiB pages (workbench.hw.memory.Arena).
        Each old tensor is freed as its view replaces it; a tied LM head stays the embedding."""
        linears = [lin for layer in self.layers for lin in layer.stream()]
        linears.append(self.lm_head)
        slots = [(part, name) for lin in linears for part in lin.parts for name in ("weight", "scale")
                 if getattr(part, name) is not None]
        head = self.lm_head.parts[0].weight
        table = self.embedding.data if isinstance(self.embedding, BlockTensor) else self.embedding
        tied = len(self.lm_head.parts) == 1 and head is table
        arena = memory.Arena(sum(memory.Arena.size(getattr(part, name)) for part, name in slots))
        moved = 0
        for part, name in slots:
            old = getattr(part, name)
            setattr(part, name, arena.take(old))
            moved += old.nbytes
            del old
            if moved >= 64 << 20:  # the replaced tensors' heap pages back to the system as we go
                memory.trim_heap()
                moved = 0
        memory.trim_heap()
        if tied:
            moved = self.lm_head.parts[0].weight
            if isinstance(self.embedding, BlockTensor):
                self.embedding.data = moved
            else:
                self.embedding = moved

    @property
    def embedding_shared(self) -> bool:
        """Whether the embedding table is the LM head's own rows (tied, and kept in one format)."""
        table = self.embedding.data if isinstance(self.embedding, BlockTensor) else self.embedding
        return len(self.lm_head.parts) == 1 and self.lm_head.parts[0].weight is table

    @property
    def weight_bytes(self) -> int:
        """All weights held: layers, LM head, final norm, and the embedding when not tied."""
        total = sum(layer.weight_bytes for layer in self.layers) + self.lm_head.nbytes
        total += NORM_BYTES_PER_ELEM * self.final_norm.numel()
        if not self.embedding_shared:  # untied (or a shard's vocabulary slice)
            total += self.embedding.nbytes if isinstance(self.embedding, BlockTensor) else (
                self.embedding.numel() * self.embedding.element_size())
        return total

    @property
    def weight_formats(self) -> dict[str, dict[str, int]]:
        """Each tensor group's formats: group -> {format: how many matrices} (a Q4_K_M file mixes
        q4_k with q6_k in v and down of some layers, and in the LM head)."""
        groups: dict[str, dict[str, int]] = {}

        def count(group: str, names):
            for name in names:
                groups.setdefault(group, {}).setdefault(name, 0)
                groups[group][name] += 1

        for layer in self.layers:
            for group, lin in layer.linears.items():
                count(group, [f.name for f in lin.formats])
        count("lm_head", [f.name for f in self.lm_head.formats])
        emb = self.embedding
        count("embedding", [emb.fmt.name if isinstance(emb, BlockTensor) else str(emb.dtype).replace("torch.", "")])
        return groups

    @property
    def embedding_row_bytes(self) -> int:
        """Bytes of one embedding row as held (a block format's blocks, or the float row)."""
        emb = self.embedding
        return emb.data.shape[1] if isinstance(emb, BlockTensor) else emb.shape[1] * emb.element_size()

    def bytes_per_weight(self) -> dict:
        """What the cost model needs of weights held as a file holds them: each tensor group's
        mean bytes per weight over the layers (its mix of formats), the LM head's, the
        embedding's bytes a row, and the main format (the first layer's qkv). Per weight, so a
        tensor-parallel shard's numbers are the whole model's."""
        per = {}
        for group in ("qkv", "o", "gate_up", "down"):
            lins = [layer.linears[group] for layer in self.layers]
            per[group] = sum(lin.nbytes for lin in lins) / sum(lin.params for lin in lins)
        per["lm_head"] = self.lm_head.nbytes / self.lm_head.params
        per["embed_row"] = self.embedding_row_bytes
        per["format"] = self.layers[0].wqkv.parts[0].fmt.name
        return per

    def head_bytes(self, tokens: int) -> int:
        """Bytes the non-layer part of a step reads: the embedding rows of `tokens` tokens,
        the final norm, the whole LM head."""
        return tokens * self.embedding_row_bytes + NORM_BYTES_PER_ELEM * self.final_norm.numel() + self.lm_head.nbytes

    def new_cache(self, batch: int, max_len: int, kv_cache: str, kv_kernel: str | None = None) -> KVCache:
        """An empty KV cache for this model's (local) KV heads, laid out for `kv_kernel` (None:
        the format's default); a windowed layer's a ring of its window."""
        cache = new_kv_cache(self.cfg.n_layers, batch, self.n_kv_heads, max_len, self.cfg.head_dim, kv_cache,
                             kv_kernel, [layer.window for layer in self.layers])
        cache.head_map = self.head_map
        return cache

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.parallel.embed(tokens) if self.parallel is not None else embed_rows(self.embedding, tokens)
        if self.cfg.spec.embed_scale:  # Gemma: the rows times sqrt(hidden), in fp32
            x *= torch.tensor(self.cfg.dim ** 0.5, dtype=torch.float32)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return self.parallel.head(x)
        return self.lm_head(rms_norm(x, self.final_norm, self.cfg.norm_eps))

    def _project(self, linear: Linear, x: torch.Tensor, layer: int, part: str) -> torch.Tensor:
        """o_proj or down_proj: on a tensor-parallel rank, its slice and the all-reduce."""
        if self.parallel is not None:
            return self.parallel.reduce(linear, x, layer, part)
        return linear(x)

    def _clock(self, record: bool) -> Clock:
        """A step's clock (and, on a tensor-parallel rank, the start of its accounting)."""
        if self.parallel is not None:
            self.parallel.begin(record)
        return Clock(record, len(self.layers))

    def _layers(self, x: torch.Tensor, attend, clock: Clock, one_pass: bool = False) -> torch.Tensor:
        """The decoder stack: x += post(o_proj(attend(i, layer, norm(x)))); x += post(down(act(
        gate) * up of norm(x))), the post norms where the family has them, timing each part (x
        updated in place; one_pass: Layer.mlp_input's)."""
        eps, act = self.cfg.norm_eps, self.cfg.spec.activation
        for i, layer in enumerate(self.layers):
            t0 = clock.t()
            h = rms_norm(x, layer.attn_norm, eps)
            t1 = clock.t()
            o = self._project(layer.wo, attend(i, layer, h), i, "attention")
            t2 = clock.t()
            if layer.post_attn_norm is not None:
                o = rms_norm(o, layer.post_attn_norm, eps)
            x += o
            h = rms_norm(x, layer.mlp_norm, eps)
            t3 = clock.t()
            if layer.router is not None:  # a mixture of experts (on a rank: its experts or slices, then the all-reduce)
                m = self._project(_Mixture(layer, act), h, i, "mlp")
            else:
                m = self._project(layer.w_down, layer.mlp_input(h, act, one_pass), i, "mlp")
            t4 = clock.t()
            if layer.post_mlp_norm is not None:
                m = rms_norm(m, layer.post_mlp_norm, eps)
            x += m
            if clock.enabled:
                clock.add("attention", i, t2 - t1)
                clock.add("mlp", i, t4 - t3)
                clock.add("other", i, (t1 - t0) + (t3 - t2) + (clock.t() - t4))
        return x

    def _record(self, clock: Clock, phase: str, tokens: int, t_start: float, layers_s: float,
                kv_bytes: int | list[int], attention_pairs: int, head_rows: int, wake_s: float = 0.0,
                path: str = "", comm_bytes: int = 0) -> StepRecord | None:
        """The step's record (None when not recording), its communication accounted on a
        tensor-parallel rank; comm_bytes: what the fused step's own all-reduces sent."""
        rec = None
        if clock.enabled:
            total = clock.t() - t_start
            attention_flops = 4 * self.n_heads * self.cfg.head_dim * attention_pairs  # Q K^T and P V
            rec = StepRecord(phase, tokens, clock.parts_s, total - layers_s,
                             weight_bytes=[layer.read_bytes() for layer in self.layers],
                             kv_bytes=kv_bytes if isinstance(kv_bytes, list) else [kv_bytes] * len(self.layers),
                             head_bytes=self.head_bytes(tokens),
                             total_s=total,
                             flops=[layer.step_flops(tokens) + attention_flops for layer in self.layers],
                             head_flops=2 * head_rows * self.lm_head.params, wake_s=wake_s, path=path,
                             comm_bytes=comm_bytes,
                             expert_tokens=[list(layer.last_load) for layer in self.layers] if self.layers[0].router
                             is not None else [])
        return self.parallel.end(rec) if self.parallel is not None else rec

    def _tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The RoPE cos / sin rows of `positions` in each table (Layer.rope: 0 global, 1 local)."""
        tables = [(self.rope_cos[positions], self.rope_sin[positions])]
        if self.rope_local is not None:
            tables.append((self.rope_local[0][positions], self.rope_local[1][positions]))
        return tables

    def _packed(self, seq_lens: list[int], starts: list[int]) -> tuple[list[int], list]:
        """Packed pieces (piece b: seq_lens[b] tokens from position starts[b]) -> each piece's
        offset in the packing (and the end), and the RoPE rows of every token in each table."""
        offsets = list(itertools.accumulate(seq_lens, initial=0))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, seq_lens)])
        return offsets, self._tables(positions)

    @staticmethod
    def _last_rows(offsets: list[int]) -> torch.Tensor:
        """The packing's row of each piece's last token."""
        return torch.tensor([o - 1 for o in offsets[1:]])

    def prefill(self, tokens: torch.Tensor, seq_lens: list[int], cache: KVCache, switches: Switches,
                record: bool = False, all_logits: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        """tokens [T] packed prompts (sequence b has seq_lens[b] tokens, starting at position 0)
        -> logits of each sequence's last token [B, vocab], or of every token [T, vocab] with
        all_logits (and the step's record)."""
        clock = self._clock(record)
        t_start = clock.t()
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.cfg.head_dim
        backend = attention_backend(switches.attention)
        act = self.attention_dtype
        offsets, tables = self._packed(seq_lens, [0] * len(seq_lens))
        start = torch.zeros(1, dtype=torch.int64)
        scale, eps = self.cfg.softmax_scale, self.cfg.norm_eps

        def attend(i: int, layer: Layer, h: torch.Tensor) -> torch.Tensor:
            q, k, v = layer.qkv(h, *tables[layer.rope], eps)
            q, k, v = q.reshape(-1, H, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
            out = torch.empty(q.shape[0], H, D)
            for b in range(len(seq_lens)):  # attention per sequence: ragged prompts need no padding
                s = slice(offsets[b], offsets[b + 1])
                qb, kb, vb = (t[s].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))  # [1, heads, n, D]
                cache.append(i, kb, vb, start, rows=slice(b, b + 1))
                kb, vb = per_query_head(kb, vb, H, self.head_map, dim=1)  # our prefill kernels: equal groups
                out[s] = backend.prefill(qb.to(act), kb.to(act), vb.to(act), scale, layer.window)[0].transpose(0, 1)
            return out.view(-1, H * D)

        x = self._embed(tokens)  # [T, dim]
        t_layers = clock.t()
        x = self._layers(x, attend, clock, one_pass=True)
        layers_s = clock.t() - t_layers
        logits = self._head(x if all_logits else x[self._last_rows(offsets)])
        cache.lengths = torch.tensor(seq_lens, dtype=torch.int64)
        return logits, self._record(clock, "prefill", int(tokens.numel()), t_start, layers_s, 0,
                                    self._pairs(seq_lens, [0] * len(seq_lens)), logits.shape[0])

    def extend(self, tokens: torch.Tensor, seq_lens: list[int], rows: list[int], starts: list[int],
               cache: KVCache, record: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        """Continue several sequences at once: tokens [T] packed pieces, piece b of seq_lens[b]
        tokens for the cache's row rows[b] at positions starts[b] .. starts[b] + seq_lens[b] - 1,
        after the starts[b] tokens that row already holds (prompts prefilled in chunks, or the
        rest of a prompt whose prefix was reused) -> the logits of each piece's last token
        [B, vocab]. Every matrix product runs once over all T tokens; attention runs per
        piece with SlimAttention, each query over its row's first starts[b] + seq_lens[b]
        positions (causal, the keys before starts[b] all visible)."""
        if not (len(seq_lens) == len(rows) == len(starts)) or not seq_lens:
            raise ValueError(f"extend: seq_lens, rows and starts must be equally long and non-empty, got "
                             f"{len(seq_lens)}, {len(rows)} and {len(starts)}")
        batch = cache.lengths.numel()
        if len(set(rows)) != len(rows) or not all(0 <= r < batch for r in rows):
            raise ValueError(f"extend: rows must be distinct rows of the cache (0..{batch - 1}), got {rows}")
        for n, start in zip(seq_lens, starts):
            if n < 1 or start < 0 or start + n > cache.max_len:
                raise ValueError(f"extend: {n} tokens at position {start} do not fit a cache of {cache.max_len} "
                                 f"(need at least one token and start >= 0)")
        if int(tokens.numel()) != sum(seq_lens):
            raise ValueError(f"extend: {tokens.numel()} tokens given for pieces of {sum(seq_lens)} in all")
        clock = self._clock(record)
        t_start = clock.t()
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.cfg.head_dim
        act = self.attention_dtype
        offsets, tables = self._packed(seq_lens, starts)
        at = [torch.tensor([s], dtype=torch.int64) for s in starts]
        scale, eps = self.cfg.softmax_scale, self.cfg.norm_eps

        def attend(i: int, layer: Layer, h: torch.Tensor) -> torch.Tensor:
            q, k, v = layer.qkv(h, *tables[layer.rope], eps)
            q, k, v = q.reshape(-1, H, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
            out = torch.empty(q.shape[0], H, D)
            ring = cache.rings[i]
            for b, row in enumerate(rows):
                s = slice(offsets[b], offsets[b + 1])
                qb, kb, vb = (t[s].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))  # [1, heads, n, D]
                if ring:  # the ring's older tokens first (copies: the new ones may overwrite them), then the piece's own
                    old_k, old_v = (t.clone() for t in cache.dequantized(i, row, starts[b]))
                    cache.append(i, kb, vb, at[b], rows=slice(row, row + 1))
                    keys, values = torch.cat([old_k, kb[0].float()], dim=1), torch.cat([old_v, vb[0].float()], dim=1)
                else:
                    cache.append(i, kb, vb, at[b], rows=slice(row, row + 1))
                    keys, values = cache.dequantized(i, row, starts[b] + seq_lens[b])  # [Hkv, start + n, D]
                keys, values = per_query_head(keys, values, H, self.head_map)
                keys, values = (t.unsqueeze(0).to(act).contiguous() for t in (keys, values))
                out[s] = kernels.slim_attention(qb.to(act), keys, values, scale=scale,
                                                window=layer.window)[0].transpose(0, 1)
            return out.view(-1, H * D)

        x = self._embed(tokens)
        t_layers = clock.t()
        x = self._layers(x, attend, clock, one_pass=True)
        layers_s = clock.t() - t_layers
        logits = self._head(x[self._last_rows(offsets)])
        return logits, self._record(clock, "prefill", int(tokens.numel()), t_start, layers_s, 0,
                                    self._pairs(seq_lens, starts), len(seq_lens))

    def _pairs(self, seq_lens: list[int], starts: list[int]) -> int:
        """(query, key) pairs the attention of pieces of seq_lens[b] tokens after starts[b] ones
        computes, over the layers' mean (a windowed layer's queries see at most `window` keys)."""
        def pairs(n: int, s: int, window: int) -> int:
            if not window:
                return n * s + n * (n + 1) // 2
            return sum(min(window, s + j + 1) for j in range(n))

        per_layer = [sum(pairs(n, s, layer.window) for n, s in zip(seq_lens, starts)) for layer in self.layers]
        return round(sum(per_layer) / len(per_layer))

    @property
    def attention_dtype(self) -> torch.dtype:
        """What prefill attention runs in: bf16 where the weights' products run on a bf16 engine
        (WeightFormat.matrix_engine and kernels.gemm_engine() not "fma"), else fp32."""
        if self.format is not None and self.format.matrix_engine and kernels.gemm_engine() != "fma":
            return torch.bfloat16
        return torch.float32

    def fused_decode_blocker(self, switches: Switches, cache: KVCache) -> str | None:
        """Why a decode step with these switches over this cache runs the Python path, or
        None when the fused C++ step (switches.step == "fused") runs it."""
        if switches.step != "fused":
            return f"step={switches.step!r} was asked for"
        if not attention_backend(switches.attention).decode_kernel:
            return f"attention {switches.attention!r} decodes in PyTorch, not with our kernel"
        if type(cache) is not KVCache:
            return f"kv_cache {switches.kv_cache!r} runs on the torch reference path"
        if self.parallel is not None and self.collective is None:  # the step would skip the all-reduces
            return "tensor parallel without a collective for the fused step (model.collective)"
        return None

    def _fused_stack(self, cache: KVCache):
        stack = self._stacks.get(cache)
        if stack is None:
            group, q_offset = self.head_map or (0, 0)
            stack = kernels.decode_stack(self.layers, cache.per_layer, heads=self.n_heads, eps=self.cfg.norm_eps,
                                         int8_kernel=cache.kernel, group=group, q_offset=q_offset,
                                         kv_handoff=self.kv_handoff, scale=self.cfg.softmax_scale,
                                         rotary=self.cfg.rope_dims, activation=self.cfg.spec.activation,
                                         windows=cache.rings)
            self._stacks[cache] = stack
        return stack

    def decode(self, tokens: torch.Tensor, cache: KVCache, switches: Switches,
               record: bool = False) -> tuple[torch.Tensor, StepRecord | None]:
        """tokens [B], one per sequence, at positions cache.lengths -> logits [B, vocab].
        The layers run in one fused C++ call where fused_decode_blocker allows, else here."""
        clock = self._clock(record)
        t_start = clock.t()
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.cfg.head_dim
        backend = attention_backend(switches.attention)
        positions = cache.lengths.clone()
        if int(positions.max()) >= cache.max_len:
            raise ValueError(f"the KV cache is full ({cache.max_len} tokens); generate fewer tokens or "
                             f"allocate a longer cache")
        lengths = positions + 1
        tables = self._tables(positions)  # [B, rotary] rows of each RoPE table
        scale, eps = self.cfg.softmax_scale, self.cfg.norm_eps

        def attend(i: int, layer: Layer, h: torch.Tensor) -> torch.Tensor:
            q, k, v = layer.qkv(h, *tables[layer.rope], eps)
            cache.append(i, k.reshape(-1, Hkv, 1, D), v.reshape(-1, Hkv, 1, D), positions)  # [B, Hkv, 1, D]
            attn = backend.decode(q.reshape(-1, H, D).contiguous(), cache, i, lengths, scale)
            return attn.reshape(-1, H * D)

        x = self._embed(tokens)  # [B, dim]
        t_layers = clock.t()
        fused = self.fused_decode_blocker(switches, cache) is None
        if fused:
            parts = kernels.constants()["timer_parts"]  # the C++ timers' columns, by name
            timers = torch.zeros(len(self.layers), len(parts), dtype=torch.float64) if record else None
            # x updated in place; with a collective, the all-reduces run inside the same call
            local = tables[1] if len(tables) > 1 else (None, None)
            stack = self._fused_stack(cache)
            wake_s = stack.step(x, *tables[0], positions, timers, self.collective, *local)
            if self.layers[0].router is not None:  # which experts each layer's step ran (what it read)
                routed = stack.expert_hits  # [layers, experts]: tokens routed to each
                for layer, row, hits in zip(self.layers, routed, routed.tolist()):
                    layer.last_experts = [e for e, hit in enumerate(hits) if hit]
                    layer.last_load = hits
                    layer.expert_load += row
            if record:
                for i, row in enumerate(timers.tolist()):
                    for part, seconds in zip(parts, row):
                        clock.add(part, i, seconds)
        else:
            wake_s = kernels.native.ext.wake_threads() if record else 0.0  # as the fused step does, apart
            x = self._layers(x, attend, clock)
        layers_s = clock.t() - t_layers - wake_s
        logits = self._head(x)
        cache.lengths = lengths
        # the fused step's all-reduces: two of [B, dim] fp32 a layer (the Python path's are logged)
        step_comm = 2 * len(self.layers) * x.numel() * x.element_size() if fused and self.collective is not None else 0
        return logits, self._record(clock, "decode", int(tokens.numel()), t_start, layers_s,
                                    [cache.bytes_read(lengths, i) for i in range(len(self.layers))] if record else 0,
                                    self._decode_pairs(lengths), logits.shape[0],
                                    wake_s, "fused" if fused else "reference", step_comm)

    def _decode_pairs(self, lengths: torch.Tensor) -> int:
        """(query, key) pairs of a decode step over the layers' mean: each sequence's new token
        against its lengths[b] keys, or a windowed layer's last `window`."""
        per_layer = [int((lengths.clamp(max=layer.window) if layer.window else lengths).sum()) for layer in self.layers]
        return round(sum(per_layer) / len(per_layer))
