"""The collectives' backends: one record per backend, read by the cluster (client side) and
the engines (rank side). Adding a backend is one entry here plus its Comm class:

    name          what users type (`%distributed start --backend shm`, `wb.cluster(backend=...)`)
    description   one line for --help and the docs
    one_host      every rank must be on this host (a shared-memory segment)
    unavailable   None where it can run here, else the reason (an install hint)
    launch_env    environment the engines are started with (set later, from inside a running
                  process, oneCCL's settings made small all-reduces 10-20x slower)
    rendezvous    client side, once the engines are up: what every rank needs to join
    connect       rank side: join and return the Comm (workbench.distributed.comm)
    prepare       rank side, before joining: build the backend's own binding, if any
    settings      what the workbench sets for it, for status and reports
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nothing(*_args) -> None:
    return None


def _no_env(_cluster) -> dict:
    return {}


# -- gloo: torch.distributed over TCP -----------------------------------------------------

def _gloo_rendezvous(cluster, ids: list[int]) -> dict:
    from workbench.distributed import engine

    # rank 0 hosts the rendezvous: on its own address, on a port free there
    host, port = (("127.0.0.1", _free_port()) if cluster.launcher == "local" else
                  cluster.client[ids[0]].apply_sync(engine.address_and_port, cluster.iface))
    return {"init_method": f"tcp://{host}:{port}", "iface": cluster.iface}


def _gloo_connect(rank: int, world: int, timeout_s: float, rendezvous: dict):
    from workbench.distributed.comm import GlooComm

    if rendezvous.get("iface"):
        os.environ["GLOO_SOCKET_IFNAME"] = rendezvous["iface"]
    return GlooComm(rank, world, timeout_s, rendezvous["init_method"])


# -- shm: our C++ all-reduce over one shared-memory segment --------------------------------

def _shm_rendezvous(cluster, ids: list[int]) -> dict:
    from workbench.distributed.cluster import _alive
    from workbench.distributed.comm import create_shm_segment, remove_orphaned_segments, shm_segment_name

    removed = remove_orphaned_segments(_alive)  # left by clients that were killed
    if removed:
        print(f"removed {len(removed)} shared-memory segment(s) of dead clusters: "
              + ", ".join(p.name for p in removed))
    cluster.shm_path = create_shm_segment(shm_segment_name(), cluster.n, cluster.shm_capacity)
    return {"path": str(cluster.shm_path), "capacity": cluster.shm_capacity}


def _shm_connect(rank: int, world: int, timeout_s: float, rendezvous: dict):
    from workbench.distributed.comm import ShmComm

    return ShmComm(rank, world, timeout_s, rendezvous["path"], rendezvous["capacity"])


def _shm_settings(cluster) -> dict:
    return {"segment": str(cluster.shm_path), "slot_bytes": cluster.shm_capacity}


# -- ccl: oneCCL's libraries through our binding --------------------------------------------

def _ccl_unavailable() -> str | None:
    from workbench.distributed import ccl

    return None if ccl.available() else ccl.INSTALL_HINT


def _ccl_launch_env(cluster) -> dict:
    from workbench.distributed import ccl

    env = ccl.environment(0, cluster.n, cluster.iface)
    env.pop("CCL_LOCAL_RANK")  # differs per rank: each engine sets its own
    return env


def _ccl_rendezvous(cluster, ids: list[int]) -> dict:
    from workbench.distributed import engine

    return {"address": cluster.client[ids[0]].apply_sync(engine.ccl_address, cluster.n, cluster.iface),
            "iface": cluster.iface}


def _ccl_connect(rank: int, world: int, timeout_s: float, rendezvous: dict):
    from workbench.distributed.ccl import CclComm

    return CclComm(rank, world, timeout_s, rendezvous["address"], rendezvous.get("iface"))


def _ccl_prepare() -> None:
    from workbench.distributed import ccl

    ccl.extension()


def _ccl_settings(cluster) -> dict:
    from workbench.distributed import ccl

    return ccl.environment(0, cluster.n, cluster.iface)  # rank 0's; CCL_LOCAL_RANK differs per rank


def _gloo_settings(cluster) -> dict:
    return {"GLOO_SOCKET_IFNAME": cluster.iface or "(gloo's choice)"}


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    rendezvous: Callable
    connect: Callable
    settings: Callable
    one_host: bool = False
    unavailable: Callable[[], str | None] = _nothing
    launch_env: Callable = _no_env
    prepare: Callable[[], None] = _nothing
    # The fused step's o_proj / down_proj can write straight into this backend's all-reduce
    # buffer (its StepCollective has one). gloo and oneCCL reduce the step's own output in
    # place, so there the zero-copy switch changes only the Python path (prefill, and decode
    # with step="reference").
    fused_zero_copy: bool = False
    # Its StepCollective can hand a shared KV head from one rank to the other one-sided
    # (workbench.distributed.tp's kv_handoff): shm only; gloo and oneCCL compute it on both.
    fused_kv_handoff: bool = False


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("gloo", "torch.distributed's gloo over TCP (any hosts; iface= picks the interface)",
            _gloo_rendezvous, _gloo_connect, _gloo_settings),
    Backend("shm", "our C++ all-reduce over one shared-memory segment (every rank on this host)",
            _shm_rendezvous, _shm_connect, _shm_settings, one_host=True, fused_zero_copy=True,
            fused_kv_handoff=True),
    Backend("ccl", "oneCCL's libraries through our binding (the ccl extra; any hosts)",
            _ccl_rendezvous, _ccl_connect, _ccl_settings, unavailable=_ccl_unavailable,
            launch_env=_ccl_launch_env, prepare=_ccl_prepare),
)}


def backend(name: str) -> Backend:
    """The backend called `name`; a ValueError listing the backends otherwise."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}") from None


def available_backends() -> list[str]:
    """The backends that can run on this machine."""
    return [name for name, b in BACKENDS.items() if b.unavailable() is None]
