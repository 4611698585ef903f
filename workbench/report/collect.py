"""What goes into a report: the machine, the software, and the measurements recorded in
this session, as plain JSON-able dicts (see workbench/report/__init__.py)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

from workbench.hw.load import machine_load

SCHEMA_VERSION = 1
PACKAGES = ("torch", "numpy", "gguf", "tokenizers", "ipython", "ipywidgets", "plotly", "ipyparallel", "transformers",
            "oneccl-cpu", "cpu-llm-workbench")
_log: list[dict] = []


def _stats(samples: list[float]) -> dict:
    """median, min, max and p90 of raw samples (kept beside them)."""
    if not samples:
        return {"samples": [], "median": None, "min": None, "max": None, "p90": None}
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"samples": samples, "median": statistics.median(samples), "min": ordered[0], "max": ordered[-1],
            "p90": p90}


@lru_cache(maxsize=8)
def _sha256(path: str) -> str | None:
    p = Path(path)
    if not p.is_file():
        return None  # a directory (Hugging Face) or missing: no single file to hash
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(model) -> dict:
    cfg = model.config
    llama = getattr(model, "llama", None)
    source = getattr(llama, "source", None)
    return {"description": model.description, "name": cfg.name, "source": source,
            "sha256": _sha256(source) if source else None, "parameters": cfg.parameter_count(),
            "weight_dtype": model.weight_dtype, "config": cfg.as_dict(),
            "weight_formats": llama.weight_formats if llama is not None else None,
            "weight_bytes": llama.weight_bytes if llama is not None else None,
            "ranks": getattr(getattr(model, "cluster", None), "n", 1)}


def _gemm_engine() -> str | None:
    """Our GEMM's engine in force (workbench.kernels.gemm_engine: with "amx_int8", per-row int8
    weights run W8A8 and the rest the bf16 tiles)."""
    from workbench import kernels

    return kernels.gemm_engine()  # a generation ran, so the kernels are built


def _tp_config(model) -> dict | None:
    """A tensor-parallel model's cluster and the paper's switches (None for one process)."""
    from dataclasses import asdict

    cluster = getattr(model, "cluster", None)
    if cluster is None:
        return None
    return {"ranks": cluster.n, "backend": cluster.backend, "threads_per_rank": cluster.threads_per_rank,
            "pin": cluster.pin, "launcher": cluster.launcher, **asdict(model.options)}


def generation_entry(result, model=None, command: str | None = None, prompt: str | None = None) -> dict:
    """A GenerationResult as a report entry: raw per-step samples and their statistics."""
    import torch

    t = result.timings
    decode, prefill = t.decode_steps, t.prefill
    batch = len(result.prompt_token_ids)
    entry = {
        "kind": "generation", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model_identity(model) if model is not None else None,
        "workload": {"prompt": prompt, "prompt_tokens": [len(p) for p in result.prompt_token_ids], "batch": batch,
                     "new_tokens": len(decode) + 1 if prefill else len(decode), "threads": torch.get_num_threads(),
                     "attention": result.switches.attention, "kv_cache": result.switches.kv_cache,
                     "kv_kernel": result.switches.kv_kernel, "step": result.step_path,
                     "sampling": result.sampling, "gemm_engine": _gemm_engine(),
                     "prompt_sha256": hashlib.sha256(json.dumps(result.prompt_token_ids).encode()).hexdigest(),
                     "tensor_parallel": _tp_config(model)},
        "prefill_ms": 1e3 * prefill.total_s if prefill else None,
        "time_to_first_token_ms": 1e3 * t.time_to_first_token_s,
        "decode_step_ms": _stats([1e3 * s.total_s for s in decode]),
        "decode_tokens_per_s": t.decode_tokens_per_s,
        "decode_gbps": t.gbps("decode"), "decode_gflops": t.gflops("decode"),
        "decode_bytes_per_step": statistics.mean(s.bytes_read for s in decode) if decode else None,
        "decode_flops_per_step": statistics.mean(s.total_flops for s in decode) if decode else None,
        "decode_comm_ms_per_step": statistics.median(1e3 * s.comm_s for s in decode) if decode else None,
        "decode_wake_ms_per_step": t.wake_ms if decode else None,
        "per_layer_ms": {"prefill": t.per_layer("prefill"), "decode": t.per_layer("decode")},
        "text": result.text,
        "command": command,
        "load": machine_load(),
    }
    if getattr(result, "topk_log", None):
        entry["topk_checks"] = result.topk_log
    if t.expert_load():  # a mixture of experts: tokens routed to each expert of each layer
        entry["expert_load"] = t.expert_load()
    if model is not None and decode:
        entry["predicted"] = prediction_entry(model, result)
    return entry


def prediction_entry(model, result) -> dict | None:
    """The cost model's view of a run (workbench.analysis.costmodel): per part predicted vs
    measured with the ratio and, outside 1.5x, why; the per-layer prediction for figures."""
    from workbench.analysis.costmodel import predict_run

    try:
        p = predict_run(model, result)
    except (ValueError, RuntimeError) as e:
        return {"error": str(e)}
    return {"hardware": {"name": p.hardware.name, "bandwidth_gbps": p.hardware.bandwidth_gbps,
                         "fma_gflops": p.hardware.fma_gflops, "comm_alpha_us": p.hardware.comm_alpha_us,
                         "comm_beta_gbps": None if p.hardware.comm_beta_gbps == float("inf") else p.hardware.comm_beta_gbps,
                         "notes": p.hardware.notes},
            "decode_kv_len": p.decode_kv_len, "parts": p.compare(result.timings),
            "per_layer_ms": p.per_layer_ms(),
            "utilisation": p.utilisation(result.timings)}


def record(item, model=None, command: str | None = None, prompt: str | None = None, kind: str | None = None) -> dict:
    """Add a measurement to this session's log: a GenerationResult, or a list of rows
    (AblationRow objects or dicts; kind "ablation", "tp_ablation", "peers", "kv_quality", "weight_quality",
    "benchmark"). Returns the entry."""
    from dataclasses import asdict, is_dataclass

    if hasattr(item, "timings"):
        entry = generation_entry(item, model, command, prompt)
    elif isinstance(item, list):
        rows = [asdict(r) if is_dataclass(r) else dict(r) for r in item]
        entry = rows_entry(rows, kind or ("tp_ablation" if rows and "ranks" in rows[0] else "ablation"), command,
                           model_identity(model) if model is not None else None)
    else:
        raise TypeError(f"record() takes a GenerationResult or a list of ablation rows, got {type(item).__name__}")
    _take_session_measurements()
    _log.append(entry)
    return entry


def rows_entry(rows: list[dict], kind: str, command: str | None, model: dict | None = None,
               when: str | None = None, load: dict | None = None) -> dict:
    """A log entry of rows (an ablation, a serve-bench run, ...); load: the machine's when they
    were measured (default: now)."""
    return {"kind": kind, "time": when or time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": model, "rows": rows,
            "command": command, "load": load or machine_load()}


def add_entry(entry: dict) -> dict:
    """Add an entry already in the report's shape (a profile, a peers run read back)."""
    if not isinstance(entry, dict) or "kind" not in entry or "time" not in entry:
        raise TypeError("add_entry() takes a dict with at least 'kind' and 'time'")
    entry.setdefault("load", machine_load())
    _take_session_measurements()
    _log.append(entry)
    return entry


