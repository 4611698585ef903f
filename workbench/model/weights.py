"""Weight dtypes of the linear layers and embeddings: what `dtype=` / `--dtype` accept.
Norm weights stay fp32 whatever the dtype.

    WEIGHT_DTYPES   name -> the dtype the linear layers' weights are stored in
    SOURCE_DTYPES   name -> the dtype the loaders produce them in: the same, except int8
                    (one scale per output row) and int8-g32 (one per 32 weights, llama.cpp's
                    Q8_0 granularity), loaded in fp32 and quantized when the layer is
                    built (workbench.kernels.quantize_weight_int8; random presets in bf16,
                    so a 7B model never exists in fp32). The embedding table stays in the
                    source dtype (its rows are gathered, not multiplied)."""

from __future__ import annotations

import torch

WEIGHT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                                         "int8-g32": torch.int8}
SOURCE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32,
                                         "int8-g32": torch.float32}
INT8_GROUPS = {"int8": None, "int8-g32": 32}  # scales: one per output row, or one per 32 weights of a row


def weight_dtype(name: str) -> torch.dtype:
    try:
        return WEIGHT_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {name!r}") from None


def source_dtype(name: str, random: bool = False) -> torch.dtype:
    """The dtype a loader builds weights of `name` in (see the module docstring)."""
    weight_dtype(name)
    return torch.bfloat16 if random and name in INT8_GROUPS else SOURCE_DTYPES[name]
