"""`workbench serve` (or a peer's server) as a child process on 127.0.0.1 (what %serve start,
bench/serving.py and the tests start and stop): its command, its URL, waiting until it
answers, stopping it; and reading a server's /metrics."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

from workbench.serving.scheduler import DEFAULT_CHUNK


_SAMPLE = re.compile(r"^([^\s{#]+)(?:\{[^}]*\})?\s+(\S+)")  # name{labels} value [timestamp]


def metric_counters(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its labels} (vLLM labels its
    counters per engine; ours has none)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
            except ValueError:
                continue
    return found


def read_metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {name: value} (metric_counters); an httpx.HTTPError where it
    does not answer or serves none."""
    import httpx

    r = httpx.get(url.rstrip("/") + "/metrics", timeout=10)
    r.raise_for_status()
    return metric_counters(r.text)


def server_args(model, *, slots: int = 8, chunk: int = DEFAULT_CHUNK, prefix_cache_tokens: int | None = None,
                max_queue: int = 256,
                max_len: int | None = None) -> list[str]:
    """`workbench serve` options that load `model` again as load_model() loaded it (its
    load_args), with its weights' dtype and KV cache switch, and the scheduler's settings."""
    load = model.load_args
    options = ["--model", str(load.get("name_or_path") or "smollm2-135m"), "--dtype", load.get("dtype") or model.weight_dtype,
               "--kv-cache", model.kv_cache, "--slots", str(slots), "--chunk", str(chunk),
               "--max-queue", str(max_queue)]
    if prefix_cache_tokens is not None:  # else the server's default: reuse on, its budget from memory
        options += ["--prefix-cache-tokens", str(prefix_cache_tokens)]
    if model.kv_kernel:
        options += ["--kv-kernel", model.kv_kernel]
    if load.get("random"):
        options.append("--random")
    if load.get("layers"):
        options += ["--layers", str(load["layers"])]
    if max_len:
        options += ["--max-len", str(max_len)]
    return options


# `workbench serve`'s port, and %serve's where it is free: README's examples and any client
# configured for the usual address find the server there.
DEFAULT_PORT = 8000


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on host:port and it can be bound now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def default_port(host: str = "127.0.0.1") -> tuple[int, str | None]:
    """DEFAULT_PORT where it is free, else a free port and a sentence saying why."""
    if port_is_free(DEFAULT_PORT, host):
        return DEFAULT_PORT, None
    port = free_port(host)
    return port, f"port {DEFAULT_PORT} is in use on {host}, so the server took {port}"


class ServerProcess:
    """A `workbench serve` child: model / load options as the CLI takes them (e.g.
    ["--model", "smollm2-135m", "--dtype", "bf16"]) and the server's own options. Another
    OpenAI-compatible server: `command` (its words may hold {host} and {port}) and the path
    that answers 200 once it is ready (`ready_path`)."""

    def __init__(self, args: list[str] = (), host: str = "127.0.0.1", port: int | None = None, *,
                 command: list[str] | None = None, ready_path: str = "/health", env: dict[str, str] | None = None):
        self.host, self.port = host, port or free_port(host)
        if command is None:
            command = [sys.executable, "-m", "workbench.cli", "serve", *args, "--host", host, "--port", str(self.port)]
        self.command = [c.format(host=host, port=self.port) for c in command]
        self.ready_path = ready_path
        self.env = dict(env or {})  # set for the child, on top of this process's environment
        self.proc: subprocess.Popen | None = None
        self.log = None  # the server's stderr, a temporary file

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def shell_command(self) -> str:
        """The command as a user would type it (with its environment settings first)."""
        settings = [f"{k}={v}" for k, v in self.env.items()]
        if self.command[1:4] == ["-m", "workbench.cli", "serve"]:
            return " ".join([*settings, "workbench", *self.command[3:]])
        return " ".join([*settings, *("python" if c == sys.executable else c for c in self.command)])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 300) -> ServerProcess:
        import tempfile

        import httpx

        # The server's output goes to a file, not a pipe: a chatty server (llama.cpp logs every
        # graph node) would fill a pipe nobody reads and block before it ever answers.
        with socket.socket() as probe:  # else the ready check below would hear whoever holds the port
            if probe.connect_ex((self.host, self.port)) == 0:
                raise RuntimeError(f"port {self.port} on {self.host} is in use: pick another (port=) or stop its server")
        self.log = tempfile.TemporaryFile(mode="w+")
        import os

        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
                                     env={**os.environ, **self.env} if self.env else None)
        deadline = time.time() + timeout_s
        while True:
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                self.proc.wait()
                self.log.seek(0)
                err = self.log.read()[-2000:]
                self.proc = None
                raise RuntimeError(f"`{self.shell_command}` did not start: {err.strip() or 'no output'}")
            time.sleep(0.3)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 20 s: the exit code (None when nothing ran)."""
        code = None
        if self.proc is not None:
            self.proc.terminate()
            try:
                code = self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None
        return code