def _take_session_measurements() -> None:
    """The panel's runs and serve-bench rows (workbench.runtime.session), in the order they
    were measured."""
    from workbench.runtime.session import current

    while current.measured:
        m = current.measured.pop(0)
        if "rows" in m:  # Session.add_rows
            entry = rows_entry(m["rows"], m["kind"], m["command"], when=m["time"], load=m["load"])
        else:
            entry = generation_entry(m["result"], m["model"], m["command"], m["prompt"])
            entry["time"], entry["load"] = m["time"], m["load"]  # as it was when the panel measured
        _log.append(entry)


def recorded() -> list[dict]:
    _take_session_measurements()
    return list(_log)


def clear() -> None:
    from workbench.runtime.session import current

    current.measured.clear()
    _log.clear()


def _git() -> dict:
    root = Path(__file__).resolve().parents[2]

    def git(*args):
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    return {"commit": commit, "dirty": bool(git("status", "--porcelain")) if commit else None}


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return len(nodes) or 1


def _sockets() -> int:
    ids = set()
    for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/physical_package_id"):
        try:
            ids.add(p.read_text().strip())
        except OSError:
            pass
    return len(ids) or 1


def machine() -> dict:
    import torch

    from workbench.hw.machine import machine_info
    from workbench.kernels.peaks import measured_peaks
    from workbench.model.loaders import available_memory_bytes

    m = machine_info().as_dict()
    ram = None
    try:
        ram = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal:"))) * 1024
    except (OSError, StopIteration):
        pass
    return {**m, "sockets": _sockets(), "numa_nodes": _numa_nodes(), "cpus_usable": len(os.sched_getaffinity(0)),
            "threads_used": torch.get_num_threads(), "ram_bytes": ram, "available_bytes": available_memory_bytes(),
            "load": machine_load(),  # when the report was written; each entry has its own
            "peaks": {**measured_peaks().as_dict(),
                      "how": "triad: a[i] = b[i] + s c[i] over 3 x 256 MiB, 12 bytes per element, best of 5; "
                             "FMA: independent fp32 FMA chains in registers on every thread, best of 5 "
                             "(workbench.kernels.peaks)"}}


