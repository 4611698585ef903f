"""What runs inside each ipyparallel engine: one engine is one rank. The client
(workbench.distributed.cluster) calls these functions on every engine at once (SPMD), one
request per generation, never one per token; the state of the rank lives in STATE.

Rank 0 streams its progress while a generation runs through ipyparallel's datapub: the
token ids and step records that are new since its last message, as numbered chunks, at most
every PUBLISH_EVERY_S (the first token at once) and once at the end; the client merges what
arrives (dict.update) and reads the chunks in order (the client's live figures draw the
records). Publishing every record at every token pickled a list growing with the generation
on the ranks' critical path.
"""

from __future__ import annotations

import os
import socket
import time

import torch

STATE: dict = {}
# Rank 0 publishes its new tokens and step records at most this often (the first token at
# once). Each message is work for this engine's I/O thread, the controller and the client, on
# the cores the ranks decode on: published every step, it cost rank 0 about a tenth of a
# bundled-model token on a 2-core host, which the other ranks then waited for.
PUBLISH_EVERY_S = 0.1


def address_and_port(iface: str | None) -> tuple[str, int]:
    """This engine's address (of `iface` when given) and a free TCP port on it: the gloo
    rendezvous of a multi-machine run is hosted by rank 0."""
    import fcntl
    import struct

    if iface:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCGIFADDR
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface.encode()[:15]))
            host = socket.inet_ntoa(packed[20:24])
    else:
        host = socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def make_comm(backend: str, rank: int, world: int, timeout_s: float, rendezvous: dict):
    from workbench.distributed.backends import backend as record

    return record(backend).connect(rank, world, timeout_s, rendezvous)


def prepare(threads: int, cpus: list[int] | None, backend: str, node: int | None = None) -> None:
    """Pin (if asked): CPUs, and memory bound to their NUMA node (MPOL_BIND, before the thread
    pool starts, so its threads inherit it; a refusal is kept and shown by %distributed status,
    not raised). Then the thread count, the kernels and the backend's binding."""
    from workbench.hw.topology import bind_memory

    if cpus:
        os.sched_setaffinity(0, cpus)
    STATE["memory_binding"] = None
    if node is not None:
        try:
            bind_memory([node])
        except OSError as e:
            STATE["memory_binding"] = f"not bound to node {node}: {e}"
    torch.set_num_threads(threads)
    from workbench.kernels import native

    native.ext  # compile (or load) the kernels before the collective's clock starts
    from workbench.distributed.backends import backend as record

    record(backend).prepare()


def ccl_address(world: int, iface: str | None) -> bytes:
    from workbench.distributed import ccl

    return ccl.main_kvs_address(0, world, iface)


def setup(rank: int, world: int, backend: str, rendezvous: dict, timeout_s: float) -> dict:
    """Join the collective (every rank at once)."""
    from workbench.hw.topology import memory_policy, read_topology

    binding = STATE.get("memory_binding")
    STATE.clear()
    STATE.update(rank=rank, world=world, backend=backend,
                 comm=make_comm(backend, rank, world, timeout_s, rendezvous), model=None)
    cpus = sorted(os.sched_getaffinity(0))
    topology = read_topology()
    try:
        mode, nodes = memory_policy()
        memory = binding or (f"{mode} {nodes}" if nodes else mode)
    except OSError as e:
        memory = f"unknown: {e}"
    return {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "threads": torch.get_num_threads(),
            "cpus": cpus, "nodes": sorted({topology.node_of(c) for c in cpus}), "memory_policy": memory}


def load(name: str, kwargs: dict, options: dict) -> dict:
    """Load the model from its name or path, keeping this rank's shard only."""
    import workbench as wb
    from workbench.distributed.tp import TensorParallel, TPOptions

    STATE["model"] = None
    rank, comm = STATE["rank"], STATE["comm"]
    tp = TensorParallel(comm, TPOptions(**options))
    model = wb.load_model(name, parallel=tp, **kwargs)
    STATE["model"] = model
    p = tp.plan
    return {"rank": rank, "description": model.description, "weight_bytes": model.llama.weight_bytes,
            "kv_heads": p.kv_heads, "q_heads": p.q_heads, "q_offset": p.q_offset, "kv_handoff": p.kv_handoff,
            "ffn": p.ffn, "vocab": p.vocab, "experts": p.experts, "expert_split": p.expert_split,
            "config": model.config, "tokenizer": model.tokenizer if rank == 0 else None,
            "weight_dtype": model.llama.weight_dtype, "bytes_per_weight": model.llama.bytes_per_weight()}


def _model():
    model = STATE.get("model")
    if model is None:
        raise RuntimeError("no model loaded on this engine")
    return model


