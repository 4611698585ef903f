"""Weight formats of the linear layers: what `dtype=` / `--dtype` accept, one record each
(like the KV formats' KV_FORMATS). Norm weights stay fp32 whatever the format.

    WEIGHT_FORMATS   name -> WeightFormat: how the linear layers' weights are stored (dtype,
                     scales and their group), what the loaders build them in, what the
                     embedding table is kept in, which kernel enumerator reads them, and the
                     bytes a [rows, cols] matrix takes with its scales.

Everything that counts or dispatches on a weight format (the model, the cost model, the
loaders' memory estimate, the prefetch probe, the fused step) reads it from here. The group
size of grouped int8 is the kernels' own constant (kernels.h kWeightGroup), read from the
extension, not written again here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP32_BYTES = 4


@dataclass(frozen=True)
class WeightFormat:
    name: str
    storage: torch.dtype   # the linear layers' weights as the kernels read them
    source: torch.dtype    # what the loaders build them in (int8: quantized when the layer is built)
    scales: str            # "none", "row" (one fp32 scale per output row) or "group" (per weight_group of a row)
    kernel: str            # the C++ WeightDtype enumerator that reads them (kernels.constants()["weight_kernels"])
    prefetch: str          # the matrix-vector kernel's prefetch table entry for them (workbench.kernels.prefetch)
    description: str
    # Products of more than a few rows (prefill, batched decode) run on the bf16 engine in force
    # (kernels.gemm_engine_for(kernel): AMX tiles or AVX512-BF16, activations rounded to bf16 at
    # each product, fp32 accumulation), and so does prefill attention; "fma" keeps them in fp32.
    matrix_engine: bool = False

    @property
    def quantized(self) -> bool:
        return self.scales != "none"

    @property
    def group(self) -> int | None:
        """Weights per scale along a row for grouped formats, else None."""
        if self.scales != "group":
            return None
        from workbench.kernels import constants

        return constants()["weight_group"]

    def source_dtype(self, random: bool = False) -> torch.dtype:
        """The dtype a loader builds the weights in: random presets of a quantized format are
        made in bf16, so a 7B model never exists in fp32."""
        return torch.bfloat16 if random and self.quantized else self.source

    def embedding_dtype(self, random: bool = False) -> torch.dtype:
        """The embedding table's storage: its rows are gathered, not multiplied, so it stays in
        the source dtype (a quantized format's embedding is not quantized)."""
        return self.source_dtype(random)

    def scale_count(self, rows: int, cols: int) -> int:
        if self.scales == "row":
            return rows
        if self.scales == "group":
            return rows * -(-cols // self.group)
        return 0

    def nbytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] weight matrix in this format, scales included."""
        return rows * cols * self.storage.itemsize + FP32_BYTES * self.scale_count(rows, cols)


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("fp32", torch.float32, torch.float32, "none", "float32", "float32", "fp32 weights, the exact path"),
    WeightFormat("bf16", torch.bfloat16, torch.bfloat16, "none", "bfloat16", "bfloat16",
                 "bf16 weights: products and prefill attention on the bf16 engine (AMX or AVX512-BF16) where "
                 "the CPU has one, decode's matrix-vector kernel widening them to fp32", matrix_engine=True),
    WeightFormat("int8", torch.int8, torch.float32, "row", "int8", "int8",
                 "weight-only int8, one fp32 scale per output row; products on the bf16 engine (the int8 "
                 "values converted to bf16, exactly) where the CPU has one", matrix_engine=True),
    WeightFormat("int8-g32", torch.int8, torch.float32, "group", "int8_group", "int8",
                 "weight-only int8, one fp32 scale per 32 weights of a row (llama.cpp's Q8_0 granularity); "
                 "products on the bf16 engine (each value times its scale, rounded to bf16) where the CPU has "
                 "one", matrix_engine=True),
)}


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_FORMATS)}, got {name!r}") from None
