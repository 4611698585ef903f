"""Collectives between the ranks of a tensor-parallel run: one small interface, several
backends (their records: workbench.distributed.backends).

    all_reduce_(x)          x <- sum over ranks, in place (fp32)
    broadcast_(x, root)     x <- root's x, in place (any dtype)
    all_gather(x)           [world, *x.shape]: every rank's x
    buffer(shape)           an fp32 tensor that all_reduce_ reduces without copying it first:
                            a kernel that writes its output there (linear(..., out=buffer))
                            is the paper's "zero copy"; any other tensor is copied in

Backends:
    gloo    torch.distributed's gloo over TCP (always available); small all-reduces and
            all-gathers as point-to-point messages to every peer, larger ones gloo's own
    shm     our shared-memory collectives (kernels/shm_comm.cpp): ranks on one host write
            into one /dev/shm segment and reduce a slice each, with flag barriers
    ccl     oneCCL through our binding (kernels/ccl_comm.cpp, workbench.distributed.ccl),
            with the `ccl` extra installed
Each call is timed and its payload counted while `recording` is on (`log`), which is how
the runtime splits a step into compute and communication. Where the backend can tell (shm:
its first barrier is where a rank waits for the others' data), a call also says how much of
its time was waiting for the other ranks to arrive: their imbalance, not the collective's cost.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch


class CommError(RuntimeError):
    """A collective failed: a rank died, timed out or was misconfigured."""


@dataclass
class CommCall:
    op: str
    bytes: int  # this rank's payload
    seconds: float
    wait_s: float | None = None  # of `seconds`, waiting for the other ranks to arrive (None: not known)


class Communicator:
    """The interface; see the module docstring."""

    name = "?"
    measures_waits = False  # does the backend report how long a call waited for the other ranks?

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.recording = False
        self.log: list[CommCall] = []
        self.waited_s = 0.0  # a measuring backend adds its calls' waits here

    # -- what a backend implements ---------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _broadcast(self, x: torch.Tensor, root: int) -> None:
        raise NotImplementedError

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def buffer(self, shape) -> torch.Tensor:
        return torch.empty(shape)

    def step_collective(self):
        """The all-reduce the fused C++ decode step calls between its kernels (kernels.h's
        StepCollective): by default this backend's own, called back into Python."""
        from workbench.kernels import native

        return native.ext.PyCollective(self._all_reduce)

    def close(self) -> None:
        pass

    # -- the timed interface ---------------------------------------------------------------
    def _timed(self, op: str, nbytes: int, fn, *args):
        if not self.recording:
            return fn(*args)
        self.waited_s = 0.0
        t0 = time.perf_counter()
        out = fn(*args)
        self.log.append(CommCall(op, nbytes, time.perf_counter() - t0,
                                 self.waited_s if self.measures_waits else None))
        return out

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"all_reduce_ needs a contiguous float32 tensor, got {x.dtype}")
        if self.world > 1:
            self._timed("all_reduce", x.nbytes, self._all_reduce, x)
        return x

    def broadcast_(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.world > 1:
            self._timed("broadcast", x.nbytes, self._broadcast, x.contiguous() if not x.is_contiguous() else x, root)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.world == 1:
            return x.unsqueeze(0)
        return self._timed("all_gather", x.nbytes, self._all_gather, x)

    def barrier(self) -> None:
        self.all_reduce_(torch.zeros(1))

    def take_log(self) -> list[CommCall]:
        log, self.log = self.log, []
        return log


def _never_preempt_the_caller(thread_name: str) -> None:
    """Schedule this process's threads called `thread_name` as batch work (SCHED_BATCH).

    gloo's TCP transport reads the socket on its own thread, which skips a pair whose lock
    another thread holds and polls again at once. The thread posting a send or a receive
    holds that lock while it writes to the socket; when the peer's answer wakes the I/O
    thread on the same core (a rank pinned to one CPU), the kernel lets the woken thread
    preempt the poster, and it spins against the lock until the scheduler's next tick. A
    batch thread is never scheduled in by a wake-up, only when the core is free or at a
    tick, with the same share of the CPU as before (SCHED_IDLE would also avoid the spin
    but starve behind any other process on that core). The price: where another process
    keeps the rank's core busy while the rank waits, each message waits for a tick."""
    import os

    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == thread_name:
                    os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass


class GlooComm(Communicator):
    """torch.distributed's gloo backend; the rendezvous is a TCP store that rank 0 hosts at
    init_method's address (tcp://127.0.0.1:port on one host; on several, the address of the
    interface the user named), listening there and nowhere else."""

    name = "gloo"

    def __init__(self, rank: int, world: int, timeout_s: float, init_method: str):
        super().__init__(rank, world, timeout_s)
        import socket
        from urllib.parse import urlsplit

        import torch.distributed as dist

        self.dist = dist
        where = urlsplit(init_method)
        timeout = timedelta(seconds=timeout_s)
        # Given a host and port alone, the TCPStore's server listens on every interface (::),
        # whatever the host: a one-machine run would be open to the network. Rank 0 binds the
        # listening socket itself and hands it over; it stays open while the group lives.
        self._store_socket = None
        if rank == 0:
            self._store_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._store_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._store_socket.bind((where.hostname, where.port))
            self._store_socket.listen(max(world, 8))
        store = dist.TCPStore(where.hostname, where.port, world, is_master=rank == 0, timeout=timeout,
                              master_listen_fd=self._store_socket.fileno() if rank == 0 else None)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        self.group = dist.group.WORLD
        _never_preempt_the_caller("gloo_tcp_loop")

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except RuntimeError as e:
            raise CommError(f"gloo collective on rank {self.rank} failed: {e}") from None

    # gloo's own all-reduce and all-gather run a ring of chunks with notifications: several
    # round trips even for a decode step's few KB, where one exchange of point-to-point
    # messages is one (an order of magnitude apart between two processes on one host).
    # Payloads up to DIRECT_BYTES per peer therefore go straight to every peer (one round of
    # messages, the same bytes as the ring when there are two ranks), and every rank sums the
    # parts in rank order, so all ranks hold the same bits. Larger ones use gloo's collectives.
    DIRECT_BYTES = 1 << 20

    def _direct(self, x) -> bool:
        return x.nbytes * (self.world - 1) <= self.DIRECT_BYTES

    def _exchange(self, x) -> list:
        """Every rank's x in rank order (this rank's is x itself): x sent to each peer and each
        peer's received, all posted before any is waited on."""
        parts = [x if r == self.rank else torch.empty_like(x) for r in range(self.world)]
        peers = [r for r in range(self.world) if r != self.rank]
        def post_and_wait():
            pending = [self.dist.irecv(parts[r], src=r) for r in peers] + [self.dist.isend(x, dst=r) for r in peers]
            for work in pending:
                work.wait()
        self._call(post_and_wait)
        return parts

    def _all_reduce(self, x):
        if not self._direct(x):
            return self._call(self.dist.all_reduce, x)
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        x.copy_(total)

    def _broadcast(self, x, root):
        self._call(self.dist.broadcast, x, src=root)

    def _all_gather(self, x):
        if self._direct(x):
            return torch.stack(self._exchange(x))
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._call(self.dist.all_gather, parts, x)
        return torch.stack(parts)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
        if self._store_socket is not None:
            self._store_socket.close()
            self._store_socket = None


SHM_DIR = Path("/dev/shm")


def shm_capacity_bytes(capacity_mb: float) -> int:
    return int(capacity_mb * 2**20) // 64 * 64


SHM_PREFIX = "workbench-"


def shm_segment_name(pid: int | None = None) -> str:
    """A new segment's name, carrying the pid of the process that owns it (the client), so a
    segment left by a client that died can be told from one in use."""
    import os
    import uuid

    return f"{SHM_PREFIX}{os.getpid() if pid is None else pid}-{uuid.uuid4().hex[:12]}"


def remove_orphaned_segments(alive) -> list[Path]:
    """Delete the segments whose owning process is gone (`alive(pid)` false): a client that was
    killed (SIGKILL, the OOM killer) never ran its cleanup, and each segment holds its size in
    RAM. Returns what was removed."""
    removed = []
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        owner = path.name[len(SHM_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not alive(int(owner)):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def create_shm_segment(name: str, world: int, capacity_bytes: int) -> Path:
    """The segment file (sparse: pages cost memory only once touched); the client creates it
    before the ranks map it."""
    from workbench.kernels import native

    path = SHM_DIR / name
    with open(path, "wb") as f:
        f.truncate(native.ext.shm_segment_bytes(world, capacity_bytes))
    return path


class ShmComm(Communicator):
    """Our shared-memory collectives (kernels/shm_comm.cpp) over a /dev/shm segment.
    Collectives larger than a slot run in slot-sized chunks."""

    name = "shm"
    measures_waits = True

    def __init__(self, rank: int, world: int, timeout_s: float, path: str, capacity_bytes: int):
        super().__init__(rank, world, timeout_s)
        from workbench.kernels import native

        self.ext = native.ext
        self.path, self.capacity = Path(path), capacity_bytes
        size = self.ext.shm_segment_bytes(world, capacity_bytes)
        if not self.path.is_file() or self.path.stat().st_size != size:
            raise CommError(f"shm segment {self.path} is missing or has the wrong size (expected {size} bytes)")
        self.segment = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        from workbench.kernels import constants

        header = constants()["shm_header_bytes"]
        start = header + rank * capacity_bytes
        self.slot = self.segment[start:start + capacity_bytes].view(torch.float32)  # this rank's input slot
        # The same collective called natively by the fused decode step; it holds the barrier
        # numbers, which both sides advance.
        self.native = self.ext.ShmCollective(self.segment, rank, world, capacity_bytes, timeout_s)

    def _next(self) -> int:
        seq = self.native.seq
        self.native.seq = seq + 2
        return seq

    def step_collective(self):
        return self.native

    def _run(self, fn, *args) -> None:
        try:
            self.waited_s += fn(self.segment, self.rank, self.world, self.capacity, self.timeout_s, *args)
        except RuntimeError as e:
            raise CommError(str(e)) from None

    def buffer(self, shape) -> torch.Tensor:
        n = math.prod(shape)
        if 4 * n > self.capacity:
            return torch.empty(shape)  # too big for a slot: all_reduce_ copies it in, chunk by chunk
        return self.slot[:n].view(shape)

    def _all_reduce(self, x):
        flat = x.view(-1)
        step = self.capacity // 4
        for lo in range(0, flat.numel(), step):
            self._run(self.ext.shm_all_reduce, flat[lo:lo + step], self._next())

    def _broadcast(self, x, root):
        flat = x.view(-1).view(torch.uint8) if x.dtype != torch.uint8 else x.view(-1)
        for lo in range(0, flat.numel(), self.capacity):
            chunk = flat[lo:lo + self.capacity]
            self._run(self.ext.shm_broadcast, chunk, root, self._next())

    def _all_gather(self, x):
        if x.nbytes > self.capacity:
            raise CommError(f"shm all_gather of {x.nbytes} bytes exceeds a slot ({self.capacity} bytes); "
                            f"start the cluster with a larger shm capacity")
        out = torch.empty((self.world, *x.shape), dtype=x.dtype)
        self._run(self.ext.shm_all_gather, x, out, self._next())
        return out

    def close(self) -> None:
        self.segment = self.slot = self.native = None