def frontend() -> str:
    """What ran the measurements: a Jupyter kernel (a notebook), an IPython terminal, another
    IPython shell, or plain Python (a script, the CLI)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    kind = type(shell).__name__ if shell is not None else None
    return {"ZMQInteractiveShell": "a Jupyter kernel (ipykernel)", "TerminalInteractiveShell": "an IPython terminal",
            None: "plain Python"}.get(kind, f"an IPython shell ({kind})")


def software() -> dict:
    from workbench.kernels import build_info

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info = build_info()
    return {"python": platform.python_version(), "executable": sys.executable, "frontend": frontend(),
            "platform": platform.platform(),
            "compiler": info["compiler"], "flags": info["flags"], "kernels_isa": info["isa"],
            "gemm_tile": info["gemm_tile"], "gemm_engine": info["gemm_engine"],
            "prefill_attention": info["prefill_attention"], "amx_bf16": info["amx_bf16"],
            "packages": versions, "git": _git()}


def report_load(report: dict) -> dict | None:
    """A report's worst load: the busiest of its entries' (each recorded with its measurement),
    else the machine's when the report was written; None in a report made before loads were
    recorded."""
    loads = [e["load"] for e in report.get("entries", []) if e.get("load")] or \
        [(report.get("machine") or {}).get("load")]
    loads = [x for x in loads if x]
    if not loads:
        return None
    return {"loadavg": [max(x["loadavg"][i] for x in loads) for i in range(3)], "cpus": loads[0]["cpus"],
            "busy_elsewhere_cpus": max(x["busy_elsewhere_cpus"] for x in loads),
            "busy_processes": max(loads, key=lambda x: x["busy_elsewhere_cpus"])["busy_processes"]}


def build(entries: list[dict] | None = None, title: str = "Workbench report") -> dict:
    """The report as a dict: machine, software, the entries (default: this session's log)."""
    entries = recorded() if entries is None else entries
    return {"schema_version": SCHEMA_VERSION, "title": title, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(), "software": software(), "entries": entries,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "reproduce": [e["command"] for e in entries if e.get("command")]}
