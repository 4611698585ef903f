"""An OpenAI-compatible HTTP server over the scheduler (`workbench serve`).

    workbench serve --model smollm2-135m --port 8000 --slots 8    # prefix reuse on (--prefix-cache-tokens 0: off)
    curl http://127.0.0.1:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 8}'

Endpoints: POST /v1/completions and /v1/chat/completions (with "stream": true, server-sent
events ending in `data: [DONE]`), GET /health, GET /metrics (Prometheus text). Built on
Starlette and served by uvicorn, bound to 127.0.0.1 unless told otherwise.

The scheduler (`Engine`) runs on the process's main thread, the one that loaded the model, and
HTTP (uvicorn's event loop) on a thread of its own: the event loop hands the engine requests
through a queue and gets each new token back on the request's asyncio queue, so HTTP stays
responsive while a step runs. The kernels run on OpenMP (libgomp), which keeps one pool of
workers per thread that starts parallel regions; a second such thread makes the process
manage more threads than it has CPUs, and libgomp then stops spinning between regions, so
every region pays a futex wake-up: a batch-1 decode step ran 1.5-2x slower on a thread that
was not the one that loaded the model. Keeping all the compute on one thread avoids that.

A bad request is a 400 naming the field; a full queue is a 429; a client that disconnects
has its request cancelled and its slot freed at the next step.
Sampling: greedy unless the request says otherwise (temperature, top_p, top_k, seed; the
default temperature is 0 here, where OpenAI's is 1, so an unspecified request is reproducible).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import queue
import statistics
import threading
import time
import uuid

from workbench.serving.scheduler import GREEDY, QueueFull, Request, Sampling, Scheduler

COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "ignore_eos",
                     "stream_options", "n"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt"}) | {"messages", "max_completion_tokens"}


class BadRequest(ValueError):
    """What is wrong with a request body, for a 400."""


class BurstGather:
    """When a server that woke from idle stops waiting for more of a burst. A burst goes on
    while each request follows the last within twice the spacing it allows (gap_s at least),
    and never beyond most x gap_s after the first; a lone request waits gap_s once.

    The spacing allowed is the widest seen in this burst or, learnt, the median of the
    widest spacings of the last `history` bursts of two or more: a burst's spacing is the
    HTTP stack's cost per request on both sides (parse, tokenize; the client's own turn),
    which depends on the machine and its load. A fixed gap cuts bursts wherever one spacing
    runs over it, most often between the first request and the second."""

    def __init__(self, gap_s: float, most: int = 10, history: int = 8):
        self.gap_s, self.most = gap_s, most
        self.widest: collections.deque[float] = collections.deque(maxlen=history)

    def deadline(self, arrivals: list[float]) -> float:
        """arrivals: the times this burst's requests were taken (the first woke the server)."""
        spacing = max((b - a for a, b in zip(arrivals, arrivals[1:])), default=0.0)
        learnt = statistics.median(self.widest) if self.widest else 0.0
        return min(arrivals[0] + self.most * self.gap_s,
                   arrivals[-1] + max(self.gap_s, 2 * spacing, 2 * learnt))

    def ended(self, arrivals: list[float]) -> None:
        """Learn from a burst that has ended (a lone request teaches nothing)."""
        if len(arrivals) > 1:
            self.widest.append(max(b - a for a, b in zip(arrivals, arrivals[1:])))


