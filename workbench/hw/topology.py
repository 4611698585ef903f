"""Where a rank's threads and memory go: the CPU topology (NUMA nodes, physical cores, sockets)
and the placement of tensor-parallel ranks on it.

    topo = read_topology()                 # sysfs, restricted to the CPUs this process may use
    plan = place_ranks(topo, ranks=2, threads_per_rank=1)
    bind_memory([plan[0].node])            # in the rank's process: MPOL_BIND, not first touch

NUMA nodes are what the kernel reports, so sub-NUMA clusters (SNC, Intel's split of a socket
into 2 or 4 nodes, each with its own memory controllers) are nodes of their own, as SGLang
and vLLM treat them (one rank per SNC domain). The placement rule, in order:

1. ranks go to nodes round-robin, the nodes ordered so consecutive ranks land on different
   sockets first (a 2-rank run on 2 sockets x 2 SNC takes one node of each socket, so each
   rank has its socket's memory channels), then on the other nodes of each socket;
2. within a node, a rank takes one CPU per physical core before any SMT sibling, cores in
   order, so two ranks on one node never share a core while a free one is left;
3. a node without enough CPUs for its ranks is an error naming the node and the counts.

place_ranks is a pure function of a Topology, so tests run it on synthetic machines (two
sockets with two SNC nodes each, odd core counts, SMT) as well as on this one.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys/devices/system")


@dataclass(frozen=True)
class Node:
    id: int
    package: int  # the socket
    cores: tuple[tuple[int, ...], ...]  # the CPUs this process may use, grouped by physical core (SMT siblings)

    @property
    def cpus(self) -> list[int]:
        return sorted(c for core in self.cores for c in core)


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]

    def node_of(self, cpu: int) -> int:
        for n in self.nodes:
            if cpu in n.cpus:
                return n.id
        raise ValueError(f"cpu {cpu} is in no node of this topology")


@dataclass(frozen=True)
class Placement:
    rank: int
    node: int
    cpus: list[int]


def _cpulist(text: str) -> list[int]:
    """sysfs's "0-3,8,10-11" as a list."""
    cpus = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text()
    except OSError:
        return default


def read_topology(root: Path = SYSFS, allowed: set[int] | None = None) -> Topology:
    """This machine's NUMA nodes with the CPUs this process may use (`allowed`: its affinity
    unless given), one node holding all of them where sysfs has no node folders."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    node_cpus = {int(p.name[4:]): [c for c in _cpulist(_read(p / "cpulist")) if c in allowed]
                 for p in sorted((root / "node").glob("node[0-9]*"))}
    node_cpus = {n: cpus for n, cpus in node_cpus.items() if cpus} or {0: sorted(allowed)}
    nodes = []
    for n, cpus in sorted(node_cpus.items()):
        cores: dict[tuple[int, int], list[int]] = {}
        for c in cpus:
            topo = root / "cpu" / f"cpu{c}" / "topology"
            package = int(_read(topo / "physical_package_id", "0") or 0)
            core = int(_read(topo / "core_id", str(c)) or c)
            cores.setdefault((package, core), []).append(c)
        package = min(k[0] for k in cores)
        ordered = sorted(cores.values(), key=min)
        nodes.append(Node(n, package, tuple(tuple(sorted(v)) for v in ordered)))
    return Topology(tuple(nodes))


def node_order(topology: Topology) -> list[Node]:
    """Nodes interleaved across sockets: the first node of each socket, then the second, ..."""
    by_package: dict[int, list[Node]] = {}
    for n in topology.nodes:
        by_package.setdefault(n.package, []).append(n)
    columns = [sorted(v, key=lambda n: n.id) for _, v in sorted(by_package.items())]
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


def place_ranks(topology: Topology, ranks: int, threads_per_rank: int) -> list[Placement]:
    """Disjoint CPU sets, one per rank, by the rule in the module docstring."""
    for name, value in (("ranks", ranks), ("threads_per_rank", threads_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    order = node_order(topology)
    members: dict[int, list[int]] = {}
    for r in range(ranks):
        members.setdefault(order[r % len(order)].id, []).append(r)
    plan = []
    for node in order:
        ranks_here = members.get(node.id, [])
        if not ranks_here:
            continue
        # one CPU per physical core first, then the SMT siblings, cores in order
        cpus = [core[i] for i in range(max(map(len, node.cores))) for core in node.cores if i < len(core)]
        need = len(ranks_here) * threads_per_rank
        if need > len(cpus):
            raise ValueError(f"--pin: NUMA node {node.id} has {len(cpus)} CPUs this process may use, not enough for "
                             f"{len(ranks_here)} rank(s) x {threads_per_rank} thread(s) = {need}")
        for i, r in enumerate(ranks_here):
            plan.append(Placement(r, node.id, sorted(cpus[i * threads_per_rank:(i + 1) * threads_per_rank])))
    return sorted(plan, key=lambda p: p.rank)


# -- memory policy: set_mempolicy(2) and get_mempolicy(2), which glibc does not wrap -----------

MPOL_BIND = 2
MODES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local"}
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}  # (set_mempolicy, get_mempolicy)
_MASK_WORDS = 16  # 1024 nodes


def _syscall(which: int, *args) -> None:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(f"memory policy syscalls are not known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(numbers[which]), *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{('set_mempolicy', 'get_mempolicy')[which]}: {os.strerror(err)}")


def bind_memory(nodes: list[int]) -> None:
    """MPOL_BIND this thread (and the threads it starts afterwards) to `nodes`: its pages come
    from their memory or the allocation fails, instead of first touch's best effort."""
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    _syscall(0, ctypes.c_int(MPOL_BIND), mask, ctypes.c_ulong(64 * _MASK_WORDS + 1))


def memory_policy() -> tuple[str, list[int]]:
    """This thread's memory policy: its mode and the nodes in its mask."""
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    _syscall(1, ctypes.byref(mode), mask, ctypes.c_ulong(64 * _MASK_WORDS + 1), None, ctypes.c_ulong(0))
    return MODES.get(mode.value, str(mode.value)), [n for n in range(64 * _MASK_WORDS) if mask[n // 64] >> (n % 64) & 1]
