"""What this machine is: CPU model, ISA flags, cache sizes (from sysfs), thread count.

One source of truth for hardware facts; the kernels' block-size heuristics and every
report read them from here. Measured peaks (bandwidth, FMA throughput) live in
`workbench.kernels.peaks`, which caches them per machine.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

_SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


@dataclass(frozen=True)
class CacheLevel:
    level: int
    kind: str  # "Data", "Instruction", "Unified"
    size_bytes: int
    shared_by_cpus: int


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str
    machine: str
    logical_cpus: int
    flags: frozenset[str] = field(repr=False)
    caches: tuple[CacheLevel, ...]

    @property
    def has_avx2(self) -> bool:
        return {"avx2", "fma", "f16c"} <= self.flags

    @property
    def has_avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl"} <= self.flags

    def cache_bytes(self, level: int) -> int | None:
        """Size of the data/unified cache of `level` as one core sees it."""
        for c in self.caches:
            if c.level == level and c.kind in ("Data", "Unified"):
                return c.size_bytes
        return None

    @property
    def l2_bytes(self) -> int:
        # 1 MiB when sysfs says nothing: a middle value between client and server cores.
        return self.cache_bytes(2) or (1 << 20)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["flags"] = sorted(f for f in self.flags if re.match(r"(avx|fma|f16c|amx|sse4)", f))
        d["l2_bytes"] = self.l2_bytes
        return d


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)", text.strip())
    if not m:
        return 0
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def _read_caches() -> tuple[CacheLevel, ...]:
    levels = []
    for index in sorted(_SYSFS_CACHE.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        n_shared = 0
        for part in shared.split(","):
            lo, _, hi = part.partition("-")
            n_shared += int(hi or lo) - int(lo) + 1 if lo else 0
        levels.append(CacheLevel(level, kind, size, max(n_shared, 1)))
    return tuple(levels)


def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, frozenset()
    if m := re.search(r"^model name\s*:\s*(.+)$", text, re.M):
        model = m.group(1).strip()
    if m := re.search(r"^flags\s*:\s*(.+)$", text, re.M):
        flags = set(m.group(1).split())
    return model, frozenset(flags)


@functools.lru_cache(maxsize=1)
def machine_info() -> MachineInfo:
    model, flags = _cpuinfo()
    return MachineInfo(
        cpu_model=model,
        machine=platform.machine(),
        logical_cpus=os.cpu_count() or 1,
        flags=flags,
        caches=_read_caches(),
    )
