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


def shaped_gguf(preset: str = "llama2-7b", layers: int = 8, kind: str = "Q4_K_M", seed: int = 0,
                dense_twin: bool = False) -> Path:
    """The cached GGUF with `preset`'s layer shapes, `layers` layers and the bundled tokenizer,
    in `kind` (F16, or a llama.cpp file type it quantizes to: needs llama-cpp-python). With
    dense_twin, a mixture's dense twin (workbench.model.arch.dense_twin) instead."""
    if kind not in FTYPES:
        raise ValueError(f"kind must be one of {', '.join(FTYPES)}, got {kind!r}")
    folder = cache_dir() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{preset}-dense-twin" if dense_twin else preset
    out = folder / f"{name}-{layers}L-seed{seed}-{kind}.gguf"
    if out.is_file():
        return out
    f16 = folder / f"{name}-{layers}L-seed{seed}-F16.gguf"
    if not f16.is_file():
        _write_f16(preset, layers, seed, f16, dense_twin)
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


def _write_f16(preset: str, layers: int, seed: int, out: Path, dense_twin: bool = False) -> None:
    """A GGUF of the preset's family (general.architecture llama, qwen3moe, ...): the preset's
    shapes, F16 matrices of seeded N(0, 0.02), F32 norms of 1 and an F32 router, the bundled
    model's tokenizer, untied output."""
    import torch

    from workbench.kernels import random_normal
    from workbench.model.config import preset as preset_config
    from workbench.model.gguf_file import read_gguf
    from workbench.model.loaders import bundled_gguf_path

    from workbench.model.arch import dense_twin as twin

    cfg = preset_config(preset).with_layers(layers)
    cfg = twin(cfg) if dense_twin else cfg
    vocab = len(read_gguf(bundled_gguf_path()).fields["tokenizer.ggml.tokens"])
    stream = iter(range(1 << 30))

    def matrix(shape: tuple[int, ...]) -> np.ndarray:
        return random_normal(shape, seed=seed, stream=next(stream), std=0.02).to(torch.float16).numpy()

    def vector(shape: tuple[int, ...]) -> np.ndarray:
        return np.ones(shape, dtype=np.float32)

    def router(shape: tuple[int, ...]) -> np.ndarray:
        return random_normal(shape, seed=seed, stream=next(stream), std=0.02).numpy()

    tensors = {}
    for name, shape in gguf_tensor_shapes(cfg, vocab).items():
        kind = name.split(".")[-2]
        make, dtype = ((vector, np.float32) if len(shape) == 1 else (router, np.float32) if kind == "ffn_gate_inp"
                       else (matrix, np.float16))
        tensors[name] = (shape, dtype, lambda make=make, shape=shape: make(shape))
    write_gguf(out, cfg, vocab, tensors, f"{cfg.name} shapes, {layers} layers, random weights (seed {seed})")


def gguf_tensor_shapes(cfg, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a GGUF of cfg's family holds, by its GGUF name, with its numpy shape
    (rows first; a mixture's experts stacked [experts, rows, cols]); the output untied."""
    from workbench.model.arch import gguf_layer_tensors

    spec = cfg.spec
    out = {"token_embd.weight": (vocab, cfg.dim), "output_norm.weight": (cfg.dim,), "output.weight": (vocab, cfg.dim)}
    for i in range(cfg.n_layers):
        for ours, shape in gguf_layer_tensors(spec, cfg).items():
            out[f"blk.{i}.{spec.gguf_name(ours)}"] = shape
    return out


def write_gguf(out: Path, cfg, vocab: int, tensors: dict, title: str) -> None:
    """A GGUF file of ModelConfig cfg's family with the bundled model's tokenizer: the metadata
    llama.cpp reads for the family, and `tensors` (GGUF name -> (numpy shape, numpy dtype, a
    callable that makes the data)) written one at a time after the header, so a model larger
    than memory is never in memory at once."""
    import gguf

    from workbench.model.gguf_file import read_gguf
    from workbench.model.loaders import bundled_gguf_path

    src = read_gguf(bundled_gguf_path())
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, cfg.spec.gguf)
    writer.add_name(title)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
    writer.add_vocab_size(vocab)
    if cfg.n_experts:
        writer.add_expert_count(cfg.n_experts)
        writer.add_expert_used_count(cfg.experts_per_token)
        if cfg.spec.gguf != "llama":  # llama.cpp's llama (Mixtral) reads feed_forward_length
            writer.add_expert_feed_forward_length(cfg.ffn_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, value in src.fields.items():
        if name.startswith("tokenizer."):
            vtype, sub = src.types[name]
            writer.add_key_value(name, value, gguf.GGUFValueType(vtype),
                                 sub_type=gguf.GGUFValueType(sub) if sub is not None else None)
    for name, (shape, dtype, _) in tensors.items():
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape, dtype, make in tensors.values():
        data = make()
        if data.shape != tuple(shape) or data.dtype != np.dtype(dtype):
            raise ValueError(f"write_gguf: a tensor made {data.shape} {data.dtype}, its info says {shape} {dtype}")
        writer.write_tensor_data(data)
    writer.close()
    tmp.rename(out)
