"""Weight formats of the linear layers: what `dtype=` / `--dtype` accept, one record each
(like the KV formats' KV_FORMATS). Norm weights stay fp32 whatever the format.

    WEIGHT_FORMATS   name -> WeightFormat: how the linear layers' weights are stored (dtype,
                     scales and their group, or blocks), what the loaders build them from, what
                     the embedding table is kept in, which kernel reads them, and the bytes a
                     [rows, cols] matrix takes with its scales.
    FILE_FORMATS     a GGUF tensor type's name ("Q4_K") -> its WeightFormat, for the types the
                     kernels read as they are (kernels/blocks.h)
    BlockTensor      a matrix of block-quantized weights: rows of bytes, as the file has them
                     or in the kernels' layout

Block formats are GGUF's block types (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k: read as
a quantized GGUF file holds them, or made by our quantizer at load) and two of ours, quantized
at load (int4-g32: symmetric, a least-squares scale per 32 weights, in Q4_0's blocks; int4-g128:
a scale and zero point per 128, as AWQ / GPTQ checkpoints keep them). A block format's row must
be whole blocks (K-quants: 256 weights); a matrix whose rows are not takes the format's
`fallback`, as llama.cpp's quantizer does (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0).

Everything that counts or dispatches on a weight format (the model, the cost model, the
loaders' memory estimate, the prefetch probe, the fused step) reads it from here. The group
size of grouped int8 and the blocks' bytes are the kernels' own (kernels.h, blocks.h), read
from the extension, not written again here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FP32_BYTES = 4


@dataclass(frozen=True)
class WeightFormat:
    name: str
    storage: torch.dtype   # the linear layers' weights as the kernels read them (uint8: block rows)
    source: torch.dtype    # what the loaders build them in (int8 and blocks: quantized when the layer is built)
    scales: str            # "none", "row" (one fp32 scale per output row), "group" (per weight_group of a row),
                           # or "block" (the scales live in the blocks: kernels/blocks.h)
    kernel: str            # the C++ WeightDtype enumerator that reads them (kernels.constants()["weight_kernels"])
    prefetch: str          # the matrix-vector kernel's prefetch table entry for them (workbench.kernels.prefetch)
    description: str
    # Products of more than a few rows (prefill, batched decode) run on the bf16 engine in force
    # (kernels.gemm_engine_for(kernel): AMX tiles or AVX512-BF16, activations rounded to bf16 at
    # each product, fp32 accumulation), and so does prefill attention; "fma" keeps them in fp32.
    matrix_engine: bool = False
    gguf_type: str | None = None  # the GGUF tensor type of these blocks (None: not a GGUF type)
    fallback: str | None = None   # the format of a matrix whose rows are not whole blocks of this one
    search: bool = False          # our quantizer's least-squares scales (int4-g32) rather than GGUF's rounding
    # What decode's matrix-vector kernel multiplies these weights with: "fp32" activations, or
    # "integer", the activations rounded per 32 values for integer products (block and int8
    # formats, kernels/blocks.cpp): to int16 (the default; relative error at most 1.5e-5 of each
    # 32's largest) or int8 (as llama.cpp does), as kernels.block_activation_bits() says
    decode_activations: str = "fp32"

    @property
    def quantized(self) -> bool:
        return self.scales != "none"

    @property
    def blocks(self) -> bool:
        """Block-quantized (kernels/blocks.h): rows of bytes holding their own scales."""
        return self.scales == "block"

    @property
    def group(self) -> int | None:
        """Weights per scale along a row for grouped formats, else None."""
        if self.scales != "group":
            return None
        from workbench.kernels import constants

        return constants()["weight_group"]

    @property
    def block_geometry(self) -> tuple[int, int]:
        """(weights, bytes) of one block as the kernels define it (a row is whole blocks)."""
        from workbench.kernels import constants

        return tuple(constants()["weight_blocks"][self.kernel])

    @property
    def bits_per_weight(self) -> float:
        """Bits a weight of a long row takes, its scales included (a row's one scale counts as 0)."""
        if self.blocks:
            weights, nbytes = self.block_geometry
            return 8 * nbytes / weights
        bits = 8 * torch.empty((), dtype=self.storage).element_size()
        return bits + (32 / self.group if self.scales == "group" else 0)  # one fp32 scale per group

    def fits(self, cols: int) -> bool:
        """Whether a row of `cols` weights is whole blocks of this format (always, unblocked)."""
        return not self.blocks or cols % self.block_geometry[0] == 0

    def for_cols(self, cols: int) -> WeightFormat:
        """The format a matrix of rows of `cols` weights takes: this one, or its fallback."""
        fmt = self
        while not fmt.fits(cols):
            if fmt.fallback is None:
                raise ValueError(f"{self.name}: rows of {cols} weights are not whole blocks of "
                                 f"{fmt.block_geometry[0]}, and {fmt.name} has no fallback")
            fmt = WEIGHT_FORMATS[fmt.fallback]
        return fmt

    def source_dtype(self, random: bool = False) -> torch.dtype:
        """The dtype a loader builds the weights in: random presets of a quantized format are
        made in bf16, so a 7B model never exists in fp32."""
        return torch.bfloat16 if random and self.quantized else self.source

    def embedding_dtype(self, random: bool = False) -> torch.dtype:
        """The embedding table's storage when it is not in blocks: its rows are gathered, not
        multiplied, so it stays in the source dtype (an int8 format's embedding is not quantized)."""
        return self.source_dtype(random)

    def scale_count(self, rows: int, cols: int) -> int:
        if self.scales == "row":
            return rows
        if self.scales == "group":
            return rows * -(-cols // self.group)
        return 0

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights (blocks: in this format or its fallback)."""
        if self.blocks:
            fmt = self.for_cols(cols)
            weights, nbytes = fmt.block_geometry
            return cols // weights * nbytes
        return cols * self.storage.itemsize

    def nbytes(self, rows: int, cols: int) -> int:
        """Bytes of a [rows, cols] weight matrix in this format, scales included."""
        return rows * self.row_bytes(cols) + FP32_BYTES * self.scale_count(rows, cols)

    def embedding_bytes(self, vocab: int, dim: int) -> int:
        """Bytes of the embedding table: in blocks for a block format, else in embedding_dtype."""
        return self.nbytes(vocab, dim) if self.blocks else vocab * dim * self.embedding_dtype().itemsize


def _block(name: str, kernel: str, description: str, gguf: str | None = None, fallback: str | None = None,
           search: bool = False) -> WeightFormat:
    return WeightFormat(name, torch.uint8, torch.float32, "block", kernel, "blocks", description, gguf_type=gguf,
                        fallback=fallback, search=search, decode_activations="integer")


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("fp32", torch.float32, torch.float32, "none", "float32", "float32", "fp32 weights, the exact path"),
    WeightFormat("bf16", torch.bfloat16, torch.bfloat16, "none", "bfloat16", "bfloat16",
                 "bf16 weights: products and prefill attention on the bf16 engine (AMX or AVX512-BF16) where "
                 "the CPU has one, decode's matrix-vector kernel widening them to fp32", matrix_engine=True),
    WeightFormat("int8", torch.int8, torch.float32, "row", "int8", "int8",
                 "weight-only int8, one fp32 scale per output row; products on the bf16 engine (the int8 "
                 "values converted to bf16, exactly) where the CPU has one", matrix_engine=True,
                 decode_activations="integer"),
    WeightFormat("int8-g32", torch.int8, torch.float32, "group", "int8_group", "int8",
                 "weight-only int8, one fp32 scale per 32 weights of a row (llama.cpp's Q8_0 granularity); "
                 "products on the bf16 engine (each value times its scale, rounded to bf16) where the CPU has "
                 "one", matrix_engine=True, decode_activations="integer"),
    _block("q8_0", "q8_0", "GGUF Q8_0: int8 and an fp16 scale per 32 weights (8.5 bits a weight)", "Q8_0"),
    _block("q4_0", "q4_0", "GGUF Q4_0: 4 bits and an fp16 scale per 32 weights (4.5 bits)", "Q4_0"),
    _block("q4_1", "q4_1", "GGUF Q4_1: 4 bits, an fp16 scale and minimum per 32 weights (5 bits)", "Q4_1"),
    _block("q5_0", "q5_0", "GGUF Q5_0: 5 bits and an fp16 scale per 32 weights (5.5 bits)", "Q5_0"),
    _block("q5_1", "q5_1", "GGUF Q5_1: 5 bits, an fp16 scale and minimum per 32 weights (6 bits)", "Q5_1"),
    _block("q4_k", "q4_k", "GGUF Q4_K: super-blocks of 256, 4 bits with a 6-bit scale and minimum per 32 "
           "(4.5 bits)", "Q4_K", fallback="q5_0"),
    _block("q5_k", "q5_k", "GGUF Q5_K: super-blocks of 256, 5 bits with a 6-bit scale and minimum per 32 "
           "(5.5 bits)", "Q5_K", fallback="q5_1"),
    _block("q6_k", "q6_k", "GGUF Q6_K: super-blocks of 256, 6 bits with an int8 scale per 16 (6.56 bits)", "Q6_K",
           fallback="q8_0"),
    _block("int4-g32", "q4_0", "ours: symmetric int4 with a least-squares fp16 scale per 32 weights, kept as "
           "Q4_0 blocks (4.5 bits)", search=True),
    _block("int4-g128", "i4_g128", "ours: int4 with an fp16 scale and zero point per 128 weights, as AWQ / GPTQ "
           "checkpoints store them (4.25 bits)", fallback="int4-g32"),
)}

# A GGUF tensor type -> the format the kernels read it in as it is.
FILE_FORMATS: dict[str, WeightFormat] = {f.gguf_type: f for f in WEIGHT_FORMATS.values() if f.gguf_type}

# dtype= for "keep each tensor as the file stores it" (a quantized GGUF's default).
AS_FILE = "file"


def describe_formats(groups: dict[str, dict[str, int]]) -> str:
    """A model's formats by tensor group (LlamaModel.weight_formats) in one line, e.g.
    "qkv q5_0 x30 + q8_0 x14, o q5_0, gate_up q5_0, down q4_k x16 + q6_k x14, lm_head q8_0"."""
    parts = []
    for group, counts in groups.items():
        if len(counts) == 1:
            parts.append(f"{group} {next(iter(counts))}")
        else:
            parts.append(f"{group} " + " + ".join(f"{name} x{n}" for name, n in counts.items()))
    return ", ".join(parts)


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_FORMATS)}, got {name!r}") from None


@dataclass
class BlockTensor:
    """A [rows, cols] matrix of block-quantized weights: uint8 rows of `fmt`'s blocks, in GGUF's
    byte order ("file": often a view of the file itself) or the kernels' ("kernel", what the
    matrix-vector kernel and the GEMM read; kernels.repack_blocks). `release`, for a view of a
    file: drops its pages from this process once the rows have been copied out."""

    data: torch.Tensor  # uint8 [rows, row bytes]
    fmt: WeightFormat
    cols: int
    layout: str = "kernel"
    release: Callable[[], None] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to_kernel(self) -> BlockTensor:
        """The same rows in the kernels' layout (a copy of a file view; the file's pages released)."""
        if self.layout == "kernel":
            return self
        from workbench import kernels

        out = BlockTensor(kernels.repack_blocks(self.data.contiguous(), self.fmt.kernel, self.cols), self.fmt, self.cols)
        self.drop()
        return out

    def drop(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None

    def dequantize(self) -> torch.Tensor:
        """The weights as fp32 [rows, cols], exactly the values the blocks encode."""
        from workbench import kernels

        return kernels.dequantize_blocks(self.to_kernel().data, self.fmt.kernel, self.cols)

    def take_rows(self, index) -> BlockTensor:
        """Rows `index` (a slice, or int64 indices: a copy), in the same layout."""
        return BlockTensor(self.data[index], self.fmt, self.cols, self.layout, self.release)

    def take_cols(self, lo: int, hi: int) -> BlockTensor:
        """Columns [lo, hi) (whole blocks) in the kernels' layout: the bytes of those blocks."""
        from workbench import kernels

        weights, nbytes = self.fmt.block_geometry
        if lo % weights or hi % weights:
            raise ValueError(f"{self.fmt.name} rows split only at whole blocks of {weights} weights; "
                             f"columns [{lo}, {hi}) do not")
        gguf = self.data if self.layout == "file" else kernels.repack_blocks(self.data.contiguous(), self.fmt.kernel,
                                                                              self.cols, to_kernel=False)
        part = gguf[:, lo // weights * nbytes:hi // weights * nbytes].contiguous()
        return BlockTensor(kernels.repack_blocks(part, self.fmt.kernel, hi - lo), self.fmt, hi - lo)

    @staticmethod
    def stack(parts: list[BlockTensor]) -> BlockTensor:
        """Rows of several matrices of one format one after another (kernels' layout)."""
        parts = [p.to_kernel() for p in parts]
        return BlockTensor(torch.cat([p.data for p in parts]), parts[0].fmt, parts[0].cols)
