"""Continuous batching over one model, with prompt-prefix reuse: the scheduler a server
runs (usable without Jupyter or HTTP).

    from workbench.serving import Scheduler
    s = Scheduler(model, slots=8, max_len=2048, chunk=2048, prefix_cache_tokens=8192)
    r = s.submit(prompt_ids, max_new_tokens=64)
    while s.busy:
        s.step()                  # admit, up to `chunk` prompt tokens, one decode step of the batch
    r.output, r.ttft_s, r.token_times

Every step: waiting requests take free slots (each slot is one row of one KV cache, so the
memory is fixed when the scheduler is made); the requests still prefilling run their next
prompt tokens, oldest first, `chunk` tokens in all per step (a token budget, as vLLM's
chunked prefill has), all of them in one forward pass (LlamaModel.extend: one matrix product
per weight over every request's piece, attention per request): a long prompt delays the
running batch by one chunk at a time, not by its whole prefill, and requests that arrive
together are prefilled together; then every decoding request advances one token
in one batched decode step (LlamaModel.decode, on the fused C++ step where the switches
allow) over the cache rows up to the highest busy slot. Requests leave at end-of-sequence or
their token limit and free their slot at once. Each request picks its tokens by its own
Sampling (greedy unless it says otherwise; workbench.runtime.sampling).

Prefix reuse (`prefix_cache_tokens` > 0): when a prompt's prefill ends, the K / V of its
whole blocks of `block` tokens are copied out of its cache row and kept under a hash of the
block and every token before it (a chain, as vLLM's prefix caching hashes blocks), least
recently used first out when the budget is full. A new request whose prompt starts with
kept blocks gets them copied into its row (positions unchanged) and prefills only the rest.
`stats` counts the tokens reused and the bytes of K / V not recomputed.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from workbench.model.switches import Switches
from workbench.runtime.sampling import Sampling, sample


# Prompt tokens prefilled per step, as vLLM's CPU server has it (max_num_batched_tokens 2048):
# prompts that arrive together get their first tokens together. A smaller budget keeps the
# running requests' inter-token latency down while long prompts arrive, at the cost of the
# time to first token of the prompts that wait for the next step.
DEFAULT_CHUNK = 2048


class QueueFull(RuntimeError):
    """The scheduler's waiting queue is at its limit (a server answers 429 / 503)."""


GREEDY = Sampling()


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    stop_at_eos: bool = True
    sampling: Sampling = GREEDY
    output: list[int] = field(default_factory=list)
    state: str = "waiting"  # waiting -> prefill -> decode -> done
    slot: int | None = None
    filled: int = 0  # prompt tokens in the cache (reused or prefilled)
    reused: int = 0  # of them, copied from the prefix cache
    arrival_s: float = 0.0
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was produced
    finish_s: float | None = None
    finish_reason: str | None = None  # "eos", "length", "cancelled" (or "error", set by a server)
    block_keys: list[bytes] = field(default_factory=list, repr=False)  # prefix reuse: its whole blocks' hashes
    generator: torch.Generator | None = field(default=None, repr=False)  # a sampled request's draws

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from this request's row of logits [V]."""
        s = self.sampling
        if s.temperature == 0:
            return int(logits.argmax())
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.id if s.seed is None else s.seed)
        return int(sample(logits[None].float(), s.temperature, s.top_k, s.top_p, self.generator)[0])

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def done(self) -> bool:
        return self.state == "done"


