"""Model families: one record per family (like WEIGHT_FORMATS and KV_FORMATS), holding how the
family's decoder differs from Llama's as data that the loaders, the Python reference path, the
fused C++ step, the cost model and the reports read. A family that needs a branch somewhere
else is a missing field here.

    ARCHITECTURES   name -> Architecture
    from_hf(cfg)    the record and the ModelConfig fields a Hugging Face config.json sets
    gguf_arch(a)    the record of a GGUF file's general.architecture

What a record says (the per-model numbers, a window's length or a head's rotary dims, are
ModelConfig fields, read from each checkpoint's config):

    qkv_bias        q, k and v have biases (Qwen2)
    qk_norm         an RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)
    post_norms      RMSNorm on the attention's and the MLP's outputs before the residual add
                    (Gemma 3: four norms a layer)
    norm_offset     the checkpoint's RMSNorm weights w are applied as (offset + w) (Gemma:
                    1 + w); the Hugging Face loader adds it once at load (llama.cpp's converter
                    already did in a GGUF)
    activation      the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale     the embedding rows are multiplied by sqrt(hidden) (Gemma)
    gguf_rope_rows  llama.cpp stores q / k rows interleaved for its RoPE (the llama family
                    only): the GGUF loader puts them back in rotate-half order
    fused_qkv / fused_gate_up   the checkpoint holds [q; k; v] / [gate; up] as one matrix
                    (Phi-3): the loaders split them
    windows         which layers attend through a sliding window: "none", "all" (Mistral), or
                    "layer_types" (Gemma 3: the config's per-layer types, local layers with
                    their own RoPE base)
    window_pattern / local_rope_theta   Gemma 3's defaults where a GGUF file does not say:
                    every 6th layer global, the local layers' RoPE base 10,000 (llama.cpp's)
    hf_names / gguf_names   where the family's checkpoints name a layer's tensor differently
                    from HF_LAYER_NAMES / GGUF_LAYER_NAMES (Gemma 3's norms, Phi-3's fused ones)
    moe             a mixture of experts in place of the MLP: "" (dense), "renormalize" (Mixtral:
                    softmax over the router's logits, the top k weights renormalized to sum to
                    1) or "config" (Qwen3-MoE: renormalized where the config's norm_topk_prob
                    says); the router is "router" [experts, dim] and expert e's matrices are
                    "experts.{e}.w_gate", "experts.{e}.w_up", "experts.{e}.w_down" (names
                    templated by "experts.w_gate" ... in hf_names, with {e} the expert). A GGUF
                    file stacks each kind of every expert in one 3-D tensor (ffn_gate_exps:
                    [experts, ffn, dim]) that the loader splits by expert; llama.cpp writes
                    Mixtral as general.architecture "llama" with an expert_count, so a GGUF
                    family is found by its name and whether it has experts (by_gguf)
    dense           a mixture's dense family of the same attention (Qwen3-MoE: Qwen3): its
                    dense twin (dense_twin) has an MLP of top_k experts' width, the same
                    parameters a token reads, for comparing the two at equal active size

A layer's tensors have one set of names inside the workbench (the keys of a loader's dict,
which workbench.model.llama.Layer reads): attn_norm, mlp_norm, wq, wk, wv, wo, w_gate, w_up,
w_down, and by family bq, bk, bv, q_norm, k_norm, post_attn_norm, post_mlp_norm; a fused
checkpoint's wqkv and w_gate_up are split into them at load. layer_tensors(spec, cfg) lists
the ones a family's layer must have, with their shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    description: str
    hf_types: tuple[str, ...]   # config.json model_type values
    gguf: str | None            # general.architecture in a GGUF
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    norm_offset: float = 0.0
    activation: str = "silu"
    embed_scale: bool = False
    gguf_rope_rows: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    windows: str = "none"
    window_pattern: int = 0
    local_rope_theta: float | None = None
    hf_names: tuple[tuple[str, str], ...] = ()
    gguf_names: tuple[tuple[str, str], ...] = ()
    moe: str = ""
    dense: str = ""

    def hf_name(self, ours: str) -> str:
        """A layer tensor's name in a Hugging Face checkpoint, after model.layers.{i}."""
        if ours.startswith("experts."):  # experts.{e}.w_gate: the family's template for expert e
            _, e, base = ours.split(".")
            return dict(self.hf_names)[f"experts.{base}"].format(e=e)
        names = dict(self.hf_names)
        return names[ours] if ours in names else HF_LAYER_NAMES[ours]

    def gguf_name(self, ours: str) -> str:
        """... and in a GGUF file, after blk.{i} (an expert's matrix: the stacked tensor of
        every expert's, "experts.{e}.w_gate" -> "ffn_gate_exps.weight")."""
        if ours.startswith("experts."):
            ours = "experts." + ours.split(".")[-1]
        return dict(self.gguf_names).get(ours, GGUF_LAYER_NAMES[ours])


