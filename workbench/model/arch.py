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
                 norm_offset=1.0, activation="gelu_tanh", embed_scale=True, windows="layer_types"),
    Architecture("phi3", "Phi-3 / Phi-4-mini: fused qkv and gate_up projections, partial rotary dims",
                 ("phi3",), "phi3", fused_qkv=True, fused_gate_up=True, windows="all"),
)}

ACTIVATIONS = ("silu", "gelu_tanh")


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {name!r}") from None


def by_hf_type(model_type: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if model_type in a.hf_types), None)


def by_gguf(arch: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if a.gguf == arch), None)


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
        pattern = pattern or 6
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types[:n_layers])


def default_attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