class Engine:
    """The scheduler's loop, run() on the thread that does the compute (see above). submit()
    is called from the event loop; each new token (or the end) is put on the request's
    asyncio queue as (token ids so far, done)."""

    def __init__(self, scheduler: Scheduler, gather_s: float = 0.003):
        self.scheduler = scheduler
        # Waking from idle, a burst of requests is admitted to the same first step (see
        # BurstGather): clients that send together (a benchmark's concurrency, the next
        # wave of a closed loop) are prefilled together, where the first alone would start a
        # step and hold the rest back by that step. A lone request waits gather_s once.
        self.gather_s = gather_s
        self.bursts = BurstGather(gather_s)
        scheduler.on_token = self._on_token
        self.inbox: queue.Queue = queue.Queue()
        self.listeners: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.generated_tokens = 0
        self.rejected = 0
        self._stop = threading.Event()

    def submit(self, prompt: list[int], max_new_tokens: int, stop_at_eos: bool,
               sampling: Sampling = GREEDY) -> tuple[Request, asyncio.Queue]:
        """Queue a request (checked here, so a bad one fails in the handler): (request, the
        queue its tokens arrive on). Raises ValueError or QueueFull."""
        s = self.scheduler
        # what would wait for a slot: handed over but not admitted, beyond the free slots
        pending = self.inbox.qsize() + len(s.waiting) - (s.slots - len(s.running))
        if pending >= s.max_queue:
            self.rejected += 1
            raise QueueFull(f"{pending} requests are waiting (max_queue {s.max_queue})")
        request = s.new_request(prompt, max_new_tokens, stop_at_eos, sampling)  # validates; not queued yet
        tokens: asyncio.Queue = asyncio.Queue()
        self.listeners[request.id] = (asyncio.get_running_loop(), tokens)
        self.inbox.put(("submit", request))
        return request, tokens

    def cancel(self, request: Request) -> None:
        self.inbox.put(("cancel", request))

    def stop(self) -> None:
        """End run() (from any thread, or a signal handler) after the step in progress."""
        self._stop.set()
        self.inbox.put(("stop", None))

    def run(self, alive=lambda: True) -> None:
        """Serve requests until stop(), or until alive() turns false (checked at least every
        0.5 s while idle: the HTTP thread's health)."""
        s = self.scheduler
        while not self._stop.is_set():
            idle = not s.busy
            try:  # block while idle; otherwise take what arrived and step
                item = self.inbox.get(timeout=0.5 if idle else 0)
            except queue.Empty:
                item = None
                if idle and not alive():
                    return
            arrivals = [time.perf_counter()]
            while item is not None:
                kind, request = item
                if kind == "submit":
                    s.enqueue(request)
                elif kind == "cancel":
                    s.cancel(request)
                    self.listeners.pop(request.id, None)
                elif kind == "stop":
                    return
                try:  # from idle: until the burst's deadline; otherwise only what is already there
                    wait = self.bursts.deadline(arrivals) - time.perf_counter() if idle else 0.0
                    item = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
                    arrivals.append(time.perf_counter())
                except queue.Empty:
                    item = None
            if idle:
                self.bursts.ended(arrivals)
            if not s.busy:
                continue
            try:
                s.step()  # each token goes out as it is picked (on_token)
            except Exception:  # a bug, or memory: fail the requests in flight, keep serving
                import traceback

                traceback.print_exc()
                for r in [*s.running.values(), *s.waiting]:
                    s.cancel(r)
                    r.finish_reason = "error"
                    self._notify(r)
                continue

    def _on_token(self, r: Request) -> None:
        self.generated_tokens += 1
        self._notify(r)

    def _notify(self, r: Request) -> None:
        listener = self.listeners.get(r.id)
        if listener is None:
            return
        loop, tokens = listener
        if r.done:
            self.listeners.pop(r.id, None)
        try:
            loop.call_soon_threadsafe(tokens.put_nowait, (list(r.output), r.done))
        except RuntimeError:  # the loop has closed (server shutting down)
            pass

    def metrics(self) -> str:
        s, st = self.scheduler, self.scheduler.stats
        lines = []

        def metric(name: str, kind: str, value, help_: str) -> None:
            lines.extend([f"# HELP workbench_{name} {help_}", f"# TYPE workbench_{name} {kind}",
                          f"workbench_{name} {value}"])

        metric("requests_total", "counter", st["requests"], "requests accepted")
        metric("requests_rejected_total", "counter", self.rejected, "requests refused with 429 (queue full)")
        metric("requests_running", "gauge", len(s.running), "requests holding a slot")
        metric("requests_waiting", "gauge", len(s.waiting) + self.inbox.qsize(), "requests waiting for a slot")
        metric("prompt_tokens_total", "counter", st["prompt_tokens"], "prompt tokens of accepted requests")
        metric("prefilled_tokens_total", "counter", st["prefilled_tokens"], "prompt tokens computed")
        metric("prefix_reused_tokens_total", "counter", st["reused_tokens"], "prompt tokens reused from the prefix cache")
        metric("prefix_reused_bytes_total", "counter", st["reused_bytes"], "bytes of K / V reused, not recomputed")
        metric("generation_tokens_total", "counter", self.generated_tokens, "tokens generated")
        metric("decode_steps_total", "counter", st["decode_steps"], "batched decode steps")
        metric("prefix_cache_bytes", "gauge", s.prefix_cache_bytes, "bytes of K / V kept for prefix reuse")
        return "\n".join(lines) + "\n"


# -- request bodies ------------------------------------------------------------------------

def parse_body(raw: bytes, allowed: set[str]) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; accepted: {', '.join(sorted(allowed))}")
    return body


