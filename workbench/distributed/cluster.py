"""Tensor-parallel runs from a notebook: ipyparallel engines, one per rank.

    import workbench as wb
    cluster = wb.cluster(2, backend="shm", threads_per_rank=1, pin=True)   # starts the engines
    model = cluster.load_model("smollm2-135m")       # every engine loads it and keeps its shard
    out = model.generate("The capital of France is", max_new_tokens=32, on_token=...)
    model.lm_head, model.token_broadcast, model.zero_copy = "gather", "embeddings", False
    cluster.stop()

`Cluster` starts ipyparallel's controller and engines (its local launcher by default, or
its MPI / SSH / Slurm launchers: `launcher=`), listening on 127.0.0.1 unless told
otherwise. Every engine sets its own threads and, with pin, binds to its own cores (one
rank per NUMA node on a multi-socket host, so each rank's weights land in its node's
memory), then joins the collective. Weights never travel through the controller: each
engine loads the model itself from the same name or path.

`DistributedModel` has the Model API (generate, logits, the switches, config, tokenizer).
A generation is one request to every engine; rank 0 streams tokens and step records back
while it runs. If an engine dies, the call raises DistributedError naming the rank within
a few seconds, and the cluster is stopped (no engine or controller left behind); the
notebook and any single-process model stay usable.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import asdict
from typing import Callable

from workbench.distributed import engine, watchdog
from workbench.distributed.backends import backend as backend_record
from workbench.distributed.comm import shm_capacity_bytes
from workbench.distributed.tp import TPOptions
from workbench.hw.topology import place_ranks, read_topology
from workbench.model.switches import SwitchProperties, Switches
from workbench.model.timing import Timings

LAUNCHERS = ("local", "mpi", "ssh", "slurm")
HEARTBEAT_MS = 200  # the controller's heartbeat period (see Cluster.start)
DEAD_AFTER_S = 10  # the heartbeat silence after which the controller calls an engine dead
# The hub accepts a registered engine only at its next heartbeat, two beats after it connects:
# at ipyparallel's default 3 s period every start waited about 6 s for that. A short beat with
# enough misses allowed still takes DEAD_AFTER_S of silence to call an engine dead. (A misspelt
# option is only a warning in the controller's log: tests/test_distributed_lifecycle.py checks
# the names.)
CONTROLLER_ARGS = (f"--HeartMonitor.period={HEARTBEAT_MS}",
                   f"--HeartMonitor.max_heartmonitor_misses={DEAD_AFTER_S * 1000 // HEARTBEAT_MS}")
# How long a local engine, started beside the controller, waits for its connection file.
URL_FILE_WAIT_S = 120
# How often a waiting client looks for results and rank 0's published progress (which comes
# at most every engine.PUBLISH_EVERY_S): the client runs on the cores the ranks decode on, and
# each look is work taken from them. A dying engine ends the wait at once (ExitWatch).
POLL_S = 0.05
_running: Cluster | None = None


class DistributedError(RuntimeError):
    """A distributed run failed; the message names the rank and what happened."""


class DistributedUsageError(DistributedError, ValueError):
    """Every rank refused the request (a bad name or value): the cluster keeps running."""


USER_ERRORS = ("ValueError", "TypeError", "ModelLoadError", "TruncatedModelWarning")


_alive = watchdog.alive  # the process exists and is not a zombie


def _on_this_host(engine: dict) -> bool:
    """Whether an engine record's pid is a process of this machine."""
    return engine.get("host") == socket.gethostname()


def mpi_defaults(iface: str | None) -> dict:
    """The MPI launcher on one host with the mpiexec of the ccl extra's impi-rt wheel (Intel
    MPI's hydra): processes forked locally, talking over `iface`. For several hosts, pass
    launcher_config={"MPIEngineSetLauncher": {"mpi_args": ["-hosts", "a,b", "-iface", "eth0"]}}."""
    from pathlib import Path

    mpiexec = Path(sys.prefix) / "bin" / "mpiexec"
    args = ["-bootstrap", "fork"] + (["-iface", iface] if iface else [])
    return {"mpi_cmd": [str(mpiexec) if mpiexec.is_file() else "mpiexec"], "mpi_args": args}