# A layer's tensors in each checkpoint format, by the workbench's names (Llama's, and what the
# families add where they add it).
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "wqkv": "self_attn.qkv_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "post_attn_norm": "post_attention_layernorm.weight", "post_mlp_norm": "post_feedforward_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "w_gate_up": "mlp.gate_up_proj.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
    "wqkv": "attn_qkv.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "w_gate_up": "ffn_up.weight",  # Phi-3's [gate; up] is one ffn_up of 2 x ffn rows
    # a mixture's router, and every expert's matrices of a kind stacked in one 3-D tensor
    "router": "ffn_gate_inp.weight", "experts.w_gate": "ffn_gate_exps.weight",
    "experts.w_up": "ffn_up_exps.weight", "experts.w_down": "ffn_down_exps.weight",
}
# The pieces a fused checkpoint tensor is split into, in its row order.
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "Llama 2 / 3, SmolLM, TinyLlama: RMSNorm before attention and MLP, SwiGLU",
                 ("llama",), "llama", gguf_rope_rows=True),
    Architecture("mistral", "Mistral: Llama's decoder, every layer through a sliding window when the config "
                 "sets one", ("mistral",), None, windows="all"),
    Architecture("qwen2", "Qwen2 / Qwen2.5: Llama's decoder with biases on q, k and v", ("qwen2",), "qwen2",
                 qkv_bias=True),
    Architecture("qwen3", "Qwen3: an RMSNorm on each head of q and k, no biases", ("qwen3",), "qwen3", qk_norm=True),
    Architecture("gemma3", "Gemma 3: RMSNorm (1 + w) before and after attention and the MLP, on each head of q "
                 "and k; GeGLU; embeddings times sqrt(hidden); five local (sliding-window) layers of every six, "
                 "with their own RoPE base", ("gemma3_text", "gemma3"), "gemma3", qk_norm=True, post_norms=True,
                 norm_offset=1.0, activation="gelu_tanh", embed_scale=True, windows="layer_types",
                 window_pattern=6, local_rope_theta=10000.0,
                 hf_names=(("mlp_norm", "pre_feedforward_layernorm.weight"),
                           ("post_attn_norm", "post_attention_layernorm.weight"))),
    Architecture("phi3", "Phi-3 / Phi-4-mini: fused qkv and gate_up projections, partial rotary dims",
                 ("phi3",), "phi3", fused_qkv=True, fused_gate_up=True, windows="all"),
    Architecture("mixtral", "Mixtral: Mistral's decoder with a mixture of SwiGLU experts in place of the MLP, the "
                 "top k of a softmax router, their weights renormalized", ("mixtral",), "llama", windows="all",
                 moe="renormalize", gguf_rope_rows=True, dense="mistral",
                 hf_names=(("router", "block_sparse_moe.gate.weight"),
                           ("experts.w_gate", "block_sparse_moe.experts.{e}.w1.weight"),
                           ("experts.w_up", "block_sparse_moe.experts.{e}.w3.weight"),
                           ("experts.w_down", "block_sparse_moe.experts.{e}.w2.weight"))),
    Architecture("qwen3_moe", "Qwen3-MoE: Qwen3's attention (per-head q / k norms) with a mixture of SwiGLU experts "
                 "in every layer, the top k of a softmax router (renormalized where the config says)",
                 ("qwen3_moe",), "qwen3moe", qk_norm=True, moe="config", dense="qwen3",
                 hf_names=(("router", "mlp.gate.weight"),
                           ("experts.w_gate", "mlp.experts.{e}.gate_proj.weight"),
                           ("experts.w_up", "mlp.experts.{e}.up_proj.weight"),
                           ("experts.w_down", "mlp.experts.{e}.down_proj.weight"))),
)}