def _int_field(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer in {lo}..{hi}, got {value!r}")
    return value


def common_options(body: dict, max_len: int) -> tuple[int, bool, bool, Sampling]:
    """(max_tokens, stream, stop_at_eos, sampling) of a completion or chat body."""
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int_field(body, name, 16, 1, max_len - 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    try:  # null means the default, as in OpenAI's API
        sampling = Sampling(temperature=0 if body.get("temperature") is None else body["temperature"],
                            top_k=body.get("top_k"), top_p=body.get("top_p"), seed=body.get("seed"))
    except ValueError as e:  # names the field, its value and what is accepted
        raise BadRequest(str(e)) from None
    if body.get("n", 1) != 1:
        raise BadRequest(f"n must be 1, got {body.get('n')!r}")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be true or false, got {ignore_eos!r}")
    return max_tokens, stream, not ignore_eos, sampling


def build_app(model, engine: Engine, model_name: str):
    """The Starlette application over `engine`."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    tokenizer = model.tokenizer
    max_len = engine.scheduler.max_len

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    async def completion(http: HTTPRequest, chat: bool):
        try:
            body = parse_body(await http.body(), CHAT_FIELDS if chat else COMPLETION_FIELDS)
            max_tokens, stream, stop_at_eos, sampling = common_options(body, max_len)
            if chat:
                messages = body.get("messages")
                if (not isinstance(messages, list) or not messages or
                        not all(isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                                for m in messages)):
                    raise BadRequest("messages must be a non-empty list of {\"role\": ..., \"content\": \"...\"}")
                try:
                    text = tokenizer.apply_chat_template(messages)
                except Exception as e:  # no template, or one that refuses these roles
                    raise BadRequest(f"messages: the model's chat template cannot apply ({e})") from None
                ids = tokenizer.encode(text)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str) and prompt:
                    ids = tokenizer.encode(prompt)
                elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in prompt):
                    ids = list(prompt)
                else:
                    raise BadRequest("prompt must be a non-empty string or a list of token ids")
            request, tokens = engine.submit(ids, max_tokens, stop_at_eos, sampling)
        except BadRequest as e:
            return error(400, str(e))
        except ValueError as e:  # the scheduler's own checks (lengths, token ids)
            return error(400, str(e))
        except QueueFull as e:
            return error(429, f"overloaded: {e}; retry later", "rate_limit_error")

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if chat:
                key = "delta" if delta else "message"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        def finish_reason() -> str:
            return {"eos": "stop", "error": "error"}.get(request.finish_reason, "length")

        def text_of(ids: list[int], done: bool) -> str:
            if done and request.finish_reason == "eos":
                ids = ids[:-1]  # the end-of-sequence token is not text
            return tokenizer.decode(ids)

        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        if stream:
            async def events():
                sent = ""
                try:
                    while True:
                        ids_so_far, done = await tokens.get()
                        text = text_of(ids_so_far, done)
                        if done or not text.endswith("\ufffd"):  # hold back a half-decoded character
                            delta, sent = text[len(sent):], text
                            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                                     "model": model_name, "choices": [choice(delta, finish_reason() if done else None, True)]}
                            yield f"data: {json.dumps(chunk)}\n\n"
                        if done:
                            break
                    if include_usage:  # OpenAI's stream_options: a last chunk with the counts
                        n = len(ids_so_far)
                        usage = {"prompt_tokens": len(request.prompt), "completion_tokens": n,
                                 "total_tokens": len(request.prompt) + n}
                        yield f"data: {json.dumps({'id': rid, 'object': obj + '.chunk' if chat else obj, 'created': created, 'model': model_name, 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if not request.done:  # the client went away mid-stream
                        engine.cancel(request)

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            while True:
                try:
                    ids_so_far, done = await asyncio.wait_for(tokens.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        engine.cancel(request)
                        return error(499, "client closed the request")
                    continue
                if done:
                    break
        except asyncio.CancelledError:
            engine.cancel(request)
            raise
        if request.finish_reason == "error":
            return error(500, "the scheduler failed on this request (the server's log has the traceback)",
                         "server_error")
        text = text_of(ids_so_far, True)
        n = len(ids_so_far)
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                             "choices": [choice(text, finish_reason(), False)],
                             "usage": {"prompt_tokens": len(request.prompt), "completion_tokens": n,
                                       "total_tokens": len(request.prompt) + n}})

    async def completions(http):
        return await completion(http, chat=False)

    async def chat_completions(http):
        return await completion(http, chat=True)

    async def health(http):
        return JSONResponse({"status": "ok", "model": model_name})

    async def metrics(http):
        return PlainTextResponse(engine.metrics(), media_type="text/plain; version=0.0.4")

    async def models(http):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "workbench"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)])


def serve(model, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, **scheduler_options) -> None:
    """Run the server until SIGINT or SIGTERM (the `workbench serve` command): the scheduler on
    this thread (the one that loaded the model), HTTP on a thread of its own."""
    import signal

    import uvicorn

    engine = Engine(Scheduler(model, **scheduler_options))
    # Everything alive now (the model, its tokenizer's tables, the imported modules) lives
    # as long as the server: out of the collector's reach, a full collection no longer walks
    # it (gc_collect_main took 3% of a prefill's time in a profile of the scheduler's steps).
    gc.freeze()
    http = uvicorn.Server(uvicorn.Config(build_app(model, engine, model_name), host=host, port=port,
                                         log_level="warning"))
    # uvicorn installs no signal handlers off the main thread: these end the engine's loop,
    # and the HTTP thread is told to finish after it.
    previous = {sig: signal.signal(sig, lambda *_: engine.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http.run, name="workbench-http", daemon=True)
    thread.start()
    print(f"workbench serve: {model_name} on http://{host}:{port} (slots {engine.scheduler.slots}, max_len "
          f"{engine.scheduler.max_len}; {engine.scheduler.prefix_note})", flush=True)
    try:
        engine.run(alive=thread.is_alive)
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not http.started:  # e.g. the port was taken: uvicorn logged why
        raise SystemExit(1)