class Cluster:
    def __init__(self, n: int = 2, *, backend: str = "gloo", threads_per_rank: int = 1, pin: bool = False,
                 launcher: str = "local", timeout_s: float = 30.0, oversubscribe: bool = False,
                 shm_capacity_mb: float = 64.0, ip: str = "127.0.0.1", iface: str | None = None,
                 launcher_config: dict | None = None):
        cpus = len(os.sched_getaffinity(0))
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ranks (-n) must be a positive integer, got {n!r}")
        record = backend_record(backend)
        if record.unavailable() is not None:
            raise ValueError(record.unavailable())
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
        if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be a positive integer, got {threads_per_rank!r}")
        if n * threads_per_rank > cpus and not oversubscribe:
            raise ValueError(f"{n} ranks x {threads_per_rank} threads need {n * threads_per_rank} CPUs but this "
                             f"process may use {cpus}; use fewer, or pass oversubscribe=True (--oversubscribe)")
        if record.one_host and launcher not in ("local", "mpi"):
            raise ValueError(f"the {backend} backend needs every rank on this host: use launcher='local' (or 'mpi' "
                             f"on one host)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.n, self.backend, self.threads_per_rank, self.pin = n, backend, threads_per_rank, pin
        self.launcher, self.timeout_s, self.ip = launcher, timeout_s, ip
        # The interface the ranks talk over: loopback on one host; on several, the one they share.
        self.iface = iface or ("lo" if launcher in ("local", "mpi") else None)
        self.launcher_config = launcher_config or {}  # e.g. {"SSHEngineSetLauncher": {"engines": {...}}}
        self.shm_capacity = shm_capacity_bytes(shm_capacity_mb)
        # --pin: each rank's CPUs and NUMA node (workbench.hw.topology: sockets first, then SNC
        # nodes, whole cores before SMT siblings); the engine binds its memory to that node
        placement = place_ranks(read_topology(), n, threads_per_rank) if pin else None
        self.cpus = [p.cpus for p in placement] if placement else [None] * n
        self.nodes = [p.node for p in placement] if placement else [None] * n
        self.ipp_cluster = self.client = None
        self.engines: list[dict] = []
        self.shm_path = None
        self.model: DistributedModel | None = None
        # The process that owns what the cluster creates here (workbench.distributed.watchdog):
        # started before anything else, so no process or file of the cluster is ever without one
        self._watchdog: watchdog.Watchdog | None = None
        self.watchdog_log = None
        self.cluster_id = None  # ipyparallel's; every process it launches carries it (watchdog.MARK)

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        global _running
        if _running is not None:
            raise DistributedError("a cluster is already running (%distributed stop, or cluster.stop(), first)")
        import ipyparallel as ipp

        _running = self
        import atexit

        atexit.register(self.stop)  # a script or kernel that exits without stopping leaves no engines behind
        try:
            from traitlets.config import Config

            config = Config(self.launcher_config)
            if self.launcher == "mpi" and "MPIEngineSetLauncher" not in self.launcher_config:
                config.MPIEngineSetLauncher = Config(mpi_defaults(self.iface))
            env = backend_record(self.backend).launch_env(self)  # given to the engines when they start
            if self.launcher != "local":
                # Engines started through ssh / mpi / slurm begin with that launcher's environment,
                # not this process's: the workbench's own settings (the cache of built kernels and
                # measured peaks, WORKBENCH_CACHE_DIR) travel with them.
                env = {**{k: v for k, v in os.environ.items() if k.startswith("WORKBENCH_")}, **env}
            if self.launcher == "ssh":
                ssh = config.SSHEngineSetLauncher
                if "remote_python" not in ssh:  # the same interpreter, where the hosts share the install
                    ssh.remote_python = sys.executable
            if env:
                config.BaseLauncher.environment = {**config.BaseLauncher.get("environment", {}), **env}
            # Local engines start beside the controller, importing torch while it starts
            # (engine_main), and read its connection file when it appears. Other launchers
            # start theirs once the controller is up, and hand them its connection details in
            # $IPP_CONNECTION_INFO (ipyparallel's 1 s pause before that is not needed: delay=0).
            overlap = self.launcher == "local"
            if overlap:
                local = config.LocalEngineSetLauncher
                local.engine_cmd = [sys.executable, "-m", "workbench.distributed.engine_main"]
                local.engine_args = [*local.get("engine_args", []), f"--IPEngine.wait_for_url_file={URL_FILE_WAIT_S}"]
            import uuid

            self.cluster_id = f"workbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.ipp_cluster = ipp.Cluster(n=self.n, engines=self.launcher, controller_ip=self.ip, log_level=40,
                                           config=config, controller_args=list(CONTROLLER_ARGS), delay=0,
                                           send_engines_connection_env=not overlap, cluster_id=self.cluster_id)
            self._start_watchdog()  # before the first process or file exists
            self.client = self.ipp_cluster.start_and_connect_sync(activate=False)
            self.client.wait_for_engines(self.n, timeout=120)
            try:  # %px / %%px on these engines, for power users in IPython
                from IPython import get_ipython

                if get_ipython() is not None:
                    self.client.activate()
            except ImportError:
                pass
            ids = sorted(self.client.ids)[:self.n]
            self.engine_ids = ids
            self._gather([self.client[eid].apply_async(engine.prepare, self.threads_per_rank, self.cpus[rank],
                                                       self.backend, self.nodes[rank]) for rank, eid in enumerate(ids)],
                         "building the kernels")
            rendezvous = backend_record(self.backend).rendezvous(self, ids)
            ars = [self.client[eid].apply_async(engine.setup, rank, self.n, self.backend, rendezvous, self.timeout_s)
                   for rank, eid in enumerate(ids)]
            self.engines = self._gather(ars, "joining the collective")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_watchdog(self) -> None:
        """The watchdog of this cluster (workbench.distributed.watchdog): it ends the processes
        carrying the cluster's id and removes its files, ipyparallel's connection files and
        logs and this client's shm segments, when stop() asks or when this process dies."""
        from workbench.cache import cache_dir
        from workbench.distributed.comm import SHM_DIR, SHM_PREFIX

        profile = self.ipp_cluster.profile_dir
        patterns = [os.path.join(profile, "security", f"*{self.cluster_id}*"),
                    os.path.join(profile, "log", f"*{self.cluster_id}*"),
                    str(SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-*")]  # one cluster at a time per client
        self.watchdog_log = cache_dir() / "distributed" / f"watchdog-{os.getpid()}.log"
        self._watchdog = watchdog.Watchdog(self.cluster_id, patterns, self.watchdog_log).start()

    def stop(self, *, kill: bool = False) -> None:
        """Stop the engines and the controller, also after a failure; idempotent. kill=True
        (a rank died) SIGKILLs this host's engines first: the others may sit in a collective
        waiting for the dead one, where no signal handler runs until the collective's timeout.
        The polite part is here; what it leaves (a process that ignored it, the segment, the
        connection files) the watchdog removes before this returns."""
        global _running
        if kill:
            watchdog.signal_all([e["pid"] for e in self.engines if _on_this_host(e) and _alive(e["pid"])],
                                signal.SIGKILL)
        if self.client is not None:
            if not kill:
                self._close_communicators()
                self._shut_engines_down()
            try:
                self.client.close()
            except Exception:
                pass
        if self.ipp_cluster is not None:
            try:
                self.ipp_cluster.stop_cluster_sync()
            except Exception:
                pass
        # An engine's nanny normally exits with its engine, but one was found in zmq's
        # Context.term for good after its engine and the controller had gone (in CI,
        # 2026-12-06): the watchdog ends whatever still carries the cluster's id.
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        self.client = self.ipp_cluster = None
        self.model = None
        if _running is self:
            _running = None

    def _shut_engines_down(self, timeout_s: float = 3.0) -> None:
        """Ask every engine to exit and wait until the controller has seen them go (at most
        timeout_s). The launchers' own stop then finds nothing left to signal: otherwise it
        sends SIGTERM and waits for each engine (over ssh for the SSH launcher, a connection
        per command), and a request sent just before the client closes is dropped unsent."""
        try:
            self.client.shutdown(targets=self.engine_ids, block=False)
        except Exception:
            return
        deadline = time.monotonic() + timeout_s
        while set(self.engine_ids) & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _close_communicators(self, timeout_s: float = 5.0) -> None:
        """Ask every live engine to close its communicator (gloo's process group, the shm
        mapping, oneCCL's communicator) before the engines are stopped; an engine that is dead
        or does not answer within timeout_s is stopped without it."""
        try:
            ars = [self.client[eid].apply_async(engine.teardown) for eid in self.engine_ids]
        except Exception:
            return
        deadline = time.monotonic() + timeout_s
        for ar in ars:
            try:
                ar.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass

    @property
    def running(self) -> bool:
        return self.client is not None

    def status(self) -> dict:
        return {"running": self.running, "ranks": self.n, "backend": self.backend, "launcher": self.launcher,
                "threads_per_rank": self.threads_per_rank, "pin": self.pin, "timeout_s": self.timeout_s,
                "engines": self.engines, "environment": self.environment(),
                "model": self.model.description if self.model else None,
                "options": asdict(self.model.options) if self.model else None}

    def environment(self) -> dict:
        """The backend's settings the workbench applies on every engine."""
        return backend_record(self.backend).settings(self)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<workbench.Cluster {self.n} ranks, {self.backend}, {self.threads_per_rank} thread(s) each, {state}>"

    # -- running things on every engine ------------------------------------------------------
    def _require(self):
        if not self.running:
            raise DistributedError("the cluster is not running (start it with %distributed start or wb.cluster())")

    def _dead_ranks(self) -> list[str]:
        # an engine on another machine is watched by the controller's heartbeat instead: its
        # pid means nothing here
        return [f"rank {e['rank']} (engine pid {e['pid']})" for e in self.engines
                if _on_this_host(e) and not _alive(e["pid"])]

    def _gather(self, ars, what: str, poll: Callable[[], None] | None = None) -> list:
        """Wait for every engine's result; a dead engine or a failed rank stops the cluster and
        raises DistributedError naming the rank. Results and published progress are looked
        at every POLL_S; an engine of this host that exits ends the wait at once."""
        with watchdog.ExitWatch([e["pid"] for e in self.engines if _on_this_host(e)]) as exits:
            while not all(ar.ready() for ar in ars):
                if poll is not None:
                    poll()
                if exits.wait(POLL_S):
                    dead = self._dead_ranks()
                    self.stop(kill=True)
                    raise DistributedError(f"{', '.join(dead)} died while {what}; the cluster was stopped")
        if poll is not None:
            poll()
        results, failures = [], []
        for rank, ar in enumerate(ars):
            try:
                results.append(ar.get())
            except Exception as e:  # ipyparallel wraps the engine's exception
                failures.append((rank, getattr(e, "ename", type(e).__name__), getattr(e, "evalue", str(e))))
        if failures and len(failures) == len(ars) and all(name in USER_ERRORS for _, name, _ in failures):
            raise DistributedUsageError(failures[0][2])  # the same mistake on every rank: say it once
        if failures:
            rank, name, value = failures[0]
            self.stop()
            raise DistributedError(f"rank {rank} failed while {what}: {name}: {value}; the cluster was stopped")
        return results

    def run(self, fn, *args, what: str = "running", poll=None) -> list:
        """fn(*args) on every engine at once; the results by rank."""
        self._require()
        ars = [self.client[eid].apply_async(fn, *args) for eid in self.engine_ids]
        return self._gather(ars, what, poll), ars

    def load_model(self, name: str = "smollm2-135m", *, options: TPOptions | None = None, **kwargs):
        options = options or TPOptions()
        infos, _ = self.run(engine.load, name, kwargs, asdict(options), what=f"loading {name}")
        self.model = DistributedModel(self, infos, options)
        self.model.load_args = {"name_or_path": name, **kwargs}
        return self.model

    def comm_latency(self, sizes: list[int], repeats: int = 20) -> list[dict]:
        results, _ = self.run(engine.comm_latency, sizes, repeats, what="timing all-reduce")
        return results[0]

    def step_collective_latency(self, sizes: list[int], calls: int = 1000, repeats: int = 5,
                                stream_bytes: int = 0) -> list[dict]:
        """The fused step's own all-reduce, `calls` per round, in a row or each after the ranks
        have streamed stream_bytes (engine.step_collective_latency)."""
        results, _ = self.run(engine.step_collective_latency, sizes, calls, repeats, stream_bytes,
                              what="timing the step's all-reduce")
        return results[0]


class DistributedModel(SwitchProperties):
    """A model sharded over a cluster's engines, with the Model API."""

    def __init__(self, cluster: Cluster, infos: list[dict], options: TPOptions):
        self.cluster = cluster
        self.shards = [{k: v for k, v in i.items() if k not in ("config", "tokenizer")} for i in infos]
        self.config = infos[0]["config"]
        self.tokenizer = infos[0]["tokenizer"]
        self.weight_dtype = infos[0]["weight_dtype"]
        self.bytes_per_weight = infos[0]["bytes_per_weight"]  # the cost model's, as rank 0's shard has them
        self.description = f"{infos[0]['description']}, tensor parallel over {cluster.n} ranks ({cluster.backend})"
        self.options = options
        self.switches = Switches()
        self._switch_listeners: list[Callable] = []
        self.load_args: dict = {}  # Cluster.load_model's name and arguments

    # -- switches ------------------------------------------------------------------------
    def on_switch(self, listener) -> None:
        self._switch_listeners.append(listener)

    def _set_switches(self, switches: Switches) -> None:
        """Every rank takes the new switches (validated here first, as Switches: a one-line
        error, not a remote traceback); attention / kv_cache / kv_kernel / step come from
        SwitchProperties."""
        from dataclasses import asdict

        if switches != self.switches:
            self.cluster.run(engine.set_switches, asdict(switches), what="switching")
            self.switches = switches
            for listener in list(self._switch_listeners):
                listener(switches)

    def set_options(self, **changes) -> TPOptions:
        """token_broadcast / lm_head / zero_copy / kv_handoff / topk for the next generations
        (a mixture's `experts` split is fixed at load)."""
        from dataclasses import replace

        options = replace(self.options, **changes)  # validated here first
        if options.experts != self.options.experts:
            raise ValueError(f"experts={options.experts!r}: a mixture's split is fixed at load (it decides which "
                             f"weights each rank keeps); load again with options=TPOptions(experts="
                             f"{options.experts!r})")
        self.cluster.run(engine.set_options, changes, what="setting options")
        self.options = options
        return options

    def __repr__(self) -> str:
        o = self.options
        return (f"<workbench.DistributedModel {self.description}: {self.config.n_layers} layers, attention="
                f"{self.attention}, kv_cache={self.switches.kv_text}, token_broadcast={o.token_broadcast}, "
                f"lm_head={o.lm_head}, zero_copy={'on' if o.zero_copy else 'off'}, "
                f"kv_handoff={'on' if o.kv_handoff else 'off'}>")

    # -- inference ---------------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 32, *, attention: str | None = None,
                 kv_cache: str | None = None, kv_kernel: str | None = None, step: str | None = None,
                 temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop_at_eos: bool = True, record: bool = True,
                 on_token=None, on_step=None, check_topk: bool | None = None):
        """Model.generate on every rank at once (see workbench.runtime.model); rank 0's
        result, with `topk_log` (check_topk: per step, whether the distributed top-1 is the
        true one and the top-k overlap)."""
        check_topk = self.options.check_topk if check_topk is None else check_topk
        if self.options.lm_head != "gather" and temperature > 0 and (top_k is None or top_k > self.options.topk):
            raise ValueError(f"sampling with temperature > 0 needs top_k <= {self.options.topk} with "
                             f"lm_head={self.options.lm_head} (only that many candidates are exchanged); pass "
                             f"top_k, or use lm_head='gather'")
        sw = self.switches.overridden(attention, kv_cache, kv_kernel, step)  # checked before the ranks see it
        kwargs = dict(max_new_tokens=max_new_tokens, attention=sw.attention, kv_cache=sw.kv_cache,
                      kv_kernel=sw.kv_kernel, step=sw.step, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, stop_at_eos=stop_at_eos, record=record)
        seen = {"ids": 0, "chunks": 0}
        live = Timings()
        ars: list = []

        def poll():
            if not ars:
                return
            data = ars[0].data or {}  # rank 0's published chunks (engine.generate), merged
            count = data.get("chunks", 0)  # a chunk's keys arrive in the message that counts it
            for n in range(seen["chunks"], count):
                for token_ids in data[f"ids{n}"]:
                    if on_token:
                        on_token(seen["ids"], token_ids)
                    seen["ids"] += 1
                for rec in data[f"steps{n}"]:
                    live.steps.append(rec)
                    if on_step:
                        on_step(rec, live)
            seen["chunks"] = count

        self.cluster._require()
        ars.extend(self.cluster.client[eid].apply_async(engine.generate, prompt, kwargs, check_topk)
                   for eid in self.cluster.engine_ids)
        results = self.cluster._gather(ars, "generating", poll)
        out = results[0]
        if out.timings and all(r is not None for r in results[1:]):  # every rank's communication, per step
            for i, rec in enumerate(out.timings.steps):
                rec.rank_comm_s = [rec.comm_s] + [r["comm_s"][i] for r in results[1:]]
                rec.rank_comm_wait_s = [rec.comm_wait_s] + [r["comm_wait_s"][i] for r in results[1:]]
        return out

    def logits(self, token_ids):
        results, _ = self.cluster.run(engine.logits, token_ids, what="computing logits")
        return results[0]


def cluster(n: int = 2, **kwargs) -> Cluster:
    """Start a cluster of n ranks (see Cluster for the options) and return it."""
    return Cluster(n, **kwargs).start()


def running() -> Cluster | None:
    return _running
