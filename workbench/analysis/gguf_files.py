"""GGUF files with a preset's exact layer shapes and random weights, in the formats users
download, for the benchmarks: an F16 file written here, then quantized by llama.cpp's own
quantizer (llama-cpp-python's llama_model_quantize), exactly as users' Q4_K_M / Q4_0 / Q8_0
files are made.

    path = shaped_gguf("llama2-7b", layers=8, kind="Q4_K_M")   # cached under the workbench cache

The tokenizer (and its vocabulary size) is the bundled model's; the weights are seeded normal
values of std 0.02 (norms 1). The F16 file is the source of every quantized one and is kept
beside them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from workbench.cache import cache_dir

# llama.cpp's file types (llama.h: enum llama_ftype), by the names users know them by.
FTYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_S": 14, "Q4_K_M": 15,
          "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}


def shaped_gguf(preset: str = "llama2-7b", layers: int = 8, kind: str = "Q4_K_M", seed: int = 0) -> Path:
    """The cached GGUF with `preset`'s layer shapes, `layers` layers and the bundled tokenizer,
    in `kind` (F16, or a llama.cpp file type it quantizes to: needs llama-cpp-python)."""
    if kind not in FTYPES:
        raise ValueError(f"kind must be one of {', '.join(FTYPES)}, got {kind!r}")
    folder = cache_dir() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{preset}-{layers}L-seed{seed}-{kind}.gguf"
    if out.is_file():
        return out
    f16 = folder / f"{preset}-{layers}L-seed{seed}-F16.gguf"
    if not f16.is_file():
        _write_f16(preset, layers, seed, f16)
    if kind == "F16":
        return f16
    try:
        import llama_cpp
    except ImportError:
        raise RuntimeError("quantizing with llama.cpp's quantizer needs llama-cpp-python: "
                           "pip install -e '.[peers]' (compiles llama.cpp: minutes on 2 cores)") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = 2
    tmp = out.with_suffix(".tmp")
    status = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params))
    if status != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({f16.name} -> {kind}) returned {status}")
    tmp.rename(out)
    return out


def _write_f16(preset: str, layers: int, seed: int, out: Path) -> None:
    """A llama-architecture GGUF: the preset's shapes, F16 matrices of seeded N(0, 0.02), F32
    norms of 1, the bundled model's tokenizer, untied output."""
    import gguf
    import torch

    from workbench.kernels import random_normal
    from workbench.model.config import preset as preset_config
    from workbench.model.gguf_file import read_gguf
    from workbench.model.loaders import bundled_gguf_path

    cfg = preset_config(preset).with_layers(layers)
    src = read_gguf(bundled_gguf_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"])
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"{preset} shapes, {layers} layers, random weights (seed {seed})")
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, value in src.fields.items():
        if name.startswith("tokenizer."):
            vtype, sub = src.types[name]
            writer.add_key_value(name, value, gguf.GGUFValueType(vtype),
                                 sub_type=gguf.GGUFValueType(sub) if sub is not None else None)
    stream = iter(range(1 << 30))

    def matrix(rows: int, cols: int) -> np.ndarray:
        return random_normal((rows, cols), seed=seed, stream=next(stream), std=0.02).to(torch.float16).numpy()

    ones = np.ones(cfg.dim, dtype=np.float32)
    tensors = {"token_embd.weight": lambda: matrix(vocab, cfg.dim), "output_norm.weight": lambda: ones,
               "output.weight": lambda: matrix(vocab, cfg.dim)}
    for i in range(layers):
        tensors.update({
            f"blk.{i}.attn_norm.weight": lambda: ones, f"blk.{i}.ffn_norm.weight": lambda: ones,
            **{f"blk.{i}.{kind}.weight": (lambda kind=kind: matrix(*_shape_of(f"blk.0.{kind}.weight", cfg, vocab)))
               for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
        })
    # Header first, then each tensor's data made and written in turn: a 7B model is never in
    # memory at once.
    for name in tensors:
        writer.add_tensor_info(name, _shape_of(name, cfg, vocab), np.dtype(np.float32 if "norm" in name else np.float16),
                               _nbytes(name, cfg, vocab))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for make in tensors.values():
        writer.write_tensor_data(make())
    writer.close()
    tmp.rename(out)


def _shape_of(name: str, cfg, vocab: int) -> tuple[int, ...]:
    """numpy shape of a tensor of the shaped file."""
    hd = cfg.head_dim
    if "norm" in name:
        return (cfg.dim,)
    if name in ("token_embd.weight", "output.weight"):
        return (vocab, cfg.dim)
    kind = name.split(".")[2]
    return {"attn_q": (cfg.n_heads * hd, cfg.dim), "attn_k": (cfg.n_kv_heads * hd, cfg.dim),
            "attn_v": (cfg.n_kv_heads * hd, cfg.dim), "attn_output": (cfg.dim, cfg.n_heads * hd),
            "ffn_gate": (cfg.ffn_dim, cfg.dim), "ffn_up": (cfg.ffn_dim, cfg.dim),
            "ffn_down": (cfg.dim, cfg.ffn_dim)}[kind]


def _nbytes(name: str, cfg, vocab: int) -> int:
    return int(np.prod(_shape_of(name, cfg, vocab))) * (4 if "norm" in name else 2)
