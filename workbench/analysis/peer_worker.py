"""One inference engine in its own process, for workbench.analysis.peers: it loads once,
prints {"ready": ...} as a JSON line, then answers each request line

    {"prompt": [token ids], "new_tokens": N[, "batch": B]}

with {"prefill_ms", "decode_ms": [per token], "tokens": [greedy ids]} (or {"error": ...}).
Every engine does the same thing: the prompt in one forward pass (prefill, timed), then N - 1
greedy decode steps of one token each (each timed, argmax included), no stop at EOS. With a
batch B (workbench and llama.cpp), B prompts are decoded together as B sequences: the prompt
and B - 1 shifted copies (batch_prompts: different tokens, so a mixture of experts routes them
as it would different texts); each decode step makes B tokens (llama.cpp: B parallel sequences
of one context, its batched decode); "tokens" are the first sequence's.

    python -m workbench.analysis.peer_worker '{"engine": "llama.cpp", "path": "...", "threads": 2}'
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def batch_prompts(prompt: list[int], batch: int, vocab: int) -> list[list[int]]:
    """The B prompts of a batched run: the prompt itself, then copies with every token moved by
    1009 s (sequence s, modulo the vocabulary)."""
    return [[(t + 1009 * s) % vocab for t in prompt] for s in range(batch)]


def _workbench(spec: dict):
    import workbench as wb
    from workbench.runtime.threads import set_threads

    set_threads(spec["threads"])
    if spec.get("gemm_engine"):  # the bf16 GEMM's micro-kernel: "fma" to measure it against the tiles
        from workbench import kernels

        kernels.set_gemm_engine(spec["gemm_engine"])
    if spec.get("activation_bits"):  # decode's integer products: int16 (the default) or int8 activations
        from workbench import kernels

        kernels.set_block_activation_bits(spec["activation_bits"])
    model = wb.load_model(spec.get("model", "smollm2-135m"), dtype=spec.get("dtype", "fp32"),
                          max_batch=spec.get("max_batch", 1))
    model.attention, model.kv_cache = spec.get("attention", "slim"), spec.get("kv_cache", "fp16")

    from workbench.model.kv_formats import kv_format

    llama = model.llama
    head = llama.head_bytes(1)
    moe = llama.layers[0].router is not None
    kv_per_token = 2 * llama.n_kv_heads * kv_format(model.kv_cache).bytes_per_vector(llama.cfg.head_dim, llama.n_kv_heads)
    windows = llama.cfg.windows or (0,) * llama.cfg.n_layers

    def kv_tokens(length: float) -> float:  # keys every layer reads: a windowed layer at most its window
        return sum(min(w, length) if w else length for w in windows)

    def step_weights() -> int:  # what the last step read: a mixture only its routed experts
        return sum(layer.read_bytes() for layer in llama.layers) + head

    def run(prompt: list[int], n: int, batch: int = 1) -> dict:
        stamps, read = [], []  # wall time at each token: the gaps are decode steps, sampling included

        def on_token(step, ids):
            stamps.append(time.perf_counter())
            if moe:  # the experts this step's tokens were routed to
                read.append(step_weights())

        out = model.generate(batch_prompts(prompt, batch, llama.cfg.vocab_size), max_new_tokens=n,
                             stop_at_eos=False, record=False, on_token=on_token)
        weights = statistics.mean(read[1:]) if moe and len(read) > 1 else step_weights()
        return {"prefill_ms": 1e3 * out.timings.time_to_first_token_s,
                "decode_ms": [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])], "tokens": out.token_ids[0],
                # what a decode step reads, as the step records count it, at the run's middle step
                "decode_bytes_per_step": weights + batch * kv_per_token * kv_tokens(len(prompt) + n / 2)}

    return run, model.description


def _transformers(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from workbench.analysis.peers import hf_directory

    torch.set_num_threads(spec["threads"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.get("dtype", "fp32")]
    # The GGUF as transformers itself decodes it, saved once as a Hugging Face directory: loading
    # that takes a second where decoding the GGUF again takes tens.
    source = Path(spec["path"]) if spec.get("path") else None  # another model's GGUF; None: the bundled one
    hf = AutoModelForCausalLM.from_pretrained(str(hf_directory(source)), dtype=dtype, attn_implementation="sdpa").eval()

    import inspect

    # transformers 5 renamed past_key_values to cache
    key = "cache" if "cache" in inspect.signature(type(hf).forward).parameters else "past_key_values"

    @torch.inference_mode()
    def run(prompt: list[int], n: int) -> dict:
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = hf(torch.tensor([prompt]), **{key: cache}, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        prefill = time.perf_counter() - t0
        tokens, decode = [token], []
        for _ in range(n - 1):
            t0 = time.perf_counter()
            out = hf(torch.tensor([[token]]), **{key: cache}, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            decode.append(time.perf_counter() - t0)
            tokens.append(token)
        return {"prefill_ms": 1e3 * prefill, "decode_ms": [1e3 * s for s in decode], "tokens": tokens}

    return run, f"transformers {__import__('transformers').__version__}, {spec.get('dtype', 'fp32')}, sdpa attention"


def _llama_cpp(spec: dict):
    import llama_cpp
    import llama_cpp.llama_cpp as low
    import numpy as np

    from workbench.hw.machine import machine_info

    # llama.cpp's AMX matmul (ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36) segfaults on
    # the AMX hosts we have (gdb shows it; Q4_1 and Q8_0). On a CPU with AMX its extra weight
    # buffers are turned off, which also turns off its weight repacking; said in the row.
    amx = "amx_int8" in machine_info().flags
    if amx:
        default = low.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        low.llama_model_default_params = params

    kv = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[spec.get("kv", "f16")]
    llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=spec.get("n_ctx", 4096), n_batch=spec.get("n_ctx", 4096),
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], type_k=kv, type_v=kv,
                          flash_attn=spec.get("kv", "f16") != "f16", verbose=False)

    n_vocab = llm.n_vocab()

    def next_token() -> int:  # argmax of the last position's logits (llama.cpp keeps only those)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    batched = {}  # batch size -> (context, llama_batch): B parallel sequences, made on first use

    def run_batch(prompt: list[int], n: int, batch: int) -> dict:
        if batch not in batched:
            params = low.llama_context_default_params()
            params.n_ctx = batch * (len(prompt) + n + 16)
            params.n_batch = params.n_ubatch = max(512, batch * len(prompt))
            params.n_seq_max = batch
            params.n_threads = params.n_threads_batch = spec["threads"]
            params.type_k = params.type_v = kv
            ctx = low.llama_init_from_model(llm.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {batch} sequences")
            batched[batch] = (ctx, low.llama_batch_init(params.n_batch, 0, 1))
        ctx, b = batched[batch]
        low.llama_memory_clear(low.llama_get_memory(ctx), True)

        def decode(items) -> None:  # (token, position, sequence, want logits) each
            b.n_tokens = len(items)
            for i, (tok, pos, seq, out) in enumerate(items):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
                b.seq_id[i][0] = seq
            if low.llama_decode(ctx, b) != 0:
                raise RuntimeError("llama_decode failed")

        def argmax(i: int) -> int:
            return int(np.argmax(np.ctypeslib.as_array(low.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

        P = len(prompt)
        t0 = time.perf_counter()  # every sequence's prompt in one batch, each last position's logits
        decode([(tok, pos, s, pos == P - 1) for s, seq in enumerate(batch_prompts(prompt, batch, n_vocab))
                for pos, tok in enumerate(seq)])
        last = [argmax(s * P + P - 1) for s in range(batch)]
        prefill = time.perf_counter() - t0
        tokens, steps = [last[0]], []
        for step in range(n - 1):
            t0 = time.perf_counter()
            decode([(last[s], P + step, s, True) for s in range(batch)])
            last = [argmax(s) for s in range(batch)]
            steps.append(time.perf_counter() - t0)
            tokens.append(last[0])
        return {"prefill_ms": 1e3 * prefill, "decode_ms": [1e3 * t for t in steps], "tokens": tokens}

    def run(prompt: list[int], n: int, batch: int = 1) -> dict:
        if batch > 1:
            return run_batch(prompt, n, batch)
        llm.reset()  # n_tokens = 0: the next eval overwrites the cache from position 0
        t0 = time.perf_counter()
        llm.eval(prompt)
        token = next_token()
        prefill = time.perf_counter() - t0
        tokens, decode = [token], []
        for _ in range(n - 1):
            t0 = time.perf_counter()
            llm.eval([token])
            token = next_token()
            decode.append(time.perf_counter() - t0)
            tokens.append(token)
        return {"prefill_ms": 1e3 * prefill, "decode_ms": [1e3 * s for s in decode], "tokens": tokens}

    note = ", extra weight buffers off (its AMX matmul crashes on this CPU; no repacking)" if amx else ""
    return run, f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), KV {spec.get('kv', 'f16')}{note}"


def _openvino(spec: dict):
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    # Prefix caching off: every round sends the same prompt, and a cached prefix would be timed
    # as a prefill. The whole prompt in one scheduler batch (its default splits prefill into
    # 256-token chunks, which measured slower here): its best time to first token.
    scheduler = genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False
    scheduler.max_num_batched_tokens = max(spec.get("n_ctx", 4096), 256)
    pipe = genai.LLMPipeline(spec["path"], "CPU", scheduler_config=scheduler, INFERENCE_NUM_THREADS=spec["threads"])

    def run(prompt: list[int], n: int) -> dict:
        config = genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = n  # no stop at EOS
        config.do_sample = False
        ids = np.array([prompt], dtype=np.int64)
        out = pipe.generate(genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), config)
        metrics = out.perf_metrics  # its own clocks: time to first token, then the gap before each token
        return {"prefill_ms": metrics.get_ttft().mean,
                "decode_ms": [us / 1e3 for us in metrics.raw_metrics.m_durations][: n - 1],
                "tokens": [int(t) for t in out.tokens[0]]}

    return run, (f"OpenVINO GenAI {genai.get_version()}, {Path(spec['path']).name}, prefix caching off, "
                 "whole prompt in one batch")


ENGINES = {"workbench": _workbench, "transformers": _transformers, "llama.cpp": _llama_cpp, "openvino": _openvino}


def main() -> int:
    spec = json.loads(sys.argv[1])
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints stays out of the protocol
    try:
        run, description = ENGINES[spec["engine"]](spec)
    except Exception as e:  # reported to the parent, which names the engine
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), file=out, flush=True)
        return 1
    print(json.dumps({"ready": description}), file=out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            batch = request.get("batch", 1)
            reply = run(request["prompt"], request["new_tokens"], batch) if batch > 1 else run(
                request["prompt"], request["new_tokens"])
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
