"""The user-facing model: load once, then logits and generation with switchable
attention backend, KV-cache dtype and thread count, with per-layer timings built in.

    import workbench as wb
    model = wb.load_model("smollm2-135m")
    out = model.generate("The capital of France is", max_new_tokens=32, attention="slim", kv_cache="int8")
    out.text, out.token_ids, out.timings
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from workbench.model.llama import LlamaModel
from workbench.model.loaders import ModelLoadError, check_memory, resolve
from workbench.model.switches import SwitchProperties, Switches
from workbench.runtime.sampling import sample
from workbench.runtime.threads import get_threads, set_threads
from workbench.model.timing import StepRecord, Timings


@dataclass
class GenerationResult:
    text: str | list[str]
    token_ids: list[int] | list[list[int]]
    prompt_token_ids: list[list[int]]
    timings: Timings
    switches: Switches  # as they ran: kv_kernel is the kernel that read the cache
    step_path: str = "reference"  # the path decode steps ran: "fused" or "reference" (Switches.step asks)
    max_new_tokens: int | None = None  # what was asked for: fewer tokens means a sequence stopped at end-of-sequence
    sampling: dict | None = None  # temperature, top_k, top_p, seed, stop_at_eos as they ran

    def summary_line(self) -> str:
        """One line for people: prefill time, decode rate, achieved GB/s and GFLOP/s, switches."""
        s = self.timings.summary()
        return (f"prefill {s['prefill_ms']:.1f} ms | decode {s['decode_tokens_per_s']:.1f} tokens/s (over the wall "
                f"time), step {s['decode_step_ms']:.2f} ms (median), "
                f"{s['decode_gbps']:.2f} GB/s, {s['decode_gflops']:.1f} GFLOP/s | "
                f"attention={self.switches.attention} kv_cache={self.switches.kv_text} step={self.step_path}")

    def report(self) -> str:
        """A few lines: the tokens and the summary line, then the per-layer split of a decode
        step (or of the prefill, when nothing was decoded)."""
        n = len(self.token_ids) if self.token_ids and isinstance(self.token_ids[0], int) else \
            sum(map(len, self.token_ids))
        split = self.timings.per_part_text("decode") or self.timings.per_part_text("prefill")
        seqs = [self.token_ids] if self.token_ids and isinstance(self.token_ids[0], int) else self.token_ids
        short = sum(1 for t in seqs if self.max_new_tokens and len(t) < self.max_new_tokens)
        stop = ""
        if short:
            stop = (f" (stopped at end-of-sequence before the {self.max_new_tokens} asked for)" if len(seqs) == 1 else
                    f" ({short} of {len(seqs)} sequences stopped at end-of-sequence before {self.max_new_tokens})")
        lines = [f"{n} tokens{stop} | {self.summary_line()}", split]
        decode = self.timings.decode_steps
        if decode and decode[0].comm_bytes:  # tensor parallel: what the collectives cost per token
            comm_ms = 1e3 * statistics.median(s.comm_s for s in decode)
            step_ms = self.timings.step_ms("decode")
            kb = statistics.median(s.comm_bytes for s in decode) / 1e3
            lines.append(f"communication per decode step, the layers' all-reduces and the head's collectives "
                         f"(median): {comm_ms:.2f} ms ({100 * comm_ms / step_ms:.0f}% of the median step), "
                         f"{kb:.1f} KB sent by rank 0")
        checks = getattr(self, "topk_log", None)
        if checks:
            agree = sum(c["top1_agrees"] for c in checks)
            overlap = sum(c["topk_overlap"] for c in checks) / len(checks)
            lines.append(f"top-k check against all logits: top-1 agrees at {agree} of {len(checks)} positions, "
                         f"mean top-k overlap {overlap:.3f}")
        return "\n".join(line for line in lines if line)


class Model(SwitchProperties):
    """A loaded model and its switches. Create with workbench.load_model()."""

    def __init__(self, llama: LlamaModel, tokenizer, description: str):
        self.llama = llama
        self.tokenizer = tokenizer
        self.description = description
        self.switches = Switches()
        self._switch_listeners: list[Callable[[Switches], None]] = []
        self.load_args: dict = {}  # how load_model() was called: what a reproduce command loads again

    def on_switch(self, listener: Callable[[Switches], None]) -> None:
        """listener(switches) after every change of attention or kv_cache (the panel's toggles
        follow %attention / %kvcache this way)."""
        self._switch_listeners.append(listener)

    def _set_switches(self, switches: Switches) -> None:
        if switches != self.switches:
            self.switches = switches
            for listener in list(self._switch_listeners):
                listener(switches)

    @property
    def config(self):
        return self.llama.cfg

    @property
    def weight_dtype(self) -> str:
        return self.llama.weight_dtype

    # attention / kv_cache / kv_kernel / step: SwitchProperties (validated; never touching the weights)

    @property
    def threads(self) -> int:
        return get_threads()

    @threads.setter
    def threads(self, n: int) -> None:
        set_threads(n)

    def __repr__(self) -> str:
        c = self.config
        return (f"<workbench.Model {self.description}: {c.n_layers} layers, dim {c.dim}, {c.n_heads} heads "
                f"({c.n_kv_heads} KV), vocab {c.vocab_size}, weights {self.llama.weight_dtype}, "
                f"attention={self.attention}, kv_cache={self.switches.kv_text}>")

    # -- inference --------------------------------------------------------------------------

    def _encode(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.tokenizer.encode(p) for p in prompt]
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (list, tuple)) for p in prompt):
            return [list(p) for p in prompt]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")

    def _check_ids(self, seqs: list[list[int]]) -> None:
        vocab = self.config.vocab_size
        for s in seqs:
            if not s:
                raise ValueError("a prompt encodes to no tokens; give at least one token")
            bad = [t for t in s if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids must be in [0, {vocab}), got {bad[:5]}")

    def logits(self, token_ids, *, attention: str | None = None) -> torch.Tensor:
        """Prefill logits of every position: token_ids [len] -> fp32 [len, vocab]."""
        seqs = self._encode(token_ids if not isinstance(token_ids, str) else [token_ids])
        if len(seqs) != 1:
            raise ValueError("logits() takes one sequence of token ids")
        self._check_ids(seqs)
        sw = Switches(attention or self.attention, "fp32")
        n = len(seqs[0])
        cache = self.llama.new_cache(1, n, "fp32")
        with torch.inference_mode():
            out, _ = self.llama.prefill(torch.tensor(seqs[0]), [n], cache, sw, all_logits=True)
        return out

    def generate(self, prompt, max_new_tokens: int = 32, *, attention: str | None = None,
                 kv_cache: str | None = None, kv_kernel: str | None = None, step: str | None = None,
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, stop_at_eos: bool = True, record: bool = True,
                 on_token: Callable[[int, list[int]], None] | None = None,
                 on_step: Callable[[StepRecord, Timings], None] | None = None) -> GenerationResult:
        """Generate up to max_new_tokens for one prompt or a batch of prompts of any lengths.

        attention / kv_cache / kv_kernel / step override the model's switches for this call (a
        kv_cache given without kv_kernel is read by its default kernel). temperature 0 is
        greedy; otherwise top_k / top_p sampling with `seed`. on_token(step, ids) is called
        after every step with the new token of each sequence (for streaming); on_step(record,
        timings) after every recorded forward step (for live plots, see workbench.plots)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sw = self.switches.overridden(attention, kv_cache, kv_kernel, step)
        seqs = self._encode(prompt)
        self._check_ids(seqs)
        lens = [len(s) for s in seqs]
        max_len = max(lens) + max_new_tokens
        if max_len > self.config.max_seq_len:
            raise ValueError(f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context of {self.config.max_seq_len} tokens")
        try:
            check_memory(self.config, self.llama.weight_dtype, len(seqs), max_len, sw.kv_cache, weights_loaded=True)
        except ModelLoadError as e:
            raise ValueError(str(e)) from None
        gen = torch.Generator().manual_seed(seed)
        cache = self.llama.new_cache(len(seqs), max_len, sw.kv_cache, sw.kv_kernel)
        sw = replace(sw, kv_kernel=cache.kernel)  # recorded as it runs
        timings = Timings()
        stops = self.tokenizer.stop_ids
        out: list[list[int]] = [[] for _ in seqs]
        done = [False] * len(seqs)

        with torch.inference_mode():
            t0 = time.perf_counter()
            logits, rec = self.llama.prefill(torch.tensor([t for s in seqs for t in s]), lens, cache, sw, record)
            token = sample(logits, temperature, top_k, top_p, gen)
            timings.time_to_first_token_s = time.perf_counter() - t0
            if rec:
                timings.steps.append(rec)
                if on_step:
                    on_step(rec, timings)
            t_decode = time.perf_counter()
            for step in range(max_new_tokens):
                ids = token.tolist()
                for b, t in enumerate(ids):
                    if not done[b]:
                        out[b].append(t)
                        done[b] = stop_at_eos and t in stops
                if on_token:
                    on_token(step, ids)
                if all(done) or step == max_new_tokens - 1:
                    break
                logits, rec = self.llama.decode(token, cache, sw, record)
                token = sample(logits, temperature, top_k, top_p, gen)
                timings.decode_tokens += len(seqs)
                if rec:
                    timings.steps.append(rec)
                    if on_step:
                        on_step(rec, timings)
            timings.decode_s = time.perf_counter() - t_decode

        texts = [self.tokenizer.decode([t for t in o if t not in stops]) for o in out]
        single = isinstance(prompt, str) or (seqs and len(seqs) == 1 and not isinstance(prompt[0], (list, str)))
        path = "reference" if self.llama.fused_decode_blocker(sw, cache) else "fused"
        return GenerationResult(texts[0] if single else texts, out[0] if single else out, seqs, timings, sw, path,
                                max_new_tokens=max_new_tokens,
                                sampling={"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                                          "stop_at_eos": stop_at_eos})


def load_model(name_or_path: str = "smollm2-135m", *, random: bool = False, layers: int | None = None,
               dtype: str | None = None, seed: int = 0, max_batch: int = 1, max_seq_len: int | None = None,
               parallel=None) -> Model:
    """Load a model by preset name or path (see workbench.model.loaders). Raises ModelLoadError.
    dtype: a weight format (workbench.model.weights.WEIGHT_FORMATS) every matrix is converted to;
    None: a GGUF file's own formats (its 4-bit blocks as they are), fp32 for anything else.
    parallel: this process is one rank of a tensor-parallel model (workbench.model.llama.Parallel;
    workbench.distributed.tp.TensorParallel), which keeps its shard of the weights."""
    from workbench.kernels import native

    native.ext  # compile the kernels now if they are not built yet, not inside the first timed step
    llama, tokenizer, description = resolve(name_or_path, random=random, layers=layers, dtype=dtype, seed=seed,
                                            max_batch=max_batch, max_seq_len=max_seq_len, parallel=parallel)
    model = Model(llama, tokenizer, description)
    model.load_args = {"name_or_path": name_or_path, "random": random, "layers": layers, "dtype": dtype, "seed": seed,
                       "max_batch": max_batch, "max_seq_len": max_seq_len}
    return model


__all__ = ["GenerationResult", "Model", "load_model"]
