"""Large buffers on transparent huge pages (2 MiB) where the kernel allows it.

Streaming a KV cache or a weight matrix from DRAM touches a new 4 KiB page every 4 KiB; on
2 MiB pages the TLB covers 512 times more, and the hardware prefetchers stop at page
boundaries less often (docs/measurements.md has what it gained). Linux gives anonymous memory huge pages only
when asked (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the usual default),
and only for memory not yet touched, so `empty()` maps a fresh anonymous region for each
large buffer (unmapped when the tensor is freed) and asks with madvise(MADV_HUGEPAGE)
before the first touch. torch.empty would take it from malloc, which after a burst of
freed buffers hands back heap memory already on 4 KiB pages: in bench/decode_attention.py,
after the bundled model's shapes, 1 GiB of the Llama-2-7B caches came back that way and the
tiled int8 kernel read them measurably slower. Elsewhere, or
when the kernel says no, the buffer is an ordinary one: same values, same layout.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE  # smaller buffers would not hold a whole aligned huge page


def _fresh(nbytes: int) -> torch.Tensor:
    """nbytes starting on a huge-page boundary in a new anonymous mapping, asked for huge
    pages before anything touches it; the tensor keeps the mapping alive and unmaps it
    when freed (torch.frombuffer holds a reference to the mmap object)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:
        pass  # no transparent huge pages here: 4 KiB pages, the same buffer otherwise
    return whole[start:start + nbytes]


def empty(shape, dtype=torch.float32) -> torch.Tensor:
    """torch.empty, on huge pages when it is at least 4 MiB (see the module docstring)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    return _fresh(nbytes).view(dtype).view(shape)


def zeros(shape, dtype=torch.float32) -> torch.Tensor:
    return empty(shape, dtype).zero_()


def _malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim(0)). Tensors below
    glibc's mmap threshold (it grows to 32 MiB as large blocks are freed: a layer's matrices
    fall under it) come from the heap, and a freed one's pages stay in the process's resident
    memory until trimmed. A load that copies each matrix (file -> kernels' layout -> the
    arena) calls this as it goes, or a 4 GB model would leave GBs of freed copies resident."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class Arena:
    """One huge-page buffer that tensors are moved into one after another, each at a 4 KiB
    boundary right after the previous one: `take(t)` copies t in and returns the view that
    replaces it. Weights moved in the order a decode step reads them become one long stream
    on 2 MiB pages instead of a hundred separate allocations on 4 KiB pages (the layers'
    matrices are 1-7 MiB, too small to hold an aligned huge page each).
    The buffer is only reserved when created; pages are touched as tensors are copied in,
    so moving a model whose old tensors are freed as they are replaced needs no second copy
    of it in memory."""

    ALIGN = 4096

    def __init__(self, nbytes: int):
        # One huge page more than asked, so the tensors can start on a huge-page boundary.
        self.buffer = empty((max(nbytes, 1) + HUGE_PAGE,), torch.uint8)
        self.start = -self.buffer.data_ptr() % HUGE_PAGE
        self.nbytes, self.used = nbytes, 0

    @classmethod
    def padded(cls, nbytes: int) -> int:
        """The bytes `nbytes` take in an arena: rounded up to the next 4 KiB."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    @classmethod
    def size(cls, t: torch.Tensor) -> int:
        """The bytes `t` takes in an arena, padding included."""
        return cls.padded(t.nbytes)

    @property
    def free(self) -> int:
        return self.nbytes - self.used

    def alloc(self, shape, dtype=torch.float32) -> torch.Tensor:
        """The next `shape` tensor of the arena, uninitialised."""
        n = math.prod(shape) * dtype.itemsize
        if self.padded(n) > self.free:
            raise ValueError(f"the arena holds {self.nbytes} bytes; {self.used} are used and a "
                             f"{tuple(shape)} {dtype} tensor needs {self.padded(n)} more")
        at = self.start + self.used
        self.used += self.padded(n)
        return self.buffer[at:at + n].view(dtype).view(shape)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """t copied into the arena: the view that replaces it."""
        return self.alloc(tuple(t.shape), t.dtype).copy_(t)