ACTIVATIONS = ("silu", "gelu_tanh")


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {name!r}") from None


def by_hf_type(model_type: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if model_type in a.hf_types), None)


def by_gguf(arch: str, experts: bool = False) -> Architecture | None:
    """The family of a GGUF file's general.architecture, with experts or without (llama.cpp's
    "llama" is Llama, or Mixtral when the file has an expert_count)."""
    return next((a for a in ARCHITECTURES.values() if a.gguf == arch and bool(a.moe) == experts), None)


def layer_tensors(arch: Architecture, cfg) -> dict[str, tuple[int, ...]]:
    """The tensors one layer of family `arch` has, by the workbench's names, with their shapes
    ([out, in] for matrices) for ModelConfig cfg: the fused ones where its checkpoints fuse."""
    d, f, hd = cfg.dim, cfg.ffn_dim, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    out = {"attn_norm": (d,), "mlp_norm": (d,), "wo": (d, q)}
    out.update({"wqkv": (q + 2 * kv, d)} if arch.fused_qkv else {"wq": (q, d), "wk": (kv, d), "wv": (kv, d)})
    if arch.moe:  # f: each expert's FFN
        out["router"] = (cfg.n_experts, d)
        for e in range(cfg.n_experts):
            out.update({f"experts.{e}.w_gate": (f, d), f"experts.{e}.w_up": (f, d), f"experts.{e}.w_down": (d, f)})
    else:
        out["w_down"] = (d, f)
        out.update({"w_gate_up": (2 * f, d)} if arch.fused_gate_up else {"w_gate": (f, d), "w_up": (f, d)})
    if arch.qkv_bias:
        out.update({"bq": (q,), "bk": (kv,), "bv": (kv,)})
    if arch.qk_norm:
        out.update({"q_norm": (hd,), "k_norm": (hd,)})
    if arch.post_norms:
        out.update({"post_attn_norm": (d,), "post_mlp_norm": (d,)})
    return out


def gguf_layer_tensors(arch: Architecture, cfg) -> dict[str, tuple[int, ...]]:
    """layer_tensors as a GGUF file holds them: a mixture's experts' matrices of each kind
    stacked in one [experts, rows, cols] tensor ("experts.w_gate", ...)."""
    out = {k: v for k, v in layer_tensors(arch, cfg).items() if not k.startswith("experts.")}
    if arch.moe:
        d, f, n = cfg.dim, cfg.ffn_dim, cfg.n_experts
        out.update({"experts.w_gate": (n, f, d), "experts.w_up": (n, f, d), "experts.w_down": (n, d, f)})
    return out


def fused_rows(name: str, cfg) -> tuple[int, ...]:
    """Rows of each piece of fused tensor `name` ("wqkv": q, k, v; "w_gate_up": gate, up)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return (q, kv, kv) if name == "wqkv" else (cfg.ffn_dim, cfg.ffn_dim)


def is_norm(name: str) -> bool:
    """Whether a layer tensor is an RMSNorm weight (the ones a family's norm_offset applies to)."""
    return name.endswith("norm")


def dense_twin(cfg):
    """A mixture's ModelConfig as its dense family with one MLP of top_k experts' width: the
    same attention, the same parameters read a token (less the router), every one of them
    read by every token."""
    from dataclasses import replace

    spec = cfg.spec
    if not spec.moe:
        raise ValueError(f"{cfg.name} is not a mixture of experts: it has no dense twin")
    return replace(cfg, name=f"{cfg.name}-dense-twin", arch=spec.dense, ffn_dim=cfg.experts_per_token * cfg.ffn_dim,
                   n_experts=0, experts_per_token=0)


def layer_windows(arch: Architecture, n_layers: int, window: int | None, layer_types=None,
                  pattern: int | None = None) -> tuple[int, ...]:
    """Each layer's sliding window (0: attends to every earlier token): none; every layer
    (Mistral, Phi-3 when the config sets a window); or per the config's layer types (Gemma 3:
    "sliding_attention" / "full_attention", or every `pattern`-th layer global)."""
    if not window or arch.windows == "none":
        return (0,) * n_layers
    if arch.windows == "all":
        return (int(window),) * n_layers
    if layer_types is None:
        pattern = pattern or arch.window_pattern or 6
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types[:n_layers])


def default_attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
