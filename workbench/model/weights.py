"""Weight dtypes of the linear layers and embeddings: what `dtype=` / `--dtype` accept.
Norm weights stay fp32 whatever the dtype."""

from __future__ import annotations

import torch

WEIGHT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def weight_dtype(name: str) -> torch.dtype:
    try:
        return WEIGHT_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {name!r}") from None
