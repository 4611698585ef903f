"""A GGUF file's metadata and tensors, read in one pass.

The gguf package's GGUFReader builds a numpy view for every part of every metadata field; for
a tokenizer of 49,152 tokens and 48,900 merges that took more than half of loading the bundled
model. This reads the same format (GGUF v2 and v3, little-endian) with struct over one memory
map: metadata as Python values, each tensor as a numpy view of the file in the shape and
dtype GGUFReader gives it, so gguf.quants.dequantize reads it the same way.

    f = read_gguf(path)
    f.fields["llama.block_count"]          # 30
    f.tensors["blk.0.attn_q.weight"].data   # a view, nothing copied
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types (the GGUF spec's gguf_type) -> struct format of one scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not GGUF, or is damaged or truncated; the message says where."""


@dataclass
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # as GGUFReader gives it: typed for plain types, bytes per row when quantized
    offset: int = 0  # where its bytes start in the file
    nbytes: int = 0


@dataclass
class GGUFFile:
    version: int
    fields: dict
    tensors: dict[str, GGUFTensor]
    # each field's GGUF value type, and for arrays their elements' (else None): what a writer
    # needs to write the field again as it was
    types: dict[str, tuple[int, int | None]]
    mapping: mmap.mmap | None = None  # the file, mapped read-only; the tensors' data are views of it

    def release(self, t: GGUFTensor) -> None:
        """Drop the pages of t's bytes from this process (madvise MADV_DONTNEED): a loader that has
        copied a tensor out keeps only the copy resident, not the file's pages as well (they stay
        in the page cache, not in the process). Pages t shares with a neighbour are kept; a
        later read maps them in again."""
        if self.mapping is None or t.nbytes == 0:
            return
        page = mmap.PAGESIZE
        lo, hi = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if hi > lo:
            try:
                self.mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError, AttributeError):
                pass  # no madvise here: the pages are dropped with the mapping


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError(f"{self.path} ends at byte {len(self.buf)}, inside its header (truncated?)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFError(f"{self.path}: a string of {n} bytes at byte {self.pos} runs past the end of the file")
        try:
            s = bytes(self.buf[self.pos:end]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: the string at byte {self.pos} is not UTF-8 ({e.reason})") from None
        self.pos = end
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                end = self.pos + n * dt.itemsize
                if end > len(self.buf):
                    raise GGUFError(f"{self.path}: an array of {n} values at byte {self.pos} runs past the end")
                out = np.frombuffer(self.buf, dt, n, self.pos).tolist()
                self.pos = end
                return out
            return [self.value(etype) for _ in range(n)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self.pos}")


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensors of the GGUF file at `path` (GGUFError if it is not one)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    path = Path(path)
    try:
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(mapping, dtype=np.uint8)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise GGUFError(f"{path} cannot be mapped ({e})") from None
    if bytes(data[:4]) != MAGIC:
        raise GGUFError(f"{path} does not start with the GGUF magic (got {bytes(data[:4])!r})")
    # the header through a memoryview: slicing the memmap itself builds a numpy object per
    # string, which for a 49,152-token vocabulary cost most of the parse
    cur = _Cursor(memoryview(data), path)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; versions 2 and 3 are read (a big-endian file?)")
    n_tensors, n_fields = cur.take("<Q"), cur.take("<Q")
    fields, types = {}, {}
    for _ in range(n_fields):
        key = cur.string()
        vtype = cur.take("<I")
        sub = struct.unpack_from("<I", data, cur.pos)[0] if vtype == _ARRAY and cur.pos + 4 <= len(data) else None
        fields[key], types[key] = cur.value(vtype), (vtype, sub)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        shape = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, shape, cur.take("<I"), cur.take("<Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment is {alignment!r}, not a power of two")
    start = -(-cur.pos // alignment) * alignment
    plain = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}
    tensors = {}
    for name, shape, raw_type, offset in infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name} appears twice")
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[ttype]
        n = int(np.prod(shape, dtype=np.int64))
        n_bytes = n * type_size // block
        begin = start + offset
        if begin + n_bytes > len(data):
            raise GGUFError(f"{path}: tensor {name} ({n_bytes} bytes at {begin}) runs past the end of the file "
                            f"({len(data)} bytes): truncated?")
        np_shape = tuple(reversed(shape))
        raw = data[begin:begin + n_bytes]
        if ttype.name in plain:
            view = raw.view(plain[ttype.name]).reshape(np_shape)
        else:
            view = raw.reshape(quant_shape_to_byte_shape(np_shape, ttype))
        tensors[name] = GGUFTensor(name, ttype, shape, view, begin, n_bytes)
    return GGUFFile(version, fields, tensors, types, mapping)


def _read_only_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over the file's read-only memory map, nothing copied; only ever read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(a)


def dequantize(t: GGUFTensor) -> np.ndarray:
    """t's values as a new float32 array in numpy order (shape reversed from GGUF's). Q8_0 and
    Q4_1, the bundled model's types, are decoded here over the whole tensor at once (the gguf
    package splits it into many small groups of rows, three times slower on that model); every
    other type goes through gguf.quants.dequantize. NotImplementedError for a type the gguf
    package cannot decode either."""
    kind = t.tensor_type.name
    shape = tuple(reversed(t.shape))
    if kind == "Q8_0":  # blocks of 32: fp16 scale d, 32 int8 q; value = d q
        b = _read_only_tensor(t.data.reshape(-1, 34))
        d = b[:, :2].contiguous().view(torch.float16).float()
        out = b[:, 2:].view(torch.int8).float()
        return out.mul_(d).reshape(shape).numpy()
    if kind == "Q4_1":  # blocks of 32: fp16 scale d, fp16 minimum m, 16 bytes of two 4-bit q
        b = _read_only_tensor(t.data.reshape(-1, 20))
        d = b[:, 0:2].contiguous().view(torch.float16).float()
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        qs = b[:, 4:]
        out = torch.empty(b.shape[0], 32)
        torch.bitwise_and(qs, 0x0F, out=out[:, :16])  # low nibbles are values 0-15, high 16-31
        torch.bitwise_right_shift(qs, 4, out=out[:, 16:])
        return out.mul_(d).add_(m).reshape(shape).numpy()
    from gguf.quants import dequantize as gguf_dequantize

    return np.array(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
