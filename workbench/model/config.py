"""Model configurations: one dataclass, and the exact public configurations as presets.

The presets are the single source of truth for shapes: random-weight models for speed
work (`load_model("llama2-7b", random=True)`) are built from them, and the loaders check
real files against the fields they share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # SwiGLU intermediate size
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF-style: {"rope_type": "linear" | "llama3", "factor": ...}
    max_seq_len: int = 4096
    tied_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # Explicit, not dim // n_heads: some models (and every tensor-parallel shard) have
    # n_heads * head_dim != dim. None means dim // n_heads, the Llama default.
    head_dim: int | None = None
    # The family (workbench.model.arch.ARCHITECTURES) and its per-model numbers:
    arch: str = "llama"
    attn_scale: float | None = None    # softmax scale of q . k; None: 1 / sqrt(head_dim)
    rotary_dim: int | None = None      # dims of each head RoPE rotates (the first ones); None: all
    windows: tuple[int, ...] | None = None  # each layer's sliding window, 0 for none; None: none at all
    rope_local_theta: float | None = None  # RoPE base of the windowed layers (Gemma 3); None: rope_theta
    # A mixture of experts (the family's record says how it routes): experts a layer, routed
    # a token, and whether the chosen ones' weights are renormalized; ffn_dim is each expert's
    n_experts: int = 0
    experts_per_token: int = 0
    norm_topk: bool = True

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.windows is not None:
            object.__setattr__(self, "windows", tuple(int(w) for w in self.windows))
            if len(self.windows) != self.n_layers:
                raise ValueError(f"{self.name}: windows has {len(self.windows)} entries for {self.n_layers} layers")
            if not any(self.windows):
                object.__setattr__(self, "windows", None)
        rd = self.rotary_dim
        if rd is not None and (rd <= 0 or rd > self.head_dim or rd % 2):
            raise ValueError(f"{self.name}: rotary_dim must be an even number in 1..head_dim ({self.head_dim}), got {rd}")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"{self.name}: experts_per_token must be in 1..n_experts ({self.n_experts}), "
                             f"got {self.experts_per_token}")

    @property
    def spec(self):
        """The family's record (workbench.model.arch.Architecture)."""
        from workbench.model.arch import architecture

        return architecture(self.arch)

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def rope_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to every earlier token)."""
        return self.windows[layer] if self.windows else 0

    def with_layers(self, n_layers: int) -> ModelConfig:
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"layers must be in [1, {self.n_layers}] for {self.name}, got {n_layers}")
        return replace(self, n_layers=n_layers, windows=self.windows[:n_layers] if self.windows else None)

    def layer_vectors(self) -> int:
        """Values of a layer outside its matrices (fp32 whatever the format): its norms, the
        per-head q / k norms and the q / k / v biases its family has."""
        spec, hd = self.spec, self.head_dim
        norms = (4 if spec.post_norms else 2) * self.dim
        qk = 2 * hd if spec.qk_norm else 0
        bias = (self.n_heads + 2 * self.n_kv_heads) * hd if spec.qkv_bias else 0
        return norms + qk + bias

    def parameter_count(self) -> int:
        d, f, hd = self.dim, self.ffn_dim, self.head_dim
        attn = d * (self.n_heads * hd) * 2 + d * (self.n_kv_heads * hd) * 2
        mlp = (self.n_experts * 3 * d * f + self.n_experts * d) if self.n_experts else 3 * d * f
        layer = attn + mlp + self.layer_vectors()
        head = 0 if self.tied_embeddings else self.vocab_size * d
        return self.n_layers * layer + self.vocab_size * d + head + d

    def linear_shapes(self) -> list[tuple[int, int]]:
        """[out, in] of every matrix multiplied in a forward pass: each layer's q, k, v, o,
        gate, up, down, then the LM head (the embedding itself when tied)."""
        d, f, hd = self.dim, self.ffn_dim, self.head_dim
        layer = [(self.n_heads * hd, d), (self.n_kv_heads * hd, d), (self.n_kv_heads * hd, d), (d, self.n_heads * hd)]
        if self.n_experts:  # the router (kept fp32: counted as the format's here) and every expert
            layer += [(self.n_experts, d)] + [(f, d), (f, d), (d, f)] * self.n_experts
        else:
            layer += [(f, d), (f, d), (d, f)]
        return layer * self.n_layers + [(self.vocab_size, d)]

    def weight_bytes(self, fmt) -> int:
        """Bytes of every weight in weight format `fmt` (workbench.model.weights.WeightFormat):
        the linear layers with their scales, the norms in fp32, and the embedding table in the
        format's embedding dtype when it is not the LM head itself (untied, or quantized)."""
        norms = (self.n_layers * self.layer_vectors() + self.dim) * 4
        linear = sum(fmt.nbytes(n, k) for n, k in self.linear_shapes())
        # tied: the table is the LM head's own rows, unless int8 weights made the head a copy
        shares_head = self.tied_embeddings and (not fmt.quantized or fmt.blocks)
        embedding = 0 if shares_head else fmt.embedding_bytes(self.vocab_size, self.dim)
        return linear + norms + embedding

    def as_dict(self) -> dict:
        return asdict(self)


# Public configurations (the models' config.json files), by the names users type.
PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig("llama2-7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                             vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
    "llama2-13b": ModelConfig("llama2-13b", dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                              vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
    "llama2-70b": ModelConfig("llama2-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096),
    "tinyllama-1.1b": ModelConfig("tinyllama-1.1b", dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                                  ffn_dim=5632, vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0,
                                  max_seq_len=2048),
    "smollm2-135m": ModelConfig("smollm2-135m", dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                                vocab_size=49152, norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192,
                                tied_embeddings=True, bos_token_id=1, eos_token_id=2),
    # The families beyond Llama (workbench.model.arch), as their config.json files set them.
    "llama3.2-1b": ModelConfig("llama3.2-1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                               vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072,
                               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                               tied_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "qwen2.5-0.5b": ModelConfig("qwen2.5-0.5b", dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864,
                                vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
                                tied_embeddings=True, bos_token_id=151643, eos_token_id=151645, arch="qwen2"),
    "qwen3-0.6b": ModelConfig("qwen3-0.6b", dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072,
                              vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                              tied_embeddings=True, bos_token_id=151643, eos_token_id=151645, head_dim=128,
                              arch="qwen3"),
    "gemma3-270m": ModelConfig("gemma3-270m", dim=640, n_layers=18, n_heads=4, n_kv_heads=1, ffn_dim=2048,
                               vocab_size=262144, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
                               tied_embeddings=True, bos_token_id=2, eos_token_id=1, head_dim=256, arch="gemma3",
                               windows=tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18)),
                               rope_local_theta=10000.0),
    # Mixtures of experts: ffn_dim is each expert's FFN
    "mixtral-8x7b": ModelConfig("mixtral-8x7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                vocab_size=32000, norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768,
                                bos_token_id=1, eos_token_id=2, arch="mixtral", n_experts=8, experts_per_token=2),
    "qwen3-30b-a3b": ModelConfig("qwen3-30b-a3b", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=768,
                                 vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                                 bos_token_id=151643, eos_token_id=151645, head_dim=128, arch="qwen3_moe",
                                 n_experts=128, experts_per_token=8, norm_topk=True),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