def set_options(options: dict) -> dict:
    from dataclasses import asdict, replace

    tp = _model().llama.parallel
    tp.options = replace(tp.options, **options)  # validated by TPOptions
    return asdict(tp.options)


def set_switches(switches: dict) -> None:
    from workbench.model.switches import Switches

    _model()._set_switches(Switches(**switches))


def generate(prompt, kwargs: dict, check_topk: bool):
    """One generation on this rank; rank 0 returns the result and streams its progress."""
    from dataclasses import replace

    from workbench.distributed.comm import CommError
    from workbench.kernels import native

    model, rank = _model(), STATE["rank"]
    tp = model.llama.parallel
    saved = tp.options
    tp.options = replace(saved, check_topk=check_topk)
    tp.topk_log.clear()
    hooks = {}
    if rank == 0:
        from ipyparallel.datapub import publish_data

        state = {"ids": [], "last": 0.0, "steps": [], "chunks": 0}

        def publish(now_or_never: bool = False) -> None:
            """What is new since the last publish, as chunk n of each list: the client merges
            what is published into one dict (dict.update), so the chunks accumulate there
            and each message carries only its own (resending the lists whole made every
            message longer than the last: a long generation's records, again and again)."""
            now = time.perf_counter()
            if now_or_never or now - state["last"] >= PUBLISH_EVERY_S:
                state["last"] = now
                n = state["chunks"]
                publish_data({f"ids{n}": state["ids"], f"steps{n}": state["steps"], "chunks": n + 1})
                state.update(ids=[], steps=[], chunks=n + 1)

        def on_token(step, ids):
            state["ids"].append(list(ids))
            publish()

        def on_step(record, timings):
            state["steps"].append(record)

        hooks = {"on_token": on_token, "on_step": on_step}
    try:
        out = model.generate(prompt, **kwargs, **hooks)
    except native.ext.CollectiveError as e:  # the fused step's shm or oneCCL all-reduce failed:
        raise CommError(str(e)) from None  # a CommError, as every other collective's failure
    finally:
        tp.options = saved
    if rank != 0:  # rank 0 returns the generation; the others, what their own records add to it
        if not out.timings:
            return None
        return {"comm_s": [rec.comm_s for rec in out.timings.steps],
                "comm_wait_s": [rec.comm_wait_s for rec in out.timings.steps]}
    publish(now_or_never=True)  # what the last throttled publish left out
    out.topk_log = list(tp.topk_log)
    return out


def logits(token_ids) -> torch.Tensor | None:
    """Every position's full logits (the LM head's gather mode for this call), on rank 0."""
    from dataclasses import replace

    model = _model()
    tp = model.llama.parallel
    saved = tp.options
    tp.options = replace(saved, lm_head="gather", check_topk=False)
    try:
        out = model.logits(token_ids)
    finally:
        tp.options = saved
    return out if STATE["rank"] == 0 else None


def comm_latency(sizes: list[int], repeats: int) -> list[dict] | None:
    """All-reduce seconds per size (floats), after a barrier each, for the alpha-beta fit."""
    comm = STATE["comm"]
    rows = []
    for n in sizes:
        x = comm.buffer((n,))
        x.fill_(1.0)
        samples = []
        for _ in range(repeats + 1):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce_(x)
            samples.append(time.perf_counter() - t0)
        rows.append({"floats": n, "bytes": 4 * n, "seconds": samples[1:]})
    return rows if STATE["rank"] == 0 else None


def step_collective_latency(sizes: list[int], calls: int, repeats: int, stream_bytes: int = 0) -> list[dict] | None:
    """The all-reduce the fused step calls natively (its StepCollective, the same object the
    step gets), `calls` per round, `repeats` rounds per size (floats): each round's tenth-
    percentile call in seconds, a call where the ranks arrived together, so its own cost and
    not a wait for the other rank (after a sweep the ranks arrive some microseconds apart,
    more or less from call to call). stream_bytes 0: the calls in a row with nothing between,
    the least a step's all-reduces can cost; else each call after every rank has read that
    many bytes of its own memory, as the step's kernels stream weights between two
    all-reduces."""
    import statistics

    from workbench.kernels import native

    collective = STATE["comm"].step_collective()
    native.ext.time_collective(collective, sizes[0], calls)  # warm-up (and oneCCL's cached operation)
    rows = [{"floats": n, "bytes": 4 * n, "stream_bytes": stream_bytes,
             "seconds": [statistics.quantiles(native.ext.time_collective(collective, n, calls, stream_bytes), n=10)[0]
                         for _ in range(repeats)]} for n in sizes]
    return rows if STATE["rank"] == 0 else None


def teardown() -> None:
    comm = STATE.get("comm")
    STATE.clear()
    if comm is not None:
        comm.close()
