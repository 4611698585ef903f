"""Quantized GGUF files made by our own quantizer (kernels.quantize_blocks), no llama.cpp needed:
a GGUF file's matrices requantized with the mix of block types a llama.cpp file type uses.

    write_quantized(source, out, "Q4_K_M")     # workbench quantize source.gguf out.gguf --type Q4_K_M

MIXES holds each file type as data (QuantMix): the block type of most matrices, the wider one
llama.cpp gives attn_v and ffn_down in the layers it picks (use_more_bits), and the LM head's
(the embedding's, when it is the LM head). A matrix whose rows are not whole blocks takes the
format's fallback (WeightFormat.for_cols), as llama.cpp's quantizer does; norms and other 1-D
tensors stay F32. The files read back in llama.cpp and in the workbench alike (the blocks of 32
are byte for byte what gguf's reference quantizers write; the K-quants are our own least-squares
search, llama.cpp's format).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class QuantMix:
    name: str
    default: str                  # a WEIGHT_FORMATS name: most matrices
    more_bits: str | None = None  # attn_v and ffn_down of the layers use_more_bits picks (None: default)
    output: str | None = None     # the LM head, and the embedding when it is the LM head (None: default)
    file_type: int = 0            # llama.cpp's llama_ftype, written as general.file_type


MIXES: dict[str, QuantMix] = {m.name: m for m in (
    QuantMix("Q4_0", "q4_0", output="q6_k", file_type=2),
    QuantMix("Q4_1", "q4_1", output="q6_k", file_type=3),
    QuantMix("Q8_0", "q8_0", file_type=7),
    QuantMix("Q5_0", "q5_0", output="q6_k", file_type=8),
    QuantMix("Q5_1", "q5_1", output="q6_k", file_type=9),
    QuantMix("Q4_K_S", "q4_k", output="q6_k", file_type=14),
    QuantMix("Q4_K_M", "q4_k", more_bits="q6_k", output="q6_k", file_type=15),
    QuantMix("Q5_K_S", "q5_k", output="q6_k", file_type=16),
    QuantMix("Q5_K_M", "q5_k", more_bits="q6_k", output="q6_k", file_type=17),
    QuantMix("Q6_K", "q6_k", output="q6_k", file_type=18),
)}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits: the first and
    last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_format(mix: QuantMix, name: str, cols: int, layers: int, tied: bool):
    """The WeightFormat `mix` gives the matrix `name` (GGUF's tensor name) of rows of `cols`."""
    from workbench.model.weights import weight_format

    kind = mix.default
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        kind = mix.output or mix.default
    elif mix.more_bits and name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down", "ffn_down_exps"):
        if use_more_bits(int(name.split(".")[1]), layers):
            kind = mix.more_bits
    return weight_format(kind).for_cols(cols)


def write_quantized(source: str | Path, out: str | Path, mix_name: str = "Q4_K_M") -> Path:
    """`source` (any GGUF the workbench reads: F32, F16 or quantized) requantized into `out`
    with the mix `mix_name` (MIXES), one tensor at a time. Returns out."""
    import gguf

    from workbench import kernels
    from workbench.model.gguf_file import dequantize, read_gguf

    mix = MIXES.get(mix_name)
    if mix is None:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, got {mix_name!r}")
    source, out = Path(source), Path(out)
    src = read_gguf(source)
    arch = src.fields["general.architecture"]
    layers = int(src.fields.get(f"{arch}.block_count", 0))
    tied = "output.weight" not in src.tensors
    tmp = out.with_suffix(out.suffix + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for name, value in src.fields.items():
        if name == gguf.Keys.General.ARCHITECTURE:
            continue  # GGUFWriter writes it
        if name == gguf.Keys.General.FILE_TYPE:
            continue
        vtype, sub = src.types[name]
        writer.add_key_value(name, value, gguf.GGUFValueType(vtype),
                             sub_type=gguf.GGUFValueType(sub) if sub is not None else None)
    writer.add_file_type(mix.file_type)

    def converted(t):
        """(the tensor's data as the file will hold it, its GGML type or None for float); a
        mixture's stacked experts [experts, rows, cols] as the rows of each expert in turn."""
        values = dequantize(t)
        if values.ndim < 2 or t.name.endswith("ffn_gate_inp.weight"):  # llama.cpp keeps the router F32
            return values.astype(np.float32), None
        cols = values.shape[-1]
        fmt = tensor_format(mix, t.name, cols, layers, tied)
        flat = np.ascontiguousarray(values.reshape(-1, cols), dtype=np.float32)
        blocks = kernels.quantize_blocks(torch.from_numpy(flat), fmt.kernel, search=fmt.search)
        return blocks.numpy().reshape(*values.shape[:-1], -1), gguf.GGMLQuantizationType[fmt.gguf_type]

    # the tensor infos first (their bytes from the formats), then each tensor made and written
    # in turn: the model is never in memory at once
    plans = []
    for t in src.tensors.values():
        shape = tuple(reversed(t.shape))
        if len(shape) >= 2 and not t.name.endswith("ffn_gate_inp.weight"):
            fmt = tensor_format(mix, t.name, shape[-1], layers, tied)
            qtype = gguf.GGMLQuantizationType[fmt.gguf_type]
            row = fmt.row_bytes(shape[-1])
            nbytes = int(np.prod(shape[:-1])) * row
            writer.add_tensor_info(t.name, (*shape[:-1], row), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        else:
            writer.add_tensor_info(t.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        plans.append(t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in plans:
        data, _ = converted(t)
        writer.write_tensor_data(data)
        src.release(t)
    writer.close()
    tmp.rename(out)
    return out
