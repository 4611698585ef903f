"""workbench.hw.memory: large buffers really on transparent huge pages, also right after a
burst of freed allocations (when malloc would hand back heap memory already on 4 KiB pages),
and freed when the tensor is."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from workbench.hw import memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


needs_thp = pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are off on this host")


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's first byte (/proc/self/smaps)."""
    address, found = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= address < hi
        elif found and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds address {address:#x}")


def mapping_of(address: int) -> str | None:
    """The /proc/self/maps range ("lo-hi") that holds address, or None."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line.split()[0]
    return None


def test_small_buffers_are_ordinary_tensors():
    t = memory.empty((3, 5), torch.int8)
    assert t.shape == (3, 5) and t.dtype == torch.int8
    assert memory.zeros(7).eq(0).all()


@needs_thp
def test_large_buffers_are_on_huge_pages_even_after_freed_allocations():
    # Freed heap memory (what torch.empty would reuse) ...
    junk = [torch.ones(3 << 20) for _ in range(40)]  # 40 x 12 MiB, touched
    del junk
    gc.collect()
    # ... is not where the buffers come from: each is a fresh mapping on 2 MiB pages.
    for dtype in (torch.int8, torch.float32, torch.bfloat16):
        t = memory.zeros((16 << 20) // dtype.itemsize, dtype)
        assert t.data_ptr() % memory.HUGE_PAGE == 0
        assert t.nbytes == 16 << 20 and t.eq(0).all()
        assert huge_kib(t) >= 8 << 10, (dtype, huge_kib(t))  # at least half (the kernel may run short)


def test_a_large_buffer_is_unmapped_when_freed():
    t = memory.empty((4, 1 << 20), torch.float32).fill_(2.0)
    address = t.data_ptr()
    region = mapping_of(address)
    view = t[1:3]
    del t
    gc.collect()
    assert view.sum().item() == 2.0 * 2 * (1 << 20)  # a view keeps the buffer
    assert mapping_of(address) == region
    del view
    gc.collect()
    assert mapping_of(address) != region
