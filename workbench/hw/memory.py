"""Large buffers on transparent huge pages (2 MiB) where the kernel allows it.

Streaming a KV cache or a weight matrix from DRAM touches a new 4 KiB page every 4 KiB; on
2 MiB pages the TLB covers 512 times more, and the hardware prefetchers stop at page
boundaries less often. Measured on host C (Xeon, 2 threads): a read of 512 MiB at 35.1 GB/s
on huge pages against 30.6 on 4 KiB pages. Linux gives anonymous memory huge pages only
when asked (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the usual default),
so `empty()` asks with madvise(MADV_HUGEPAGE) before the first touch. Elsewhere, or when
the kernel says no, the buffer is an ordinary one: same values, same layout.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE  # smaller buffers would not hold a whole aligned huge page
_MADV_HUGEPAGE = 14
_libc = None


def _advise(t: torch.Tensor) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    return _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0


def empty(shape, dtype=torch.float32) -> torch.Tensor:
    """torch.empty, asking for huge pages when it is at least 4 MiB (not yet touched)."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel() * t.element_size() >= MIN_BYTES:
        _advise(t)
    return t


def zeros(shape, dtype=torch.float32) -> torch.Tensor:
    return empty(shape, dtype).zero_()
