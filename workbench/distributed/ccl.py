"""The oneCCL backend: our C++ binding (kernels/ccl_comm.cpp) built against the oneccl-cpu
wheels of the `ccl` extra (`pip install -e '.[ccl]'`), and the environment that makes
oneCCL fast on a small machine (../shared/ONECCL.md: with oneCCL's defaults a 16 KB
all-reduce took 8-32 ms instead of ~30 us).

The workbench sets that environment on every engine itself; `%distributed status` shows it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from workbench.distributed.comm import CommError, Communicator

INSTALL_HINT = ("the ccl backend needs oneCCL's libraries: pip install -e '.[ccl]' (the oneccl-cpu, "
                "oneccl-cpu-devel and impi-rt 2021.16.2 wheels)")


def ccl_prefix() -> Path:
    """Where the wheels put libccl and its headers (this environment's prefix)."""
    prefix = Path(sys.prefix)
    if not (prefix / "lib" / "libccl.so.1").is_file() or not (prefix / "include" / "oneapi" / "ccl.hpp").is_file():
        raise CommError(INSTALL_HINT)
    return prefix


def available() -> bool:
    try:
        ccl_prefix()
        return True
    except CommError:
        return False


def environment(rank: int, world: int, iface: str | None = "lo") -> dict[str, str]:
    """oneCCL's settings for `world` ranks: its own ofi transport over libfabric's tcp provider
    with shared memory between local ranks, no worker thread (on a 2-core machine it would
    fight the rank's own thread for the core), yielding waits; the key-value store and tcp on
    `iface` (loopback on one host; on several, the interface they share)."""
    prefix = str(ccl_prefix())
    env = {"CCL_ROOT": prefix, "I_MPI_ROOT": prefix, "FI_PROVIDER_PATH": f"{prefix}/lib",
           "CCL_PROCESS_LAUNCHER": "none", "CCL_ATL_TRANSPORT": "ofi", "FI_PROVIDER": "tcp", "CCL_ATL_SHM": "1",
           "CCL_WORKER_OFFLOAD": "0", "CCL_YIELD": "sched_yield",
           "CCL_LOCAL_RANK": str(rank), "CCL_LOCAL_SIZE": str(world)}
    if iface:
        env.update(CCL_KVS_IFACE=iface, FI_TCP_IFACE=iface)
    return env


_ext = None


def extension():
    """Build (once, cached like the kernels) and import the binding."""
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load

        from workbench.cache import cache_dir, cpu_key
        from workbench.kernels._build import SOURCE_DIR, build_claim, our_ninja

        prefix = ccl_prefix()
        # The binding implements kernels.h's StepCollective for the kernels' extension to call:
        # a change to that header must rebuild it too (load() hashes the sources and flags only).
        interface = hashlib.sha256((SOURCE_DIR / "kernels.h").read_bytes()).hexdigest()[:16]
        build = cache_dir() / "kernels" / f"ccl-{cpu_key()}"
        build.mkdir(parents=True, exist_ok=True)
        # the same ninja in every process, and the folder's flock (a killed build's lock file is
        # removed, not waited on forever), as for the kernels
        with our_ninja(), build_claim(build):
            _ext = load(name="workbench_ccl", sources=[str(SOURCE_DIR / "ccl_comm.cpp")],
                        extra_include_paths=[str(prefix / "include")],
                        extra_cflags=["-O2", f"-DWBK_KERNELS_H={interface}"],
                        extra_ldflags=[f"-L{prefix / 'lib'}", "-l:libccl.so.1", f"-Wl,-rpath,{prefix / 'lib'}"],
                        build_directory=str(build))
    return _ext


def main_kvs_address(rank: int, world: int, iface: str | None) -> bytes:
    """Rank 0: create the store the ranks meet at; its address goes to the others. The
    environment should already be the process's from its start (the cluster gives it to
    the engines' launcher); here it is completed, for a process started without it."""
    _set_environment(rank, world, iface)
    return extension().main_kvs_address()


def _set_environment(rank: int, world: int, iface: str | None) -> None:
    for key, value in environment(rank, world, iface).items():
        if os.environ.get(key) != value:
            os.environ[key] = value


class CclComm(Communicator):
    name = "ccl"

    def __init__(self, rank: int, world: int, timeout_s: float, address: bytes, iface: str | None):
        super().__init__(rank, world, timeout_s)
        _set_environment(rank, world, iface)
        self.ext = extension()
        self._call(self.ext.connect, rank, world, address)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as e:
            raise CommError(f"rank {self.rank}: {e}") from None

    def _all_reduce(self, x):
        self._call(self.ext.all_reduce, x)

    def step_collective(self):
        """oneCCL's all-reduce for the fused decode step, called natively (not through Python)."""
        from workbench.kernels import native

        return native.ext.ForeignCollective(self._call(self.ext.step_collective))

    def _broadcast(self, x, root):
        self._call(self.ext.broadcast, x, root)

    def _all_gather(self, x):
        import torch

        out = torch.empty((self.world, *x.shape), dtype=x.dtype)
        self._call(self.ext.all_gather, x, out)
        return out

    def close(self) -> None:
        self.ext.disconnect()