@dataclass
class PrefixBlock:
    # per layer: K of the block's tokens as the cache stores them (None: a ring layer whose
    # ring no longer held the block when its prompt ended)
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor]
    key_scales: list[torch.Tensor | None]
    value_scales: list[torch.Tensor | None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ts in (self.keys, self.values, self.key_scales, self.value_scales)
                   for t in ts if t is not None)


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class Scheduler:
    """Continuous batching with chunked prefill and prefix reuse over `model` (a loaded
    workbench Model). slots: sequences decoded together at most; max_len: tokens per
    sequence (prompt and output); chunk: prompt tokens prefilled per step; kv_cache /
    kv_kernel: the cache's format (any of KV_FORMATS whose kernel keeps token rows);
    prefix_cache_tokens: the prefix cache's budget in tokens (0: no reuse; None, the default:
    half the memory available once the model and its slots' cache are in place, in tokens of
    K / V, as vLLM and llama.cpp's server reuse prefixes by default; off where the cache's
    layout cannot give token rows, and `prefix_note` says so); block: tokens per kept block;
    max_queue: waiting requests at most (submit raises QueueFull beyond)."""

    def __init__(self, model, *, slots: int = 8, max_len: int | None = None, chunk: int = DEFAULT_CHUNK,
                 kv_cache: str | None = None, kv_kernel: str | None = None, prefix_cache_tokens: int | None = None,
                 block: int = 16, max_queue: int = 256):
        self.model, self.llama = model, model.llama
        self.slots = _positive("slots", slots)
        self.max_len = _positive("max_len", max_len or model.config.max_seq_len)
        if self.max_len > model.config.max_seq_len:
            raise ValueError(f"max_len must be at most the model's context ({model.config.max_seq_len}), "
                             f"got {self.max_len}")
        self.chunk = _positive("chunk", chunk)
        self.block = _positive("block", block)
        self.max_queue = _positive("max_queue", max_queue)
        auto = prefix_cache_tokens is None
        self.prefix_budget = 0 if auto else _positive("prefix_cache_tokens", prefix_cache_tokens, 0)
        self.switches = model.switches.overridden(kv_cache=kv_cache, kv_kernel=kv_kernel)
        self.cache = self.llama.new_cache(self.slots, self.max_len, self.switches.kv_cache, self.switches.kv_kernel)
        self.prefix_note = "" if auto else (f"prefix reuse: {self.prefix_budget} tokens" if self.prefix_budget
                                            else "prefix reuse off")
        if auto:
            self.prefix_budget, self.prefix_note = self._auto_prefix_budget()
        # With prefix reuse and sliding windows, a request's prefill pieces are at most the
        # shortest ring less a block: every block is then whole in the rings at the end of some
        # piece, when it is kept (a longer piece overwrites a ring's first blocks within itself).
        rings = [r for r in self.cache.rings if r]
        self.piece_limit = min(rings) - self.block if self.prefix_budget and rings else self.chunk
        if self.piece_limit < 1:
            raise ValueError(f"block ({self.block}) must be shorter than the shortest sliding window ({min(rings)}) "
                             f"for prefix reuse")
        if self.prefix_budget and self.cache.kernel is None:
            raise ValueError(f"prefix reuse copies blocks of token rows; kv_cache {self.switches.kv_cache!r} is a "
                             f"reference format quantized across tokens: use a kernel format with prefix_cache_tokens")
        if self.prefix_budget and self.cache.tiled:
            raise ValueError(f"prefix reuse copies token rows; kv_kernel {self.cache.kernel!r} stores K / V in "
                             f"tiles: use kv_kernel 'dot' or 'widen' with prefix_cache_tokens")
        self.switches = Switches(self.switches.attention, self.switches.kv_cache, self.cache.kernel,
                                 self.switches.step)
        self.stops = model.tokenizer.stop_ids
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}  # slot -> request
        self._views: dict[int, object] = {}  # n -> the cache's first n rows (kept: each has its fused step)
        self._prefix: OrderedDict[bytes, PrefixBlock] = OrderedDict()
        self._ids = itertools.count()
        self.stats = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "reused_bytes": 0,
                      "prefilled_tokens": 0, "decode_steps": 0, "decode_paths": set()}
        # Called with a request the moment it gets a token (a server streams it from there):
        # a prompt's first token goes out when its prefill ends, not after the step's decode.
        self.on_token: Callable[[Request], None] | None = None

    def _auto_prefix_budget(self) -> tuple[int, str]:
        """(budget, what it is): half the memory available now, in tokens of every layer's K and
        V; 0 where the cache's layout cannot hand back token rows."""
        from workbench.model.kv_formats import kv_format
        from workbench.model.loaders import available_memory_bytes

        if self.cache.kernel is None or self.cache.tiled:
            why = (f"kv_cache {self.switches.kv_cache!r} is quantized across tokens" if self.cache.kernel is None
                   else f"kv_kernel {self.cache.kernel!r} keeps K / V in tiles (use 'dot' or 'widen' to reuse)")
            return 0, f"prefix reuse off: {why}"
        cfg = self.model.config
        per_token = kv_format(self.switches.kv_cache).cache_bytes(cfg.n_layers, self.cache.kv_heads, cfg.head_dim, 1, 1)
        free = available_memory_bytes()
        budget = max(0, int(free // 2 // per_token) // self.block * self.block)
        return budget, (f"prefix reuse: up to {budget} tokens ({budget * per_token / 2**30:.1f} GiB, half of the "
                        f"{free / 2**30:.1f} GiB available)")

    # -- requests ------------------------------------------------------------------------
    def submit(self, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True,
               sampling: Sampling = GREEDY) -> Request:
        """Queue a request; returns it (its fields fill in as it runs). A ValueError names
        what is wrong with it; QueueFull when max_queue requests already wait."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue {self.max_queue})")
        return self.enqueue(self.new_request(prompt, max_new_tokens, stop_at_eos, sampling))

    def new_request(self, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True,
                    sampling: Sampling = GREEDY) -> Request:
        """A checked request, not yet queued (a server checks on its own thread, then hands it
        to the scheduler's with enqueue)."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt must hold token ids in 0..{vocab - 1}")
        _positive("max_new_tokens", max_new_tokens)
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_len "
                             f"({self.max_len})")
        if not isinstance(sampling, Sampling):
            raise ValueError(f"sampling must be a Sampling, got {type(sampling).__name__}")
        return Request(next(self._ids), list(prompt), max_new_tokens, stop_at_eos, sampling,
                       arrival_s=time.perf_counter())

    def enqueue(self, request: Request) -> Request:
        self.waiting.append(request)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(request.prompt)
        return request

    def cancel(self, request: Request) -> None:
        """Drop a request (a client that went away): its slot is free for the next step."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request.slot is not None and self.running.get(request.slot) is request:
            del self.running[request.slot]
        request.state, request.finish_reason = "done", request.finish_reason or "cancelled"

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one iteration -------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit, prefill up to `chunk` prompt tokens (oldest requests first), decode one token
        for every decoding request; returns the requests that finished in this step."""
        finished: list[Request] = []
        with torch.inference_mode():
            self._admit()
            budget, pieces = self.chunk, []
            for r in sorted((r for r in self.running.values() if r.state == "prefill"), key=lambda r: r.arrival_s):
                if budget == 0:
                    break
                pieces.append((r, r.prompt[r.filled:r.filled + min(budget, self.piece_limit)]))
                budget -= len(pieces[-1][1])
            if pieces:
                self._prefill(pieces, finished)
            decoding = [r for r in self.running.values() if r.state == "decode"]
            if decoding:
                self._decode(decoding, finished)
        return finished

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.busy:
            self.step()

    def _admit(self) -> None:
        free = [s for s in range(self.slots) if s not in self.running]
        while free and self.waiting:
            r = self.waiting.pop(0)
            r.slot, r.state = free.pop(0), "prefill"
            self.running[r.slot] = r
            r.filled = r.reused = self._reuse_prefix(r)

    def _prefill(self, pieces: list[tuple[Request, list[int]]], finished: list[Request]) -> None:
        """Each request's next prompt tokens, all in one forward pass (one matrix product per
        weight over every piece's tokens); a request whose prompt is done emits its first token."""
        seq_lens = [len(piece) for _, piece in pieces]
        tokens = torch.tensor([t for _, piece in pieces for t in piece])
        logits, _ = self.llama.extend(tokens, seq_lens, [r.slot for r, _ in pieces], [r.filled for r, _ in pieces],
                                      self.cache)
        self.stats["prefilled_tokens"] += len(tokens)
        for b, (r, piece) in enumerate(pieces):
            r.filled += len(piece)
            self._keep_prefix(r)  # the blocks this piece completed, while the rings still hold them
            if r.filled == len(r.prompt):
                self.cache.lengths[r.slot] = r.filled
                r.state = "decode"
                self._emit(r, r.pick(logits[b]), finished)

    def _decode(self, decoding: list[Request], finished: list[Request]) -> None:
        n = max(r.slot for r in decoding) + 1
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.cache.rows(n)
        tokens = torch.zeros(n, dtype=torch.int64)
        # Rows that are not decoding write a throwaway token where nothing is kept: a free
        # row at 0, a row still prefilling at its next prompt position (its next chunk
        # overwrites it before anything reads it).
        lengths = torch.zeros(n, dtype=torch.int64)
        for slot, r in self.running.items():
            if slot < n:
                lengths[slot] = self.cache.lengths[slot] if r.state == "decode" else r.filled
        for r in decoding:
            tokens[r.slot] = r.output[-1]
        view.lengths = lengths
        logits, rec = self.llama.decode(tokens, view, self.switches, record=True)
        self.stats["decode_steps"] += 1
        self.stats["decode_paths"].add(rec.path)
        for r in decoding:
            self.cache.lengths[r.slot] += 1
            self._emit(r, r.pick(logits[r.slot]), finished)

    def _emit(self, r: Request, token: int, finished: list[Request]) -> None:
        now = time.perf_counter()
        r.output.append(token)
        r.token_times.append(now)
        if r.first_token_s is None:
            r.first_token_s = now
        reason = ("eos" if r.stop_at_eos and token in self.stops else
                  "length" if len(r.output) >= r.max_new_tokens else None)
        if reason:
            r.state, r.finish_reason, r.finish_s = "done", reason, now
            del self.running[r.slot]
            finished.append(r)
        if self.on_token is not None:
            self.on_token(r)

    # -- prefix reuse ----------------------------------------------------------------------
    def _block_keys(self, prompt: list[int], blocks: int) -> list[bytes]:
        keys, h = [], hashlib.sha256()
        for b in range(blocks):
            h.update(torch.tensor(prompt[b * self.block:(b + 1) * self.block], dtype=torch.int64).numpy().tobytes())
            keys.append(h.copy().digest())
        return keys

    def _slots(self, layer: int, lo: int, hi: int):
        """Where positions lo..hi-1 sit in layer's cache row: a slice, or a ring's slots."""
        ring = self.cache.rings[layer]
        return torch.arange(lo, hi) % ring if ring else slice(lo, hi)

    def _reusable(self, blocks: list[PrefixBlock]) -> int:
        """How many of the matched blocks can be reused: every layer must get back what it
        would hold after prefilling them (a ring layer only its last `window` tokens, whose
        blocks it kept only if they were still in its ring when their prompt ended)."""
        m = len(blocks)
        while m:
            ok = all(blocks[j].keys[i] is not None
                     for i, ring in enumerate(self.cache.rings) if ring
                     for j in range(max(0, m * self.block - ring) // self.block, m))
            if ok:
                return m
            m -= 1
        return 0

    def _reuse_prefix(self, r: Request) -> int:
        """Copy the longest kept prefix of r's prompt into its row; the tokens reused (at least
        one prompt token is always left to prefill, for the first output's logits)."""
        if not self.prefix_budget:
            return 0
        r.block_keys = self._block_keys(r.prompt, len(r.prompt) // self.block)  # kept again after its prefill
        usable = (len(r.prompt) - 1) // self.block
        blocks = []
        for key in r.block_keys[:usable]:
            if key not in self._prefix:
                break
            self._prefix.move_to_end(key)
            blocks.append(self._prefix[key])
        matched = self._reusable(blocks)
        c = self.cache
        for i, ring in enumerate(c.rings):
            first = max(0, matched * self.block - ring) // self.block if ring else 0
            for j in range(first, matched):  # in position order: a ring's newest token wins its slot
                block, slots = blocks[j], self._slots(i, j * self.block, (j + 1) * self.block)
                c.k[i][r.slot, :, slots] = block.keys[i]
                c.v[i][r.slot, :, slots] = block.values[i]
                if c.k_scale[i] is not None:
                    c.k_scale[i][r.slot, :, slots] = block.key_scales[i]
                    c.v_scale[i][r.slot, :, slots] = block.value_scales[i]
                self.stats["reused_bytes"] += sum(t[i].nbytes for t in (block.keys, block.values, block.key_scales,
                                                                         block.value_scales) if t[i] is not None)
        self.stats["reused_tokens"] += matched * self.block
        return matched * self.block

    def _keep_prefix(self, r: Request) -> None:
        """Keep the K / V of r's prompt blocks filled so far (a ring layer's where its ring still
        holds them: its last `window` tokens). Called after each prefill piece, which
        piece_limit keeps short enough that every block is whole in the rings after some piece."""
        if not self.prefix_budget:
            return
        c, n = self.cache, r.filled

        def take(planes, i, lo, hi):
            ring = c.rings[i]
            if planes[i] is None or (ring and lo < n - ring):
                return None
            return planes[i][r.slot, :, self._slots(i, lo, hi)].clone()

        for b, key in enumerate(r.block_keys[:n // self.block]):
            lo, hi = b * self.block, (b + 1) * self.block
            kept = self._prefix.get(key)
            if kept is not None:
                self._prefix.move_to_end(key)
                for i in range(len(c.k)):  # a ring layer's part this prompt still holds, if missing
                    if kept.keys[i] is None and take(c.k, i, lo, hi) is not None:
                        kept.keys[i], kept.values[i] = take(c.k, i, lo, hi), take(c.v, i, lo, hi)
                        kept.key_scales[i], kept.value_scales[i] = take(c.k_scale, i, lo, hi), take(c.v_scale, i, lo, hi)
                continue
            layers = range(len(c.k))
            self._prefix[key] = PrefixBlock([take(c.k, i, lo, hi) for i in layers], [take(c.v, i, lo, hi) for i in layers],
                                            [take(c.k_scale, i, lo, hi) for i in layers],
                                            [take(c.v_scale, i, lo, hi) for i in layers])
            while len(self._prefix) * self.block > self.prefix_budget:
                self._prefix.popitem(last=False)  # least recently used

    @property
    def prefix_cache_bytes(self) -> int:
        return sum(b.nbytes for b in self._prefix.values())
